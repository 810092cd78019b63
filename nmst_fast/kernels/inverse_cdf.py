"""The inverse-CDF pick that every draw of the decoding kernels makes (a lane, a column, a split)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def crossing_with(cum, weights, target, index, SIZE, payload, none):
    """Along the last axis, per row: the first index of positive weight whose cumulative weight ``cum``
    exceeds ``target`` (the last positive one when rounding leaves none, -1 when there is none), and
    ``payload`` there (``none`` where there is no positive weight). Only positive weights may be
    picked: a GPU's parallel scan is not monotone to the last ulp, and a zero weight after a block
    boundary can read above its predecessor (an H200 drew outside the nucleus that way)."""
    positive = weights > 0
    crossing = (cum > tl.expand_dims(target, -1)) & positive
    axis: tl.constexpr = len(crossing.shape) - 1
    pick = tl.min(tl.where(crossing, index, SIZE), axis=axis)
    pick = tl.where(pick < SIZE, pick, tl.max(tl.where(positive, index, -1), axis=axis))
    at = (index == tl.expand_dims(pick, -1)) & positive  # the pick's one entry
    value = tl.where(pick >= 0, tl.sum(tl.where(at, payload, 0), axis=axis), none)
    return pick, value
