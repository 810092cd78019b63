"""Exact top-p (nucleus) sampling from logits: no sort, no candidate list, any nucleus size.

The nucleus is every token ranked above a cut value θ* plus some tokens tied at θ* (lowest
index first). Only θ* and the mass above it are needed, so instead of ranking candidates
(``row_scan``'s tl.topk per tile) two kernels narrow θ* down by value:

``_nucleus_cut_kernel`` (one program per row on a GPU; the row stays in L2 between passes):
  1. one pass: max M, Σ e^(x−M) and the smallest finite x over the non-eos columns
     (x = z / temperature); then the head's float64 scalars as ``row_select`` computes them:
     log_norm, eos's ζ_eos and mass p_eos, and w = e^(M − log_norm), so token v has mass w·e_v
     with e_v = e^(x_v − M).
  2. bracket passes: the value interval [lo, hi) holding θ* is split into NT parts at
     thresholds θ_j spread over its members' range; one pass gives, per threshold, the count,
     mass and smallest value of the members ≥ θ_j and the largest one < θ_j (per-thread
     accumulators, reduced once per pass). The part where the mass from the top reaches p
     becomes the bracket (narrowed to its members' range), until it holds at most C tokens or a
     single value. Value thresholds never split ties, and eos (a float64 ζ_eos) is placed by
     exact comparisons with the same fp32 thresholds, so the partition is exact.
  3. one pass: the mass above the bracket per tile (for the draw) and the bracket's tokens,
     compacted in column order (≤ C); then they are sorted by (value desc, column asc), eos is
     merged by its exact ζ_eos, and the keep rule of ``truncation.truncate`` (keep a token while
     the mass before it is below p; the first token always) runs in float64. A bracket of more
     than C tokens tied at one value keeps the first j of them, j from the same rule.
``_nucleus_draw_kernel`` then draws per row by inverse CDF over the kept mass in a fixed order
(eos, tokens above the bracket in column order, the bracket's kept tokens): the tile is found
from the per-tile masses, the token by a cumulative sum inside that one tile. The order is
fixed by the data, not by scheduling, so a seed reproduces a draw. A batch of one row repeated
(stride 0, the same step and state) is cut once and drawn per row.

Masses use fp32 exponentials (as the scan's L does), so a cut within ~1e-7 of p may fall one
token differently from the float64 torch path; logits whose masses are exact in fp32 (ties,
binary fractions) cut exactly. A row whose bracket still holds more than C distinct values after
``MAX_PASSES`` passes, or whose C-plus tie includes eos, is flagged: the caller takes the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_power_of_2, scan_width
from .row_scan import column_keys, decode_column_keys, first_crossing
from .row_select import HEAD_CODES, Selection, _eos_terms, _Outputs, _split_f64, _uniform_f64

BRACKET_SPLITS = 8  # NT: parts per bracket pass (compute per pass ∝ NT, passes ∝ 1/log NT)
BRACKET_CAPACITY = 64  # C: tokens the final bracket may hold (sorted in registers)
MAX_PASSES = 8
_NO_KEY = -(2**63)


def tile_table_width(V: int, block_v: int) -> int:
    """Columns of a row's per-tile table: the tile count, padded as a scanned table (``scan_width``)."""
    return scan_width(cdiv(V, block_v))


