"""``NMSTHead``: a model's output layer + loss in one module."""

from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import nn

from .loss import linear_nmst_loss
from .reference import nmst_log_probs
from .validation import HEADS, IMPLS, check_choice, check_eps, check_index


class NMSTHead(nn.Module):
    """Output projection with an NMST / ST / VA head.

    Swap a model's ``lm_head`` + cross-entropy for this module: ``head.loss(h, y)``
    trains through the fused kernels (no (N, V) logits), ``head.log_probs(h)``
    gives the full log-distribution for evaluation.

    Args:
        hidden_size: H.
        vocab_size: V (eos included).
        eos_index: vocabulary index of eos.
        head: "nmst", "st" or "va".
        eps: ε in (0, 1).
        bias: learn a (V,) output bias.
        weight: an existing (V, H) parameter to tie to (e.g. the input
            embedding's weight); a fresh one is created otherwise.
        impl: backend for :meth:`loss` (see :func:`nmst_fast.linear_nmst_loss`).
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        eos_index: int,
        head: str = "nmst",
        eps: float = 1e-5,
        bias: bool = False,
        weight: Optional[nn.Parameter] = None,
        impl: str = "auto",
    ) -> None:
        super().__init__()
        check_choice("head", head, HEADS)
        check_choice("impl", impl, IMPLS)
        check_eps(eps)
        for name, value, least in (("hidden_size", hidden_size, 1), ("vocab_size", vocab_size, 2)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < least:
                raise ValueError(f"{name} must be >= {least}" + (" (eos and one other token)" if least == 2 else "")
                                 + f", got {value}")
        check_index("eos_index", eos_index, vocab_size, "vocab_size")
        if weight is not None and not isinstance(weight, nn.Parameter):
            # A plain tensor would stay out of parameters(), state_dict() and .to(): never trained or saved.
            raise TypeError(f"weight must be an nn.Parameter (e.g. embedding.weight), got {type(weight).__name__}")
        self._owns_weight = weight is None
        if weight is None:
            weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        elif tuple(weight.shape) != (vocab_size, hidden_size):
            raise ValueError(f"weight must be (vocab_size, hidden_size)=({vocab_size}, {hidden_size}), got {tuple(weight.shape)}")
        self.weight = weight
        # A tied weight sets the bias's dtype and device: a bf16 or CUDA embedding gets a bias it can be added to.
        self.bias = nn.Parameter(torch.empty(vocab_size, dtype=weight.dtype, device=weight.device)) if bias else None
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.eos_index, self.head, self.eps, self.impl = eos_index, head, eps, impl
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize the head's own parameters: its weight ~ N(0, 1/hidden_size) (a tied weight is
        its owner's to initialize and is left alone) and the bias 0. Also what ``to_empty`` after a
        meta-device construction needs."""
        if self._owns_weight:
            nn.init.normal_(self.weight, std=self.hidden_size**-0.5)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, eos_index={self.eos_index}, "
                f"head={self.head!r}, eps={self.eps}, bias={self.bias is not None}, impl={self.impl!r}")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Raw logits z = W h (+ b), shape (…, V). Materializes them: use :meth:`loss` to train."""
        return nn.functional.linear(hidden, self.weight, self.bias)

    def loss(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        *,
        steps: Optional[torch.Tensor] = None,
        ignore_index: int = -100,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """Fused NLL of ``targets`` (see :func:`nmst_fast.linear_nmst_loss` for shapes)."""
        return linear_nmst_loss(
            hidden, self.weight, targets, eos_index=self.eos_index, eps=self.eps, head=self.head,
            steps=steps, bias=self.bias, ignore_index=ignore_index, reduction=reduction, impl=self.impl,
        )

    def log_probs(self, hidden: torch.Tensor, *, steps: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Full log-distribution (…, V) of the head on ``hidden`` (B, T, H) or (N, H)."""
        return nmst_log_probs(self(hidden), eos_index=self.eos_index, eps=self.eps, head=self.head, steps=steps)
