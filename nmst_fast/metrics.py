"""Metrics for self-terminating decoding: non-termination ratio, lengths, perplexity."""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import torch


def _as_tensor(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def non_termination_ratio(lengths, L: int, terminated=None) -> float:
    """Fraction of continuations with no eos among their first ``L`` generated tokens.

    Args:
        lengths: (N,) generated length of each continuation, eos included when it ended with one.
        L: the horizon.
        terminated: (N,) bool, whether the continuation ended with eos. Default: every
            continuation is taken as terminated at its length (pass it when decoding
            stopped at a maximum length without eos).
    """
    lengths = _as_tensor(lengths)
    if lengths.numel() == 0:
        raise ValueError("lengths is empty: no continuations to measure")
    stopped_by_L = lengths <= L
    if terminated is not None:
        stopped_by_L = stopped_by_L & _as_tensor(terminated).to(torch.bool)
    return float((~stopped_by_L).double().mean())


def non_termination_curve(lengths, Ls: Iterable[int], terminated=None) -> dict[int, float]:
    """r_nt(L) for every L in ``Ls`` from one decoding run (decode once to max(Ls))."""
    return {int(L): non_termination_ratio(lengths, int(L), terminated) for L in Ls}


def log_grid(max_length: int, points_per_decade: int = 4) -> list[int]:
    """Roughly log-spaced horizons 1 … max_length for r_nt(L) plots."""
    decades = math.log10(max(max_length, 1))
    grid = np.unique(np.round(np.logspace(0, decades, int(decades * points_per_decade) + 1)).astype(int))
    return [int(x) for x in grid if 1 <= x <= max_length]


def length_histogram(lengths, bins: int | Iterable[int] = 50) -> tuple[np.ndarray, np.ndarray]:
    """(counts, bin edges) of generated lengths, for comparing with the data's lengths."""
    return np.histogram(_as_tensor(lengths).cpu().numpy(), bins=bins)


def perplexity(total_nll: float, num_tokens: int) -> float:
    """exp(total NLL / tokens); ``num_tokens`` must exclude context positions."""
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    return math.exp(total_nll / num_tokens)
