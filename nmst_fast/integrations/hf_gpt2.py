"""Decode a Hugging Face ``GPT2LMHeadModel`` with an NMST / ST / VA head via :func:`nmst_fast.generate`."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..head import NMSTHead


class GPT2Decoder(nn.Module):
    """The :class:`nmst_fast.generation.DecodingModel` protocol over a ``GPT2LMHeadModel``.

    The head is tied to the model's ``lm_head`` weight, so ``head="va"`` decodes
    exactly what the model itself would. The KV cache is reordered and compacted
    with the cache's own ``reorder_cache`` (rows are selected, in order).

    Args:
        model: a ``transformers.GPT2LMHeadModel`` (random-init or ``from_pretrained(local_dir)``).
        head, eps: the head to decode with; eos is ``model.config.eos_token_id``.
    """

    def __init__(self, model: nn.Module, *, head: str = "nmst", eps: float = 1e-5) -> None:
        super().__init__()
        self.model = model
        config = model.config
        self.nmst_head = NMSTHead(config.n_embd, config.vocab_size, eos_index=config.eos_token_id, head=head, eps=eps,
                                  weight=model.lm_head.weight)
        # transformers renamed the KV-cache argument (past_key_values -> cache); use what this version takes.
        params = inspect.signature(model.transformer.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def prefill(self, contexts: torch.Tensor) -> tuple[torch.Tensor, Any]:
        out = self.model.transformer(input_ids=contexts, use_cache=True)
        return out.last_hidden_state[:, -1], out.past_key_values

    def decode_step(self, tokens: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        out = self.model.transformer(input_ids=tokens[:, None], use_cache=True, **{self._cache_arg: cache})
        return out.last_hidden_state[:, -1], out.past_key_values

    def select_cache(self, cache: Any, index: torch.Tensor) -> Any:
        cache.reorder_cache(index)
        return cache
