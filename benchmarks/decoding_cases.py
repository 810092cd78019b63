"""Per-step token selection cases: the fast path vs the obvious sort-based implementation."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from nmst_fast.decoding import sample, step_log_probs
from nmst_fast.reference import sort_based_sample

BATCHES = (1, 32, 256)
VOCABS = (33278, 50257, 128256)  # WikiText-2 words, GPT-2 BPE, Llama-3
STRATEGIES = {"greedy": (1, None), "top-k 4": (4, None), "top-p 0.4": (None, 0.4), "top-p 0.9": (None, 0.9),
              "sampling (no truncation)": (None, None)}


def make_logits(B: int, V: int, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(B, V, generator=gen, device=device) * 3  # a realistically peaked softmax


def fast(top_k: Optional[int], top_p: Optional[float],
         head: str = "nmst") -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    def step(logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        return sample(logits, head=head, eos_index=logits.shape[1] - 1, eps=1e-5, steps=100,
                      top_k=top_k, top_p=top_p, generator=gen)[0]

    return step


def flashinfer_sampler(top_k: Optional[int],
                       top_p: Optional[float]) -> Optional[Callable[[torch.Tensor, torch.Generator], torch.Tensor]]:
    """FlashInfer's sampler for the VA case (a plain softmax), or None without flashinfer.

    Its top-k / top-p kernels take probabilities, so the softmax is part of the step, as it
    would be for a user starting from logits.
    """
    try:
        from flashinfer import sampling as fi
    except ImportError:
        return None

    def step(logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        if top_k is None and top_p is None:
            if hasattr(fi, "sampling_from_logits"):
                return fi.sampling_from_logits(logits, generator=gen)
            return fi.sampling_from_probs(torch.softmax(logits, dim=-1), generator=gen)
        probs = torch.softmax(logits, dim=-1)
        if top_p is None:
            return fi.top_k_sampling_from_probs(probs, top_k, generator=gen)
        if top_k is None:
            return fi.top_p_sampling_from_probs(probs, top_p, generator=gen)
        return fi.top_k_top_p_sampling_from_probs(probs, top_k, top_p, generator=gen)

    return step


def sort_based(top_k: Optional[int], top_p: Optional[float]) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    """NMST log-probs for the whole vocabulary, full sort, cumulative sum, multinomial."""

    def step(logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        log_p, _ = step_log_probs(logits, head="nmst", eos_index=logits.shape[1] - 1, eps=1e-5, steps=100)
        if top_k == 1:
            return torch.argmax(log_p, dim=1)
        return sort_based_sample(log_p, top_k=top_k, top_p=top_p, generator=gen)

    return step
