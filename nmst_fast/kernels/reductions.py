"""Reductions of several values at once: one barrier chain on a GPU, numpy reductions in the interpreter.

A block-wide reduction costs a shuffle tree and two to three barriers on sm_90; a ``tl.reduce`` of a
tuple takes several values through one chain, so the kernels fold a pick and its gathers into one,
with the combine functions below. The CPU interpreter runs a tuple reduction element by element in
Python, so where ``FUSED`` is off the kernels take the same values by built-in reductions;
``tests/test_reductions.py`` checks that both forms agree.
"""

from __future__ import annotations

import triton
import triton.language as tl

_INTERPRETED = bool(triton.knobs.runtime.interpret)
FUSED = tl.constexpr(not _INTERPRETED)  # tuple reductions: on a GPU only


@triton.jit
def _first_and_last(first, first_payload, last, last_payload, other_first, other_first_payload, other_last,
                    other_last_payload):
    """Combine of :func:`crossing_with`: the lower crossing index and the higher positive index, each
    with its payload."""
    lower = first <= other_first
    higher = last >= other_last
    return (tl.where(lower, first, other_first), tl.where(lower, first_payload, other_first_payload),
            tl.where(higher, last, other_last), tl.where(higher, last_payload, other_last_payload))


@triton.jit
def crossing_with(cum, weights, target, index, SIZE, payload, none, FUSED_FORM: tl.constexpr = not _INTERPRETED):
    """Along the last axis, per row: the first index of positive weight whose cumulative weight ``cum``
    exceeds ``target`` (the last positive one when rounding leaves none, -1 when there is none), and
    ``payload`` there (``none`` where there is no positive weight). FUSED_FORM: one reduction of four
    values; else built-in reductions (the default is the platform's). Only positive weights may be
    picked: a GPU's parallel scan is not monotone to the last ulp, and a zero weight after a block
    boundary can read above its predecessor (an H200 drew outside the nucleus that way)."""
    positive = weights > 0
    crossing = (cum > tl.expand_dims(target, -1)) & positive
    axis: tl.constexpr = len(crossing.shape) - 1  # by number: the interpreter mishandles -1 in a tuple reduction
    if FUSED_FORM:
        pick, pick_payload, last, last_payload = tl.reduce(
            (tl.where(crossing, index, SIZE), tl.where(crossing, payload, none), tl.where(positive, index, -1),
             tl.where(positive, payload, none)), axis, _first_and_last)
        found = pick < SIZE
        pick = tl.where(found, pick, last)
        value = tl.where(found, pick_payload, last_payload)
    else:
        pick = tl.min(tl.where(crossing, index, SIZE), axis=axis)
        pick = tl.where(pick < SIZE, pick, tl.max(tl.where(positive, index, -1), axis=axis))
        at = (index == tl.expand_dims(pick, -1)) & positive  # the pick's one entry
        value = tl.where(pick >= 0, tl.sum(tl.where(at, payload, 0), axis=axis), none)
    return pick, value


@triton.jit
def add_pair(a, b, other_a, other_b):
    """Combine: (Σ a, Σ b)."""
    return a + other_a, b + other_b


@triton.jit
def add_and_min(a, b, other_a, other_b):
    """Combine: (Σ a, min b)."""
    return a + other_a, tl.minimum(b, other_b)


@triton.jit
def larger_then_lower(value, index, other_value, other_index):
    """Combine: the largest value with the lowest index holding it (no NaN among the values)."""
    first = (value > other_value) | ((value == other_value) & (index < other_index))
    return tl.where(first, value, other_value), tl.where(first, index, other_index)
