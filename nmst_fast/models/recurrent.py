"""The paper's recurrent language models: tanh-RNN and LSTM with a tied NMST/ST/VA head."""

from __future__ import annotations

import numbers
from typing import Any, Optional

import torch
from torch import nn

from ..head import NMSTHead

# Choi, Cho & Lee (2023), WikiText-2 setup: 2 layers, tied embeddings, no output bias.
PAPER_CONFIGS = {
    "rnn": dict(embedding_dim=256, hidden_size=256, num_layers=2, dropout=0.3),
    "lstm": dict(embedding_dim=512, hidden_size=512, num_layers=2, dropout=0.5),
}


class RecurrentLM(nn.Module):
    """Embedding → 2-layer RNN/LSTM → dropout → tied :class:`NMSTHead`.

    Implements :class:`nmst_fast.generation.DecodingModel`, so :func:`nmst_fast.generate`
    decodes it directly (call ``.eval()`` first: like any module it starts in training mode, with
    dropout on; ``generate`` warns).

    Args:
        vocab_size: V (eos included).
        eos_index: vocabulary index of eos.
        arch: "rnn" (tanh) or "lstm"; sizes default to :data:`PAPER_CONFIGS`. The head is tied to
            the embedding, so the RNN needs hidden_size == embedding_dim and the LSTM hidden_size >=
            embedding_dim (a larger LSTM projects its states back to embedding_dim).
        head, eps, impl: the output head (see :class:`nmst_fast.NMSTHead`).
        pad_index: embedding padding index (nn.Embedding's padding_idx: its lookups get no
            gradient; the tied head's weight row still does, since the loss scores every token), or None.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        eos_index: int,
        arch: str = "lstm",
        head: str = "nmst",
        eps: float = 1e-5,
        embedding_dim: Optional[int] = None,
        hidden_size: Optional[int] = None,
        num_layers: Optional[int] = None,
        dropout: Optional[float] = None,
        pad_index: Optional[int] = None,
        impl: str = "auto",
    ) -> None:
        super().__init__()
        if arch not in PAPER_CONFIGS:
            raise ValueError(f"arch must be one of {tuple(PAPER_CONFIGS)}, got {arch!r}")
        cfg = dict(PAPER_CONFIGS[arch])
        for key, value in dict(embedding_dim=embedding_dim, hidden_size=hidden_size, num_layers=num_layers,
                               dropout=dropout).items():
            if value is not None:
                cfg[key] = value
        E, Hd = cfg["embedding_dim"], cfg["hidden_size"]
        if arch == "lstm" and Hd < E:
            # The LSTM projects its states back to E for the tied head: torch allows only proj_size < hidden.
            raise ValueError(f"the tied LSTM needs hidden_size >= embedding_dim, got hidden_size={Hd}, "
                             f"embedding_dim={E}")
        if arch == "rnn" and Hd != E:
            raise ValueError("the tied tanh-RNN needs hidden_size == embedding_dim")
        if pad_index is not None and (isinstance(pad_index, bool) or not isinstance(pad_index, numbers.Integral)
                                      or not 0 <= pad_index < vocab_size):
            raise ValueError(f"pad_index must be None or an int in [0, vocab_size={vocab_size}), got {pad_index!r}")
        self.arch = arch
        self.embedding = nn.Embedding(vocab_size, E, padding_idx=pad_index)
        rnn_dropout = cfg["dropout"] if cfg["num_layers"] > 1 else 0.0
        if arch == "lstm":
            # With hidden != embedding size, project back so the tied head sees E-dim states.
            self.rnn = nn.LSTM(E, Hd, cfg["num_layers"], dropout=rnn_dropout, batch_first=True,
                               proj_size=E if Hd != E else 0)
        else:
            self.rnn = nn.RNN(E, Hd, cfg["num_layers"], nonlinearity="tanh", dropout=rnn_dropout, batch_first=True)
        self.drop = nn.Dropout(cfg["dropout"])
        self.nmst_head = NMSTHead(E, vocab_size, eos_index=eos_index, head=head, eps=eps,
                                  weight=self.embedding.weight, impl=impl)
        self.config = dict(cfg, arch=arch, vocab_size=vocab_size, eos_index=eos_index, head=head, eps=eps,
                           pad_index=pad_index)

    def forward(self, tokens: torch.Tensor, state: Any = None) -> tuple[torch.Tensor, Any]:
        """(B, T) tokens → hidden states (B, T, E) for the head, and the recurrent state."""
        out, state = self.rnn(self.drop(self.embedding(tokens)), state)
        return self.drop(out), state

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor, *, steps: Optional[torch.Tensor] = None,
             ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
        """Fused NLL of ``targets`` (B, T) given input ``tokens`` (B, T); no (B, T, V) logits."""
        hidden, _ = self(tokens)
        return self.nmst_head.loss(hidden, targets, steps=steps, ignore_index=ignore_index, reduction=reduction)

    # --- DecodingModel protocol -------------------------------------------------------------
    def prefill(self, contexts: torch.Tensor) -> tuple[torch.Tensor, Any]:
        hidden, state = self(contexts)
        return hidden[:, -1], state

    def decode_step(self, tokens: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        hidden, state = self(tokens[:, None], state)
        return hidden[:, 0], state

    def select_cache(self, state: Any, index: torch.Tensor) -> Any:
        if isinstance(state, tuple):  # LSTM (h, c): (layers, B, ·)
            return tuple(s.index_select(1, index) for s in state)
        return state.index_select(1, index)