@triton.jit
def _online_logsumexp(running_max, running_sum, x):
    """Fold a (rows, tile) block ``x`` into the running per-row (max, Σ e^(x − max))."""
    new_max = tl.maximum(running_max, tl.max(x, axis=1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # all-masked so far: avoid -inf - -inf
    return new_max, running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)


@triton.jit
def _load_x(base, cols, rows_on, V, eos_index, inv_temp, HAS_EOS: tl.constexpr):
    """x = z · inv_temp at ``cols`` ((1 or rows, tile) columns, or (rows, candidates, tile)) of the rows
    ``rows_on`` (the shape of ``cols`` less its last axis; fp32; −inf outside the row and for eos)."""
    keep = tl.expand_dims(rows_on, -1) & (cols < V)
    if HAS_EOS:
        keep = keep & (cols != eos_index)
    x = tl.load(base + cols, mask=keep, other=float("-inf")).to(tl.float32) * inv_temp
    return tl.where(keep, x, float("-inf"))


@triton.jit
def _row_head(
    m, s, z_ptr, z_row_stride, rows, row_ok, eos_index, log1m_eps_hi, log1m_eps_lo, steps_ptr, steps_stride,
    steps_value, state_ptr, state_stride, new_state_ptr, HEAD: tl.constexpr, STEPS_PER_ROW: tl.constexpr,
    HAS_STATE: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """The head's float64 scalars per row from the non-eos (max M, Σ e^(x−M)), as ``row_select``
    computes them: (log_norm, eos's ζ_eos, eos's mass p_eos, w = e^(M − log_norm), bad), so token v
    has mass w·e^(x_v − M); bad rows (NaN, +inf, no finite non-eos logit) get w = p_eos = 0."""
    lse = m.to(tl.float64) + tl.log(tl.where(row_ok, s, 1.0).to(tl.float64))
    bad = ~(tl.abs(lse) < float("inf"))
    if HEAD != 0:
        log_norm, eos_zeta, eos_nan = _eos_terms(
            lse, z_ptr, z_row_stride, rows, row_ok, eos_index, log1m_eps_hi, log1m_eps_lo, steps_ptr, steps_stride,
            steps_value, state_ptr, state_stride, new_state_ptr, HEAD, STEPS_PER_ROW, HAS_STATE, BLOCK_B)
        bad = bad | eos_nan
        p_eos = tl.where(bad, 0.0, tl.exp(eos_zeta - log_norm))
    else:
        log_norm = lse
        eos_zeta = tl.full((BLOCK_B,), float("-inf"), tl.float64)
        p_eos = tl.zeros((BLOCK_B,), tl.float64)
    w = tl.where(row_ok & ~bad, tl.exp(m.to(tl.float64) - log_norm), 0.0)
    return log_norm, eos_zeta, p_eos, w, bad


@triton.jit
def _nucleus_cut_kernel(
    z_ptr, z_row_stride, n_rows, V, eos_index, inv_temp,
    log1m_eps_hi, log1m_eps_lo, steps_ptr, steps_stride, steps_value, state_ptr, state_stride,
    top_p_hi, top_p_lo,
    gathered_ptr,  # (rows, C) int64 scratch: the bracket's keys in column order
    tile_mass_ptr,  # (rows, n_tiles) fp32: Σ e over each tile's tokens above the bracket
    tile_ties_ptr,  # (rows, n_tiles) int32: bracket tokens per tile (a C-plus tie is drawn from them)
    row_max_ptr, lo_ptr, hi_ptr,  # (rows,) fp32: M and the final bracket [lo, hi)
    w_ptr, log_norm_ptr, eos_zeta_ptr, eos_mass_ptr, above_ptr,  # (rows,) fp64
    tie_kept_ptr,  # (rows,) int32: kept tokens of a C-plus tie (0: the kept list applies)
    kept_col_ptr, kept_mass_ptr,  # (rows, C): kept bracket tokens in rank order and their masses
    passes_ptr,  # (rows,) int32: bracket passes this row's program ran (for tuning and tests)
    new_state_ptr, flags_ptr, no_row,  # flags: first bad / unresolved row; no_row (the batch size): none
    max_passes,  # runtime, not constexpr: Triton 3.6 failed to compile the loop a bound of 0 folds away
    HEAD: tl.constexpr, STEPS_PER_ROW: tl.constexpr, HAS_STATE: tl.constexpr,
    NT: tl.constexpr, C: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, PASS_BLOCK_V: tl.constexpr,
):
    HAS_EOS: tl.constexpr = HEAD != 0
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < n_rows
    base = z_ptr + rows.to(tl.int64)[:, None] * z_row_stride

    # 1. Max, Σ e^(x − M), the smallest finite x and the finite count, online over tiles.
    m = tl.full((BLOCK_B,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_B,), tl.float32)
    x_min = tl.full((BLOCK_B,), float("inf"), tl.float32)
    n_valid = tl.zeros((BLOCK_B,), tl.int32)
    for start in range(0, V, BLOCK_V):
        x = _load_x(base, start + tl.arange(0, BLOCK_V)[None, :], row_ok, V, eos_index, inv_temp, HAS_EOS)
        m, s = _online_logsumexp(m, s, x)
        valid = x > float("-inf")  # NaN is not: its row is flagged through s
        x_min = tl.minimum(x_min, tl.min(tl.where(valid, x, float("inf")), axis=1))
        n_valid += tl.sum(valid.to(tl.int32), axis=1)
    log_norm, eos_zeta, p_eos, w, bad = _row_head(
        m, s, z_ptr, z_row_stride, rows, row_ok, eos_index, log1m_eps_hi, log1m_eps_lo, steps_ptr, steps_stride,
        steps_value, state_ptr, state_stride, new_state_ptr, HEAD, STEPS_PER_ROW, HAS_STATE, BLOCK_B)
    live = row_ok & ~bad
    threshold = tl.cast(top_p_hi, tl.float64) + tl.cast(top_p_lo, tl.float64)

    # 2. Bracket passes. Invariant: every token above [lo, hi) is kept, none below it; `above`
    # is their mass (eos's included when eos_above).
    lo = tl.full((BLOCK_B,), float("-inf"), tl.float32)
    hi = tl.full((BLOCK_B,), float("inf"), tl.float32)
    eos_in = live & (p_eos > 0.0)
    eos_above = tl.zeros((BLOCK_B,), tl.int1)
    above = tl.zeros((BLOCK_B,), tl.float64)
    count = tl.where(live, n_valid, 0) + eos_in.to(tl.int32)
    lowest = tl.where(eos_in, tl.minimum(x_min.to(tl.float64), eos_zeta), x_min.to(tl.float64))
    highest = tl.where(eos_in, tl.maximum(m.to(tl.float64), eos_zeta), m.to(tl.float64))
    active = live & (count > C) & (lowest < highest)
    sub = tl.arange(0, NT)
    passes = 0
    while (tl.max(active.to(tl.int32), axis=0) > 0) & (passes < max_passes):
        # Thresholds over the members' range (fp32, non-decreasing); sub-interval 0 starts at lo.
        # Clamped to fp32's range: only eos (a certain one has ζ_eos ~ 1e300) lies beyond it.
        span_lo = tl.maximum(lowest, -3.4028234663852886e38)
        span_hi = tl.minimum(highest, 3.4028234663852886e38)
        theta = (span_lo[:, None] + (span_hi - span_lo)[:, None] * (sub[None, :].to(tl.float64) / NT)).to(tl.float32)
        theta = tl.where(sub[None, :] == 0, float("-inf"), theta)
        # Per-thread statistics of each threshold, summed over the tiles and reduced once per
        # pass (a cross-warp reduction per tile would cost more than the elementwise work):
        # count, mass and min of the members x >= θ_j, and the max of those x < θ_j.
        ge_cnt = tl.zeros((BLOCK_B, PASS_BLOCK_V, NT), tl.int32)
        ge_mass = tl.zeros((BLOCK_B, PASS_BLOCK_V, NT), tl.float32)
        ge_min = tl.full((BLOCK_B, PASS_BLOCK_V, NT), float("inf"), tl.float32)
        lt_max = tl.full((BLOCK_B, PASS_BLOCK_V, NT), float("-inf"), tl.float32)
        top = tl.full((BLOCK_B, PASS_BLOCK_V), float("-inf"), tl.float32)
        for start in range(0, V, PASS_BLOCK_V):
            x = _load_x(base, start + tl.arange(0, PASS_BLOCK_V)[None, :], active, V, eos_index, inv_temp, HAS_EOS)
            member = (x > float("-inf")) & (x >= lo[:, None]) & (x < hi[:, None])
            above_theta = x[:, :, None] >= theta[:, None, :]
            ge = above_theta & member[:, :, None]
            x3 = x[:, :, None] + tl.zeros((1, 1, NT), tl.float32)
            ge_cnt += ge.to(tl.int32)
            ge_mass += tl.where(ge, tl.exp(x - m[:, None])[:, :, None], 0.0)
            ge_min = tl.minimum(ge_min, tl.where(ge, x3, float("inf")))
            lt_max = tl.maximum(lt_max, tl.where(~above_theta & member[:, :, None], x3, float("-inf")))
            top = tl.maximum(top, tl.where(member, x, float("-inf")))
        # Part j = [θ_j, θ_j+1) ∩ [lo, hi); eos joins the counts and masses by its exact ζ_eos.
        eos_ge = eos_in[:, None] & (eos_zeta[:, None] >= theta.to(tl.float64))
        n_ge = tl.sum(ge_cnt, axis=1)
        from_top = above[:, None] + w[:, None] * tl.sum(ge_mass, axis=1).to(tl.float64) + \
            tl.where(eos_ge, p_eos[:, None], 0.0)  # F_j: the mass of every token ranked from θ_j up
        tokens_ge = n_ge + eos_ge.to(tl.int32)
        nxt = sub[None, :] + 1
        tokens_next = tl.sum(tl.where(sub[None, None, :] == nxt[:, :, None], tokens_ge[:, None, :], 0), axis=2)
        n_next = tl.sum(tl.where(sub[None, None, :] == nxt[:, :, None], n_ge[:, None, :], 0), axis=2)
        # The cut lies in the last non-empty part whose F reaches p.
        pick = tl.max(tl.where((from_top >= threshold) & (tokens_ge > tokens_next), sub[None, :], -1), axis=1)
        found = pick >= 0
        at = sub[None, :] == pick[:, None]
        at_next = sub[None, :] == (pick + 1)[:, None]
        has_next = found & (pick < NT - 1)
        next_theta = tl.sum(tl.where(at_next, theta, 0.0), axis=1)
        elements = tl.sum(tl.where(at, n_ge - n_next, 0), axis=1)  # the part's non-eos tokens
        new_low = tl.where(elements > 0, tl.min(tl.where(at, tl.min(ge_min, axis=1), float("inf")), axis=1),
                           float("inf")).to(tl.float64)
        below_next = tl.max(tl.where(at_next, tl.max(lt_max, axis=1), float("-inf")), axis=1)
        new_high = tl.where(elements > 0, tl.where(has_next, below_next, tl.max(top, axis=1)),
                            float("-inf")).to(tl.float64)
        eos_at = tl.sum(tl.where(at, eos_ge.to(tl.int32), 0), axis=1) > 0
        eos_next = tl.sum(tl.where(at_next, eos_ge.to(tl.int32), 0), axis=1) > 0
        stays = eos_at & ~(has_next & eos_next)
        # Not found: the whole bracket is short of p (rounding when p is ~1): keep all of it.
        go_up = eos_in & tl.where(found, has_next & eos_next, True)
        total = tl.sum(tl.where(sub[None, :] == 0, from_top, 0.0), axis=1)
        new_above = tl.where(found, tl.where(has_next, tl.sum(tl.where(at_next, from_top, 0.0), axis=1), above), total)
        new_lo = tl.where(found & (pick > 0), tl.sum(tl.where(at, theta, 0.0), axis=1), lo)
        new_hi = tl.where(found, tl.where(has_next, next_theta, hi), lo)
        new_count = tl.where(found, tl.sum(tl.where(at, tokens_ge, 0), axis=1) -
                             tl.where(has_next, tl.sum(tl.where(at_next, tokens_ge, 0), axis=1), 0), 0)
        lowest = tl.where(active, tl.where(stays, tl.minimum(new_low, eos_zeta), new_low), lowest)
        highest = tl.where(active, tl.where(stays, tl.maximum(new_high, eos_zeta), new_high), highest)
        lo = tl.where(active, new_lo, lo)
        hi = tl.where(active, new_hi, hi)
        above = tl.where(active, new_above, above)
        eos_above = eos_above | (active & go_up)
        eos_in = tl.where(active, found & stays, eos_in)
        count = tl.where(active, new_count, count)
        active = active & (count > C) & (lowest < highest)
        passes += 1
    uncovered = live & (count > C) & ((lowest < highest) | eos_in)
    ties = live & (count > C) & ~uncovered

    # 3. Per tile: the mass above the bracket and the bracket's tokens (the first C compacted).
    n_tiles = tl.cdiv(V, BLOCK_V)
    tile_row = rows.to(tl.int64) * n_tiles
    above_e = tl.zeros((BLOCK_B,), tl.float64)
    n_up = tl.zeros((BLOCK_B,), tl.int32)
    filled = tl.zeros((BLOCK_B,), tl.int32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)[None, :]
        x = _load_x(base, cols, live, V, eos_index, inv_temp, HAS_EOS)
        valid = x > float("-inf")
        up = valid & (x >= hi[:, None])
        member = valid & (x >= lo[:, None]) & (x < hi[:, None])
        tile_e = tl.sum(tl.where(up, tl.exp(x - m[:, None]), 0.0), axis=1)
        tl.store(tile_mass_ptr + tile_row + start // BLOCK_V, tile_e, mask=row_ok)
        tl.store(tile_ties_ptr + tile_row + start // BLOCK_V, tl.sum(member.to(tl.int32), axis=1), mask=row_ok)
        above_e += tile_e.to(tl.float64)
        n_up += tl.sum(up.to(tl.int32), axis=1)
        slot = filled[:, None] + tl.cumsum(member.to(tl.int32), axis=1) - 1
        tl.store(gathered_ptr + rows.to(tl.int64)[:, None] * C + slot, column_keys(x, cols),
                 mask=member & (slot < C))
        filled += tl.sum(member.to(tl.int32), axis=1)
    tl.debug_barrier()  # the gathered keys are read back by other threads of this program

    # The bracket's tokens in rank order, eos merged by its exact ζ_eos, and the keep rule.
    eos_mass = tl.where(eos_above, p_eos, 0.0)
    before_bracket = eos_mass + w * above_e
    first_is_top = (n_up + eos_above.to(tl.int32)) == 0  # nothing above: the bracket's first token is rank 0
    rank = tl.arange(0, C)
    keys = tl.load(gathered_ptr + rows.to(tl.int64)[:, None] * C + rank[None, :],
                   mask=(live & ~ties)[:, None] & (rank[None, :] < filled[:, None]), other=-9223372036854775808)
    values, cols = decode_column_keys(tl.sort(keys, dim=1, descending=True))
    real = cols >= 0
    q = tl.where(real, w[:, None] * tl.exp(values - m.to(tl.float64)[:, None]), 0.0)
    outranks_eos = real & ((values > eos_zeta[:, None]) | ((values == eos_zeta[:, None]) & (cols < eos_index)))
    eos_pos = tl.sum(outranks_eos.to(tl.int32), axis=1)
    eos_behind = eos_in[:, None] & (rank[None, :] >= eos_pos[:, None])
    mass_before = before_bracket[:, None] + tl.cumsum(q, axis=1) - q + tl.where(eos_behind, p_eos[:, None], 0.0)
    first = first_is_top[:, None] & (rank[None, :] == 0) & ~(eos_in & (eos_pos == 0))[:, None]
    # Kept: the ranks before the first one whose mass_before reaches p (a prefix even where the
    # scan's rounding is not monotone).
    cut_rank = tl.min(tl.where(real & (mass_before >= threshold) & ~first, rank[None, :], C), axis=1)
    kept = real & (rank[None, :] < cut_rank[:, None])
    eos_before = before_bracket + tl.sum(tl.where(rank[None, :] < eos_pos[:, None], q, 0.0), axis=1)
    eos_kept = eos_in & ((eos_before < threshold) | (first_is_top & (eos_pos == 0)))
    eos_mass += tl.where(eos_kept, p_eos, 0.0)
    # A tie of more than C tokens at one value: keep the first j with mass_before < p.
    q_tie = w * tl.exp(lowest - m.to(tl.float64))
    share = tl.minimum(tl.maximum((threshold - before_bracket) / tl.where(ties, q_tie, 1.0), 0.0),
                       count.to(tl.float64))
    whole = share.to(tl.int32)
    tie_kept = whole + (whole.to(tl.float64) < share).to(tl.int32)
    tie_kept = tl.where(ties, tl.minimum(tl.maximum(tie_kept, first_is_top.to(tl.int32)), count), 0)

    out = rows.to(tl.int64)[:, None] * C + rank[None, :]
    tl.store(kept_col_ptr + out, tl.where(kept, cols, 0), mask=row_ok[:, None])
    tl.store(kept_mass_ptr + out, tl.where(kept, q, 0.0), mask=row_ok[:, None])
    tl.store(row_max_ptr + rows, m, mask=row_ok)
    # A C-plus tie's bracket holds one value: store it as lo (no token lies between), the draw's q_tie.
    tl.store(lo_ptr + rows, tl.where(ties, lowest.to(tl.float32), lo), mask=row_ok)
    tl.store(hi_ptr + rows, hi, mask=row_ok)
    tl.store(w_ptr + rows, w, mask=row_ok)
    tl.store(log_norm_ptr + rows, log_norm, mask=row_ok)
    tl.store(eos_zeta_ptr + rows, eos_zeta, mask=row_ok)
    tl.store(eos_mass_ptr + rows, eos_mass, mask=row_ok)
    tl.store(above_ptr + rows, above_e, mask=row_ok)
    tl.store(tie_kept_ptr + rows, tie_kept, mask=row_ok)
    tl.store(passes_ptr + rows, tl.full((BLOCK_B,), 0, tl.int32) + passes, mask=row_ok)
    tl.atomic_min(flags_ptr, tl.min(tl.where(bad & row_ok, rows, no_row), axis=0))
    tl.atomic_min(flags_ptr + 1, tl.min(tl.where(uncovered, rows, no_row), axis=0))


@triton.jit
def _nucleus_draw_kernel(
    z_ptr, z_row_stride, n_rows, V, eos_index, inv_temp, cut_stride,
    tile_mass_ptr, tile_ties_ptr, row_max_ptr, lo_ptr, hi_ptr, w_ptr, log_norm_ptr, eos_zeta_ptr,
    eos_mass_ptr, above_ptr, tie_kept_ptr, kept_col_ptr, kept_mass_ptr,
    seed_ptr, token_ptr, log_prob_ptr,
    HAS_EOS: tl.constexpr, C: tl.constexpr, NTILES: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One inverse-CDF draw per row over the cut's kept mass: eos, then the tokens above the
    bracket in column order, then the bracket's kept tokens (or the kept part of a C-plus tie)."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < n_rows
    cut = rows.to(tl.int64) * cut_stride  # 0: one cut serves every row
    m = tl.load(row_max_ptr + cut, mask=row_ok, other=0.0)
    lo = tl.load(lo_ptr + cut, mask=row_ok, other=0.0)
    hi = tl.load(hi_ptr + cut, mask=row_ok, other=0.0)
    w = tl.load(w_ptr + cut, mask=row_ok, other=0.0)
    eos_mass = tl.load(eos_mass_ptr + cut, mask=row_ok, other=0.0)
    above = w * tl.load(above_ptr + cut, mask=row_ok, other=0.0)
    tie_kept = tl.load(tie_kept_ptr + cut, mask=row_ok, other=0)
    rank = tl.arange(0, C)
    kept_mass = tl.load(kept_mass_ptr + cut[:, None] * C + rank[None, :], mask=row_ok[:, None], other=0.0)
    q_tie = w * tl.exp(lo.to(tl.float64) - m.to(tl.float64))  # a C-plus tie is one value: lo
    tail = tl.where(tie_kept > 0, tie_kept.to(tl.float64) * q_tie, tl.sum(kept_mass, axis=1))

    goal = _uniform_f64(tl.load(seed_ptr), rows) * (eos_mass + above + tail)
    in_eos = (goal < eos_mass) | ((above <= 0.0) & (tail <= 0.0))
    past_eos = goal - eos_mass
    in_above = ~in_eos & ((past_eos < above) | (tail <= 0.0))
    into_tail = past_eos - above

    # Tokens above the bracket: the tile from the per-tile masses, then the column inside it.
    n_tiles = tl.cdiv(V, BLOCK_V)
    tiles = tl.arange(0, NTILES)
    tile_at = cut[:, None] * n_tiles + tiles[None, :]
    on_tile = row_ok[:, None] & (tiles[None, :] < n_tiles)
    tile_mass = tl.load(tile_mass_ptr + tile_at, mask=on_tile, other=0.0).to(tl.float64)
    goal_e = past_eos / tl.where(w > 0.0, w, 1.0)  # in units of e, as the tile masses
    tile_a, skipped_e = first_crossing(tile_mass, goal_e, tiles[None, :], NTILES)
    # A C-plus tie: the r-th tied token (column order) from the per-tile counts.
    r = tl.minimum(tl.maximum(into_tail / tl.where(q_tie > 0.0, q_tie, 1.0), 0.0), tie_kept.to(tl.float64) - 1.0)
    r = tl.maximum(r, 0.0).to(tl.int32)
    tile_ties = tl.load(tile_ties_ptr + tile_at, mask=on_tile, other=0)
    tile_t, skipped_t = first_crossing(tile_ties, r, tiles[None, :], NTILES)
    in_ties = ~in_eos & ~in_above & (tie_kept > 0)

    tile = tl.where(in_above, tile_a, tile_t)
    cols = tile[:, None] * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
    base = z_ptr + rows.to(tl.int64)[:, None] * z_row_stride
    x = _load_x(base, cols, row_ok & (in_above | in_ties), V, eos_index, inv_temp, HAS_EOS)
    valid = x > float("-inf")
    # fp32 inside the tile (fp64 spills at 2048 columns per row): ~1e-7 of the tile's mass.
    e_up = tl.where(valid & (x >= hi[:, None]), tl.exp(x - m[:, None]), 0.0)
    col_a, _ = first_crossing(e_up, (goal_e - skipped_e).to(tl.float32), cols, V)
    member = (valid & (x >= lo[:, None]) & (x < hi[:, None])).to(tl.int32)
    col_t, _ = first_crossing(member, r - skipped_t, cols, V)
    pick, _ = first_crossing(kept_mass, into_tail, rank[None, :], C)
    col_l = tl.sum(tl.where(rank[None, :] == pick[:, None],
                            tl.load(kept_col_ptr + cut[:, None] * C + rank[None, :], mask=row_ok[:, None], other=0),
                            0), axis=1)
    token = tl.where(in_eos, eos_index, tl.where(in_above, col_a, tl.where(in_ties, col_t, col_l))).to(tl.int64)

    chosen = tl.load(z_ptr + rows.to(tl.int64) * z_row_stride + token, mask=row_ok & ~in_eos, other=0.0)
    zeta = tl.where(in_eos, tl.load(eos_zeta_ptr + cut, mask=row_ok, other=0.0),
                    (chosen.to(tl.float32) * inv_temp).to(tl.float64))
    tl.store(token_ptr + rows, token, mask=row_ok)
    tl.store(log_prob_ptr + rows, zeta - tl.load(log_norm_ptr + cut, mask=row_ok, other=0.0), mask=row_ok)


def cuda_launch(V: int) -> dict:
    """Block sizes on a GPU: one row per program (its passes then re-read it from L2)."""
    width = next_power_of_2(V)
    return dict(BLOCK_B=1, BLOCK_V=min(2048, width), PASS_BLOCK_V=min(256, width), num_warps=8)


def _interpreter_launch(rows: int, V: int) -> dict:
    """The CPU interpreter pays per operation, not per element: many rows per program."""
    block_v = min(2048, next_power_of_2(V))
    pass_v = min(1024, block_v)
    widest = max(block_v, BRACKET_CAPACITY, pass_v * BRACKET_SPLITS // 4)  # Triton allows 2^20 elements per tensor
    return dict(BLOCK_B=min(next_power_of_2(rows), max(1, (1 << 18) // widest)), BLOCK_V=block_v,
                PASS_BLOCK_V=pass_v)


def draw_launch(B: int, V: int, block_v: int, cuda: bool) -> dict:
    """Rows per draw program (each loads one tile, the per-tile table and C kept tokens) and the
    per-tile table's padded width."""
    n_tiles = tile_table_width(V, block_v)
    widest = max(block_v, BRACKET_CAPACITY, n_tiles)
    if cuda:  # one row of 2048 float64 cumulative sums per 8 warps: no spills (ptxas -v, sm_90)
        return dict(BLOCK_B=max(1, min(next_power_of_2(B), 2048 // widest)), NTILES=n_tiles, num_warps=8)
    return dict(BLOCK_B=max(1, min(next_power_of_2(B), (1 << 18) // widest)), NTILES=n_tiles)


def shares_one_cut(z: torch.Tensor, steps: int | torch.Tensor, state: Optional[torch.Tensor]) -> bool:
    """Every row is the same logits row at the same step and state: one cut serves them all."""
    B = z.shape[0]
    same_steps = not isinstance(steps, torch.Tensor) or steps.stride(0) == 0
    return B > 1 and z.stride(0) == 0 and same_steps and (state is None or state.stride(0) == 0)


@dataclass
class NucleusCut:
    """The cut kernel's per-row record (rows: 1 when one cut serves a repeated row)."""

    parts: dict[str, torch.Tensor]
    shared: bool
    block_v: int  # the tile width of the per-tile masses
    out: _Outputs  # the batch's outputs (tokens, log-probs, flags)
    state: Optional[torch.Tensor]  # ST's new state, (B,)


def nucleus_cut(
    z: torch.Tensor,
    *,
    head: str,
    eos_index: int,
    eps: float,
    temperature: float,
    steps: int | torch.Tensor,
    state: Optional[torch.Tensor],
    top_p_threshold: float,
) -> NucleusCut:
    """Run the cut kernel (arguments as :func:`nucleus_select`)."""
    B, V = z.shape
    if z.stride(1) != 1:
        raise ValueError("z must have unit stride along V")
    shared = shares_one_cut(z, steps, state)
    cut_rows = 1 if shared else B
    cut_z = z[:cut_rows]
    out = _Outputs(z, head, eps, steps, state)
    # A shared cut runs the head math on row 0 alone: its own (one-row) head arguments and state.
    cut_out = out
    if shared:
        cut_out = _Outputs(cut_z, head, eps, steps[:1] if isinstance(steps, torch.Tensor) else steps,
                           None if state is None else state[:1])
    launch = cuda_launch(V) if z.is_cuda else _interpreter_launch(max(cut_rows, 1), V)
    n_tiles = cdiv(V, launch["BLOCK_V"])
    C = BRACKET_CAPACITY
    f32, f64, i32, i64 = (dict(device=z.device, dtype=d) for d in (torch.float32, torch.float64, torch.int32,
                                                                    torch.int64))
    parts = {
        "gathered": torch.empty((cut_rows, C), **i64),
        "tile_mass": torch.empty((cut_rows, n_tiles), **f32), "tile_ties": torch.empty((cut_rows, n_tiles), **i32),
        "row_max": torch.empty(cut_rows, **f32), "lo": torch.empty(cut_rows, **f32), "hi": torch.empty(cut_rows, **f32),
        "w": torch.empty(cut_rows, **f64), "log_norm": torch.empty(cut_rows, **f64),
        "eos_zeta": torch.empty(cut_rows, **f64), "eos_mass": torch.empty(cut_rows, **f64),
        "above": torch.empty(cut_rows, **f64), "tie_kept": torch.empty(cut_rows, **i32),
        "kept_col": torch.empty((cut_rows, C), **i64), "kept_mass": torch.empty((cut_rows, C), **f64),
        "passes": torch.empty(cut_rows, **i32),
    }
    if cut_rows:
        _nucleus_cut_kernel[(cdiv(cut_rows, launch["BLOCK_B"]),)](
            cut_z, cut_z.stride(0), cut_rows, V, eos_index, 1.0 / temperature, *cut_out.head_args,
            *_split_f64(top_p_threshold), *parts.values(), cut_out.state, out.flags, B, MAX_PASSES,
            HEAD=HEAD_CODES[head], STEPS_PER_ROW=cut_out.steps_per_row, HAS_STATE=cut_out.has_state,
            NT=BRACKET_SPLITS, C=C, **launch,
        )
    new_state = None
    if head == "st":
        new_state = cut_out.state.expand(B).clone() if shared else cut_out.state
    return NucleusCut(parts, shared, launch["BLOCK_V"], out, new_state)


def kept_probabilities(cut: NucleusCut, z: torch.Tensor, *, eos_index: int, temperature: float,
                       head: str) -> torch.Tensor:
    """The (rows, V) float64 table of kept mass the draw samples from (unnormalized), rebuilt
    from a cut with torch: what tests compare with the float64 truncation. O(rows · V)."""
    p = cut.parts
    rows = p["row_max"].shape[0]
    x = (z[:rows].float() * (1.0 / temperature)).double()
    e = torch.exp(x - p["row_max"].double()[:, None])
    cols = torch.arange(z.shape[1], device=z.device)
    ordinary = torch.ones_like(x, dtype=torch.bool) if head == "va" else (cols != eos_index)[None, :]
    x32 = x.float()
    above = ordinary & (x32 > float("-inf")) & (x32 >= p["hi"][:, None])
    member = ordinary & (x32 > float("-inf")) & (x32 >= p["lo"][:, None]) & (x32 < p["hi"][:, None])
    table = torch.where(above, p["w"][:, None] * e, 0.0)
    tie_rank = torch.cumsum(member.long(), dim=1) - 1
    ties = member & (tie_rank < p["tie_kept"][:, None].long())
    table = torch.where(ties, p["w"][:, None] * e, table)
    table = table.scatter_add(1, p["kept_col"], p["kept_mass"])
    if head != "va":
        table[:, eos_index] += p["eos_mass"]
    return table


def nucleus_select(
    z: torch.Tensor,
    *,
    head: str,
    eos_index: int,
    eps: float,
    temperature: float,
    steps: int | torch.Tensor,
    state: Optional[torch.Tensor],
    top_p_threshold: float,
    seed: torch.Tensor,
) -> Selection:
    """Draw one token per row from the top-p truncation of each row's step distribution.

    Args:
        z: (B, V) fp32/bf16/fp16 logits with unit stride along V (any row stride, 0 included).
        head: "va" | "nmst" | "st"; eos_index, eps: the head's; temperature divides non-eos logits.
        steps: t of this step: an int, or a (B,) int64 tensor (stride 0 allowed).
        state: "st" only: (B,) float64 running log(1 − α) before this step (None: 0).
        top_p_threshold: keep tokens while the mass ranked before them is below this (top_p minus
            the caller's rounding slack).
        seed: one-element int64 tensor for the draw.
    Returns:
        :class:`nmst_fast.kernels.row_select.Selection`; ``flags[1]`` < B names a row whose bracket did not
        converge (its draw is invalid: the caller takes another path).
    """
    B, V = z.shape
    cut = nucleus_cut(z, head=head, eos_index=eos_index, eps=eps, temperature=temperature, steps=steps,
                      state=state, top_p_threshold=top_p_threshold)
    out = cut.out
    if B:
        launch = draw_launch(B, V, cut.block_v, z.is_cuda)
        _nucleus_draw_kernel[(cdiv(B, launch["BLOCK_B"]),)](
            z, z.stride(0), B, V, eos_index, 1.0 / temperature, 0 if cut.shared else 1,
            *(cut.parts[name] for name in ("tile_mass", "tile_ties", "row_max", "lo", "hi", "w", "log_norm",
                                           "eos_zeta", "eos_mass", "above", "tie_kept", "kept_col", "kept_mass")),
            seed, out.tokens, out.log_probs,
            HAS_EOS=head != "va", C=BRACKET_CAPACITY, BLOCK_V=cut.block_v, **launch,
        )
    return Selection(out.tokens, out.log_probs, cut.state, out.flags)
