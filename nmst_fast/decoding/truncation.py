"""Ranked-candidate algebra shared by the torch and Triton selection paths.

Both paths first find the most probable non-eos tokens in rank order (they rank
by raw logit); these helpers then place eos among them by its exact float64
effective logit and apply top-k / top-p to the ranked list.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch

TOP_P_SLACK = 1e-12  # a cumulative mass within this of p counts as reaching p (float64 round-off)


def check_truncation(top_k: object, top_p: object) -> None:
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must lie in (0, 1] or be None, got {top_p!r}")


def untruncated(top_k: Optional[int], top_p: Optional[float]) -> bool:
    """Greedy (top_k = 1; top-p after top-1 keeps that one token) or plain sampling: no candidate list."""
    return top_k == 1 or (top_k is None and (top_p is None or top_p >= 1.0))


def insert_eos(
    tokens: torch.Tensor, zeta: torch.Tensor, eos_index: int, eos_zeta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge eos into rank-ordered non-eos candidates.

    Args:
        tokens: (B, C) int64 non-eos candidates, best first (ties → lower index).
        zeta: (B, C) float64 their effective logits.
        eos_index: eos's column; eos_zeta: (B,) float64 its effective logit.
    Returns:
        (tokens, zeta), each (B, C + 1), in rank order: eos follows every candidate with a
        higher ζ, or an equal ζ and a lower index.
    """
    B, C = tokens.shape
    eos = eos_zeta.unsqueeze(1)
    outranks_eos = (zeta > eos) | ((zeta == eos) & (tokens < eos_index))
    eos_pos = outranks_eos.sum(dim=1, keepdim=True)
    slots = torch.arange(C + 1, device=tokens.device).expand(B, -1)
    source = (slots - (slots > eos_pos).long()).clamp(max=C - 1)
    at_eos = slots == eos_pos
    merged_tokens = torch.where(at_eos, eos_index, tokens.gather(1, source))
    merged_zeta = torch.where(at_eos, eos, zeta.gather(1, source))
    return merged_tokens, merged_zeta


def truncate(
    probs: torch.Tensor, top_k: Optional[int], top_p: Optional[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k then top-p on rank-ordered probabilities (B, C) float64.

    ``probs`` holds the top-k tokens when ``top_k`` is given (renormalized here), else
    the C most probable tokens. Top-p keeps the smallest prefix whose mass reaches p
    (at least one token). Returns (renormalized probs with dropped ranks at 0, covered):
    ``covered`` (B,) bool is False for rows whose top-p prefix may extend past the C
    candidates, so the caller must look at more of them.
    """
    covered = torch.ones(probs.shape[0], dtype=torch.bool, device=probs.device)
    if top_k is not None:
        probs = probs / probs.sum(dim=1, keepdim=True)
    if top_p is None or top_p >= 1.0:
        return probs, covered
    cumulative = torch.cumsum(probs, dim=1)
    if top_k is None:
        covered = cumulative[:, -1] >= top_p - TOP_P_SLACK
    mass_before = cumulative - probs  # keep rank j while the mass strictly before it is short of p
    keep = mass_before < top_p - TOP_P_SLACK
    keep[:, 0] = True
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum(dim=1, keepdim=True), covered


def draw(probs: torch.Tensor, generator: Optional[torch.Generator], *, overwrite: bool = False) -> torch.Tensor:
    """One index per row (B, 1) from rows of non-negative weights (B, C), each row with a positive sum.

    CPU: the inverse CDF of a float64 cumulative sum (one pass; ``torch.multinomial`` costs
    ≈ 10× that on CPU, ≈ 0.28 s at 256 × 50257), formed in ``probs`` itself when ``overwrite``
    (float64 weights the caller no longer needs: no second (B, C) buffer). Other devices:
    ``torch.multinomial`` (a parallel scan there need not be monotone, which the inverse CDF
    relies on). A generator on another device than ``probs`` is allowed: the uniforms (CPU)
    or the table move to it.
    """
    if probs.device.type == "cpu":
        in_place = overwrite and probs.dtype == torch.float64
        return inverse_cdf(probs.cumsum_(dim=1) if in_place else torch.cumsum(probs, dim=1, dtype=torch.float64),
                           generator)
    if generator is None or generator.device == probs.device:
        return torch.multinomial(probs, 1, generator=generator)
    return torch.multinomial(probs.to(generator.device), 1, generator=generator).to(probs.device)


def inverse_cdf(cdf: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """One index per row (B, 1) drawn from the weights whose running sums are ``cdf`` (B, C) float64
    (see :func:`search_cdf`), with one float64 uniform per row from ``generator``."""
    device = generator.device if generator is not None else cdf.device
    uniforms = torch.rand((cdf.shape[0], 1), dtype=torch.float64, device=device, generator=generator)
    return search_cdf(cdf, uniforms.to(cdf.device))


def search_cdf(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """(B, 1) the first index i of each row with cdf[i] > u · total, for ``uniforms`` (B, 1) in [0, 1).

    ``cdf`` must come from a sequential cumulative sum (CPU): then cdf[i] > cdf[i − 1] only
    where weight i is positive, so the index found never has weight 0.
    """
    total = cdf[:, -1:]
    # u < 1, but u · total may round up to total, which no entry exceeds: stay one ulp below it.
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)
