"""Metrics for self-terminating decoding: non-termination ratio, lengths, perplexity."""

from __future__ import annotations

import math
import numbers
from typing import Iterable

import numpy as np
import torch


def _as_tensor(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def _lengths_and_terminated(lengths, terminated) -> tuple[torch.Tensor, torch.Tensor]:
    """(lengths (N,), terminated (N,) bool) from either form :func:`non_termination_ratio` accepts."""
    if hasattr(lengths, "lengths") and hasattr(lengths, "terminated"):  # a generate() output
        if terminated is not None:
            raise ValueError("pass terminated only with plain lengths: a generation output carries its own")
        lengths, terminated = lengths.lengths, lengths.terminated
    lengths = _as_tensor(lengths)
    if lengths.dim() != 1 or lengths.numel() == 0:
        raise ValueError(f"lengths must be a non-empty 1-D sequence, got shape {tuple(lengths.shape)}")
    if terminated is None:  # lengths are eos positions; a continuation without eos must carry one > L
        terminated = torch.ones_like(lengths, dtype=torch.bool)
    terminated = _as_tensor(terminated)
    if terminated.shape != lengths.shape:
        raise ValueError(f"terminated must have the shape of lengths {tuple(lengths.shape)}, "
                         f"got {tuple(terminated.shape)}")
    return lengths, terminated.to(device=lengths.device, dtype=torch.bool)


def _check_horizon(L) -> int:
    if isinstance(L, bool) or not isinstance(L, numbers.Integral) or L < 1:
        raise ValueError(f"L must be a positive int, got {L!r}")
    return int(L)


def non_termination_ratio(lengths, L: int, terminated=None) -> float:
    """Fraction of continuations with no eos among their first ``L`` generated tokens.

    Args:
        lengths: the :class:`nmst_fast.generation.GenerationOutput` of a run (its lengths and
            terminated mask), or (N,) lengths: the 1-based position of each continuation's eos.
        L: the horizon, a positive int.
        terminated: with plain lengths, (N,) bool: whether each continuation ended with eos (a
            run stopped at a maximum length reports its unfinished continuations at that length:
            pass this, or pass the run's output). Default: every length is an eos position
            (encode a continuation without eos as a length above L, e.g. ``math.inf``).
    """
    lengths, terminated = _lengths_and_terminated(lengths, terminated)
    stopped_by_L = (lengths <= _check_horizon(L)) & terminated
    return float((~stopped_by_L).double().mean())


def non_termination_curve(lengths, Ls: Iterable[int], terminated=None) -> dict[int, float]:
    """r_nt(L) for every L in ``Ls`` from one decoding run (decode once to max(Ls)); arguments as
    :func:`non_termination_ratio`."""
    lengths, terminated = _lengths_and_terminated(lengths, terminated)
    return {_check_horizon(L): non_termination_ratio(lengths, L, terminated) for L in Ls}


def log_grid(max_length: int, points_per_decade: int = 4) -> list[int]:
    """Roughly log-spaced horizons 1 … max_length for r_nt(L) plots (both ends included)."""
    if isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral) or max_length < 1:
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    if isinstance(points_per_decade, bool) or not isinstance(points_per_decade, numbers.Integral) \
            or points_per_decade < 1:
        raise ValueError(f"points_per_decade must be a positive int, got {points_per_decade!r}")
    decades = math.log10(max_length)
    grid = np.unique(np.round(np.logspace(0, decades, int(decades * points_per_decade) + 1)).astype(int))
    return [int(x) for x in grid if 1 <= x <= max_length]


def length_histogram(lengths, bins: int | Iterable[int] = 50) -> tuple[np.ndarray, np.ndarray]:
    """(counts, bin edges) of generated lengths, for comparing with the data's lengths."""
    return np.histogram(_as_tensor(lengths).cpu().numpy(), bins=bins)


def perplexity(total_nll: float, num_tokens: int) -> float:
    """exp(total NLL / tokens); ``num_tokens`` must exclude context positions."""
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    try:
        return math.exp(total_nll / num_tokens)
    except OverflowError:  # a mean NLL above ~709.78: beyond float64, the perplexity is inf
        return math.inf
