"""Ranked-candidate algebra of the torch path: eos placed among the ranked non-eos tokens by its
exact float64 ζ_eos, top-k / top-p / min-p on the ranked list, and inverse-CDF draws."""

from __future__ import annotations

import numbers
from typing import Optional

import torch

from ..validation import check_int

TOP_P_SLACK = 1e-12  # a cumulative mass within this of p counts as reaching p (float64 round-off)


def check_truncation(top_k: object, top_p: object, min_p: object = None) -> None:
    check_int("top_k", top_k, 1, optional=True)
    for name, value, low in (("top_p", top_p, "(0, 1]"), ("min_p", min_p, "[0, 1]")):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a float in {low} or None, got {type(value).__name__}")
        if not (0 < value <= 1 or (name == "min_p" and value == 0)):
            raise ValueError(f"{name} must lie in {low} or be None, got {value!r}")


def active_min_p(min_p: Optional[float]) -> Optional[float]:
    """``min_p`` as the truncation uses it: None where it keeps every token (None or 0)."""
    return None if min_p is None or min_p == 0 else float(min_p)


def untruncated(top_k: Optional[int], top_p: Optional[float], min_p: Optional[float] = None) -> bool:
    """Greedy (top_k = 1; top-p and min-p after top-1 keep that one token) or plain sampling: no candidate list."""
    return top_k == 1 or (top_k is None and (top_p is None or top_p >= 1.0) and active_min_p(min_p) is None)


def insert_eos(
    tokens: torch.Tensor, zeta: torch.Tensor, eos_index: int, eos_zeta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge eos (``eos_zeta`` (B,) float64) into rank-ordered non-eos candidates ``tokens`` (B, C)
    int64 with float64 ``zeta``: (tokens, zeta) each (B, C + 1), eos after every candidate with a
    higher ζ, or an equal ζ and a lower index."""
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
    probs: torch.Tensor, top_k: Optional[int], top_p: Optional[float], min_p: Optional[float] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, then top-p, then min-p on rank-ordered step probabilities (B, C) float64 (untruncated: each
    row's first is its most probable token): the top-k tokens when ``top_k`` is given, else the C most
    probable. Top-p keeps the smallest prefix whose mass (renormalized over the top-k set) reaches p (at
    least one token); min-p the tokens with at least ``min_p`` times the first's probability. Returns
    (renormalized probs, dropped ranks at 0; covered (B,) bool, False where the kept prefix may extend past
    the C candidates)."""
    covered = torch.ones(probs.shape[0], dtype=torch.bool, device=probs.device)
    kept = probs / probs.sum(dim=1, keepdim=True) if top_k is not None else probs
    if top_p is not None and top_p < 1.0:
        cumulative = torch.cumsum(kept, dim=1)
        if top_k is None:
            covered = cumulative[:, -1] >= top_p - TOP_P_SLACK
        mass_before = cumulative - kept  # keep rank j while the mass strictly before it is short of p
        keep = mass_before < top_p - TOP_P_SLACK
        keep[:, 0] = True
        kept = torch.where(keep, kept, 0.0)
    min_p = active_min_p(min_p)
    if min_p is not None:
        floor = min_p * probs[:, :1]
        if top_k is None:  # the candidates hold min-p's whole set once their last falls below its floor
            below = probs[:, -1] < floor[:, 0]
            covered = below if top_p is None or top_p >= 1.0 else covered | below
        kept = torch.where(probs >= floor, kept, 0.0)
    if kept is probs:
        return probs, covered
    return kept / kept.sum(dim=1, keepdim=True), covered


def draw(probs: torch.Tensor, generator: Optional[torch.Generator], *, overwrite: bool = False) -> torch.Tensor:
    """One index per row (B, 1) from non-negative weights (B, C), each row with a positive sum.

    CPU: the inverse CDF of a float64 cumulative sum (``torch.multinomial`` costs ≈ 10× that), in
    ``probs`` itself when ``overwrite``. Other devices: ``torch.multinomial`` (a parallel scan need
    not be monotone, which the inverse CDF relies on). The generator may be on another device.
    """
    if probs.device.type == "cpu":
        in_place = overwrite and probs.dtype == torch.float64
        cdf = probs.cumsum_(dim=1) if in_place else torch.cumsum(probs, dim=1, dtype=torch.float64)
        uniforms = torch.rand((cdf.shape[0], 1), dtype=torch.float64, generator=generator,
                              device=generator.device if generator is not None else cdf.device)
        return search_cdf(cdf, uniforms.to(cdf.device))
    if generator is None or generator.device == probs.device:
        return torch.multinomial(probs, 1, generator=generator)
    return torch.multinomial(probs.to(generator.device), 1, generator=generator).to(probs.device)


def search_cdf(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """(B, 1) the first index i of each row with cdf[i] > u · total, ``uniforms`` (B, 1) in [0, 1).
    ``cdf`` must be a sequential (CPU) cumulative sum: it rises only at positive weights."""
    total = cdf[:, -1:]
    # u < 1, but u · total may round up to total, which no entry exceeds: stay one ulp below it.
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)
