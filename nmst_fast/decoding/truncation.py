"""Ranked-candidate algebra shared by the torch and Triton selection paths.

Both paths first find the most probable non-eos tokens in rank order (they rank
by raw logit); these helpers then place eos among them by its exact float64
effective logit and apply top-k / top-p to the ranked list.
"""

from __future__ import annotations

from typing import Optional

import torch

TOP_P_SLACK = 1e-12  # a cumulative mass within this of p counts as reaching p (float64 round-off)


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


def truncate(probs: torch.Tensor, top_k: Optional[int], top_p: Optional[float]) -> tuple[torch.Tensor, bool]:
    """Top-k then top-p on rank-ordered probabilities (B, C) float64.

    ``probs`` holds the top-k tokens when ``top_k`` is given (renormalized here), else
    the C most probable tokens. Top-p keeps the smallest prefix whose mass reaches p
    (at least one token). Returns (renormalized probs with dropped ranks at 0, covered):
    ``covered`` is False when top-p's prefix may extend past the C candidates, so the
    caller must look at more of them.
    """
    if top_k is not None:
        probs = probs / probs.sum(dim=1, keepdim=True)
    if top_p is None or top_p >= 1.0:
        return probs, True
    cumulative = torch.cumsum(probs, dim=1)
    covered = top_k is not None or bool((cumulative[:, -1] >= top_p - TOP_P_SLACK).all())
    mass_before = cumulative - probs  # keep rank j while the mass strictly before it is short of p
    keep = mass_before < top_p - TOP_P_SLACK
    keep[:, 0] = True
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum(dim=1, keepdim=True), covered


def draw(probs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """One index per row (B, 1) from rows of probabilities, drawn on the generator's device.

    A CPU generator with CUDA probabilities (or the reverse) is allowed: the (B, C) table
    moves to the generator, the draws come back.
    """
    if generator is None or generator.device == probs.device:
        return torch.multinomial(probs, 1, generator=generator)
    return torch.multinomial(probs.to(generator.device), 1, generator=generator).to(probs.device)
