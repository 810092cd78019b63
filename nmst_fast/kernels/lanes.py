"""Streaming reductions over a row kept per lane: no reduction across the tile inside the loop.

A lane is one column position of a BLOCK_V-wide tile, followed across a row's tiles (columns l,
l + BLOCK_V, …). Each lane keeps its running state in registers, so the loop over the tiles has no
barrier; one reduction after it merges the lanes (reducing every tile cost 26-35 sm_90 instructions
per element). Whole tiles clear of eos load without a mask (:func:`tile_spans`). Used by the split-V
scan (``row_scan``) and the row draw (``row_draw``).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
# exp2 of this is 0 in fp32: fold_lanes clamps to it, which turns the NaN of −inf − (−inf) into weight 0.
NO_WEIGHT_EXP2 = tl.constexpr(-200.0)


@triton.jit
def fold_lanes(lane_max, lane_sum, z, neg_scale):
    """Fold a (rows, BLOCK_V) tile of raw logits ``z`` into per-lane online (max z, Σ e^(x − max x)),
    x = z · inv_temp, ``neg_scale`` = −log2(e) · inv_temp; also returns where ``z`` set a new lane max
    (strictly: a tie keeps the earlier column). One exp2 per element: 2^(|z − max| · neg_scale) is
    the new weight or the old sum's rescale. A NaN z makes the lane's max NaN: the row is flagged."""
    d = z - lane_max
    up = d > 0.0
    e = tl.exp2(tl.maximum(tl.abs(d) * neg_scale, NO_WEIGHT_EXP2))
    lane_sum = tl.where(up, lane_sum * e + 1.0, lane_sum + e)
    return tl.maximum(lane_max, z, propagate_nan=tl.PropagateNan.ALL), lane_sum, up


@triton.jit
def merge_lanes(lane_max, lane_sum, inv_temp):
    """Per row: max z over the lanes, and each lane's mass Σ e^(x − max x), x = z · inv_temp."""
    m = tl.max(lane_max, axis=1)
    shift = tl.where(m == float("-inf"), 0.0, m)  # no finite z: masses 0, not NaN
    return m, lane_sum * tl.exp2((lane_max - shift[:, None]) * (inv_temp * LOG2E))


