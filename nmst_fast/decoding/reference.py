"""The obvious sort-based implementation of truncated sampling on NMST log-probs.

Readable and exact: it is the target of the distribution tests and the
baseline of the selection benchmarks. It materializes and fully sorts the
(B, V) distribution, which the fast path in :mod:`.selection` avoids.
"""

from __future__ import annotations

from typing import Optional

import torch


def truncated_distribution(log_probs: torch.Tensor, top_k: Optional[int], top_p: Optional[float]) -> torch.Tensor:
    """(B, V) float64 probabilities after top-k then top-p truncation and renormalization.

    Ranks by probability with ties → lower index (a stable descending sort), keeps
    the first k, renormalizes, then keeps the shortest prefix whose mass reaches p.
    """
    log_probs = log_probs.to(torch.float64)
    order = torch.sort(log_probs, dim=1, descending=True, stable=True).indices
    probs = torch.exp(log_probs.gather(1, order))
    if top_k is not None:
        probs[:, top_k:] = 0.0
        probs = probs / probs.sum(dim=1, keepdim=True)
    if top_p is not None and top_p < 1.0:
        mass_before = torch.cumsum(probs, dim=1) - probs
        keep = mass_before < top_p - 1e-12
        keep[:, 0] = True
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(dim=1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def sort_based_sample(
    log_probs: torch.Tensor,
    *,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Draw one token per row (B,) from the truncated distribution."""
    return torch.multinomial(truncated_distribution(log_probs, top_k, top_p), 1, generator=generator).squeeze(1)
