"""GPT-2's preset of :mod:`nmst_fast.integrations.hf`: the paper's 10-token context by default.

:func:`apply_nmst_to_gpt2` is :func:`~nmst_fast.integrations.hf.apply_nmst` on a GPT-2 model with
``context_length`` 10 unless given or recorded; :class:`GPT2Decoder` is
:class:`~nmst_fast.integrations.hf.HFDecoder`.
"""

from __future__ import annotations

from typing import Any, Optional

from .hf import HFDecoder, apply_nmst
from .hf.structure import base_model_type

GPT2Decoder = HFDecoder
PAPER_CONTEXT_LENGTH = 10  # the paper's GPT-2 setup: t = 1 at the 11th token

__all__ = ["GPT2Decoder", "apply_nmst_to_gpt2"]


def apply_nmst_to_gpt2(model: Any, *, head: Optional[str] = None, eps: Optional[float] = None,
                       context_length: Optional[int] = None, impl: str = "auto") -> Any:
    """:func:`~nmst_fast.integrations.hf.apply_nmst` for a ``GPT2LMHeadModel``; the first
    ``context_length`` tokens of every sequence are context (default 10, the paper's GPT-2 setup)."""
    config = getattr(model, "config", None)
    if config is None or base_model_type(config) != "gpt2":
        raise ValueError(f"apply_nmst_to_gpt2 takes a GPT-2 model; use nmst_fast.integrations.hf.apply_nmst for "
                         f"{type(model).__name__}")
    recorded = getattr(model.config, "nmst", None) or {}
    if context_length is None and "context_length" not in recorded:
        context_length = PAPER_CONTEXT_LENGTH
    return apply_nmst(model, head=head, eps=eps, context_length=context_length, impl=impl)