@triton.jit
def lane_pointers(z_ptr, z_row_stride, rows, n_rows, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    """(BLOCK_B, BLOCK_V) pointers to each row's first tile; rows past the batch point at the last row,
    so whole tiles load unmasked. One row (GPU launches): from a scalar row pointer, so a thread's
    loads are one address plus immediate offsets."""
    lanes = tl.arange(0, BLOCK_V)[None, :]
    if BLOCK_B == 1:
        return (z_ptr + tl.minimum(tl.program_id(0), n_rows - 1).to(tl.int64) * z_row_stride) + lanes
    return z_ptr + tl.minimum(rows, n_rows - 1).to(tl.int64)[:, None] * z_row_stride + lanes


@triton.jit
def tile_spans(lo, hi, eos_index, HAS_EOS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Split the tiles of columns [lo, hi) into whole tiles before eos's [lo, eos_start), eos's tile
    [eos_start, eos_end) (empty when eos is in no whole tile), whole tiles after it [eos_end,
    whole_end) and the partial last tile [whole_end, hi): all but one or two load without a mask
    (a masked load cost ~9 integer instructions per element in sm_90 code)."""
    whole_end = lo + (hi - lo) // BLOCK_V * BLOCK_V
    eos_in = HAS_EOS & (eos_index >= lo) & (eos_index < whole_end)
    eos_start = tl.where(eos_in, lo + (tl.maximum(eos_index, lo) - lo) // BLOCK_V * BLOCK_V, whole_end)
    return eos_start, tl.minimum(eos_start + BLOCK_V, whole_end), whole_end


@triton.jit
def load_tile(lane_ptrs, start, hi, eos_index, MASKED: tl.constexpr, HAS_EOS: tl.constexpr,
              BLOCK_V: tl.constexpr):
    """The tile at ``start`` as fp32; MASKED: −inf from column ``hi`` on and at eos."""
    if MASKED:
        cols = start + tl.arange(0, BLOCK_V)[None, :]
        keep = cols < hi
        if HAS_EOS:
            keep = keep & (cols != eos_index)
        return tl.load(lane_ptrs + start, mask=keep, other=float("-inf")).to(tl.float32)
    return tl.load(lane_ptrs + start).to(tl.float32)


@triton.jit
def keep_runners_up(runners, z, up, previous, previous_start, start, DEPTH: tl.constexpr):
    """A lane's DEPTH (2 or 3) largest values after folding the tile at ``start`` (``z``; ``up``: it set
    a new lane max, pushing ``previous`` from tile ``previous_start`` down a rank): ``runners`` = (2nd,
    its tile start, 3rd, start, the largest value pushed out of the DEPTH; unused ranks stay −inf). A
    value enters below an equal one (rank order is column order on ties); the pushed-out value bounds
    every value of the lane not kept."""
    second, second_start, third, third_start, pushed_out = runners
    # What comes down to rank 2: the old max where z replaced it, else z itself.
    incoming = tl.where(up, previous, z)
    incoming_start = tl.where(up, previous_start, start)
    # "Enters at rank 2" implies it enters at rank 3: the ranks shift down consistently.
    at_2 = up | (incoming > second)
    if DEPTH == 2:
        pushed_out = tl.maximum(pushed_out, tl.where(at_2, second, incoming))
    else:
        at_3 = at_2 | (incoming > third)
        pushed_out = tl.maximum(pushed_out, tl.where(at_3, third, incoming))
        third = tl.where(at_2, second, tl.where(at_3, incoming, third))
        third_start = tl.where(at_2, second_start, tl.where(at_3, incoming_start, third_start))
    second = tl.where(at_2, incoming, second)
    second_start = tl.where(at_2, incoming_start, second_start)
    return second, second_start, third, third_start, pushed_out


@triton.jit
def fold_tile(lane_max, lane_sum, lane_start, runners, z, start, neg_scale, ARGMAX: tl.constexpr,
              DEPTH: tl.constexpr):
    """:func:`fold_lanes` of the tile at ``start``, plus per lane: ARGMAX, the tile start of its first
    maximum; DEPTH > 0 (needs ARGMAX), its runners-up (:func:`keep_runners_up`)."""
    previous, previous_start = lane_max, lane_start
    lane_max, lane_sum, up = fold_lanes(lane_max, lane_sum, z, neg_scale)
    if ARGMAX:
        lane_start = tl.where(up, start, lane_start)  # a uniform scalar: cheaper than the column
    if DEPTH > 0:
        runners = keep_runners_up(runners, z, up, previous, previous_start, start, DEPTH)
    return lane_max, lane_sum, lane_start, runners


@triton.jit
def _walk_tile(state, z, start, args, RANKED: tl.constexpr, ARGMAX: tl.constexpr, DEPTH: tl.constexpr,
               BLOCK_V: tl.constexpr):
    """One tile into the walk's state: RANKED, ``(acc,) + _ranked_e``; else :func:`fold_tile`."""
    if RANKED:
        state = (state[0] + _ranked_e(z, start, *args, BLOCK_V),)
    else:
        state = fold_tile(*state, z, start, *args, ARGMAX, DEPTH)
    return state


@triton.jit
def _walk_span(state, args, lane_ptrs, first, last, hi, eos_index, MASKED: tl.constexpr, RANKED: tl.constexpr,
               ARGMAX: tl.constexpr, DEPTH: tl.constexpr, PREFETCH: tl.constexpr, HAS_EOS: tl.constexpr,
               BLOCK_V: tl.constexpr):
    """The tiles starting in [first, last) into ``state`` (:func:`_walk_tile`); PREFETCH (unmasked
    spans): load the next tile before folding this one."""
    if PREFETCH and not MASKED:
        if first < last:
            z_next = load_tile(lane_ptrs, first, hi, eos_index, False, HAS_EOS, BLOCK_V)
            for start in range(first, last, BLOCK_V):
                z = z_next  # the next tile's load (the last tile again at the end: no read past the span)
                z_next = load_tile(lane_ptrs, tl.minimum(start + BLOCK_V, last - BLOCK_V), last, -1, False, HAS_EOS,
                                   BLOCK_V)
                state = _walk_tile(state, z, start, args, RANKED, ARGMAX, DEPTH, BLOCK_V)
    else:
        for start in range(first, last, BLOCK_V):
            z = load_tile(lane_ptrs, start, hi, eos_index, MASKED, HAS_EOS, BLOCK_V)
            state = _walk_tile(state, z, start, args, RANKED, ARGMAX, DEPTH, BLOCK_V)
    return state


@triton.jit
def _walk_row(state, args, lane_ptrs, lo, hi, eos_index, RANKED: tl.constexpr, ARGMAX: tl.constexpr,
              DEPTH: tl.constexpr, PREFETCH: tl.constexpr, HAS_EOS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Columns [lo, hi) of each row into ``state``, span by span (:func:`tile_spans`): whole tiles
    unmasked, eos's tile and the partial last one masked."""
    eos_start, eos_end, whole_end = tile_spans(lo, hi, eos_index, HAS_EOS, BLOCK_V)
    state = _walk_span(state, args, lane_ptrs, lo, eos_start, hi, eos_index, False, RANKED, ARGMAX, DEPTH, PREFETCH,
                       HAS_EOS, BLOCK_V)
    state = _walk_span(state, args, lane_ptrs, eos_start, eos_end, hi, eos_index, True, RANKED, ARGMAX, DEPTH,
                       PREFETCH, HAS_EOS, BLOCK_V)
    state = _walk_span(state, args, lane_ptrs, eos_end, whole_end, hi, eos_index, False, RANKED, ARGMAX, DEPTH,
                       PREFETCH, HAS_EOS, BLOCK_V)
    return _walk_span(state, args, lane_ptrs, whole_end, hi, hi, eos_index, True, RANKED, ARGMAX, DEPTH, PREFETCH,
                      HAS_EOS, BLOCK_V)


@triton.jit
def fold_row_lanes(lane_ptrs, lo, hi, eos_index, neg_scale, ARGMAX: tl.constexpr, DEPTH: tl.constexpr,
                   PREFETCH: tl.constexpr, HAS_EOS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    """Per-lane (max z, Σ e^(x − max x), tile start of the first max (ARGMAX), runners-up (DEPTH > 0))
    over columns [lo, hi) of each row (``lane_pointers``)."""
    none = tl.full((BLOCK_B, BLOCK_V), float("-inf"), tl.float32)
    start = tl.zeros((BLOCK_B, BLOCK_V), tl.int32)
    # (max, sum, its tile start, runners-up: empty ranks 2 and 3 with their starts, pushed-out value)
    state = (none, tl.zeros((BLOCK_B, BLOCK_V), tl.float32), start, (none, start, none, start, none))
    return _walk_row(state, (neg_scale,), lane_ptrs, lo, hi, eos_index, False, ARGMAX, DEPTH, PREFETCH, HAS_EOS,
                     BLOCK_V)


@triton.jit
def _ranked_e(z, start, inv_temp, m_row, pivot_value, pivot_col_less_lane, BLOCK_V: tl.constexpr):
    """e^(x − M) of a tile's tokens ranked before the pivot (else 0), x = z · inv_temp, the tile at
    ``start`` (column test: pivot column − lane > start). (x − M)·log2 e, not x·log2 e − M·log2 e: the
    products overflow above 2.4e38."""
    x = z * inv_temp
    ranked = (x > pivot_value) | ((x == pivot_value) & (pivot_col_less_lane > start))
    return tl.where(ranked, tl.exp2((x - m_row) * LOG2E), 0.0)


@triton.jit
def ranked_lane_mass(lane_ptrs, lo, hi, eos_index, inv_temp, m, pivot_value, pivot_col, PREFETCH: tl.constexpr,
                     HAS_EOS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    """Per lane (fp32, summed in column order): the mass e^(x − M) of the non-eos columns in [lo, hi)
    ranked before the pivot (a larger x, or the same x at a lower column): top-p's acceptance pass.
    The sums are monotone along the ranking, so the accepted tokens are a prefix of it."""
    # The column rule as one loop-invariant tile (a per-row pivot_col − start formed in the loop went
    # through shared memory on every tile).
    args = (inv_temp, m[:, None], pivot_value[:, None], pivot_col[:, None] - tl.arange(0, BLOCK_V)[None, :])
    return _walk_row((tl.zeros((BLOCK_B, BLOCK_V), tl.float32),), args, lane_ptrs, lo, hi, eos_index, True, False, 0,
                     PREFETCH, HAS_EOS, BLOCK_V)[0]
