"""One program per row draws by inverse CDF: top-p by rejection in about one to two reads.

Top-p alone on a GPU takes this kernel. Its plain mode (``draw_rows`` without a threshold) is step 1
below, then one draw by inverse CDF from the whole distribution (eos by its float64 mass, a lane
from the per-lane masses, then a column of that lane); plain sampling itself takes the split-V
scan's one launch (``nmst_fast/kernels/scan_select.py``), which timed faster at every batch size on an
H100, so the plain mode is the rounds' first step and a benchmarked alternative. A lane is a
column position of the BLOCK_V-wide tile followed across the row's tiles (columns l, l + BLOCK_V,
…): the passes keep their sums per lane, so their loops reduce nothing across the tile (no
barrier; ``row_scan.fold_lanes``), and one reduction per pass merges the lanes.

Top-p (``draw_rows(top_p_threshold=...)``), by rejection, no cut, no sort:

Rank tokens by (probability desc, column asc); the nucleus is the prefix of that ranking that
stops at the first token whose ranked-before mass reaches p. So one token j is in the nucleus iff
the mass of the tokens ranked before it is below p, a test one pass over the row decides. Hence:

1. one pass: per lane of the row, the max and Σ e^(x − max) of the non-eos x = z / temperature;
   then M, Σ e^(x−M), the head's float64 scalars (``nucleus._row_head``) and the lane masses;
2. rounds: draw a candidate j by inverse CDF from the current set S (at first: every token; eos
   by its exact mass, the lane from the per-lane masses, the column by a cumulative sum along
   that one lane), then one pass sums the mass ranked before j, per lane. Below p: j is the draw.
   Otherwise every token from j down is outside the nucleus: S becomes the tokens ranked before j
   (whose per-lane masses that pass just produced) and the next round draws from it.

Most rounds need no pass: the lane maxima bound the ranked-before mass (``_bounds``: at least the
weights of the lane maxima ranked before j, at most S's masses of the lanes whose max reaches j,
less j's own weight), and a round is decided without reading the row when the bounds fall on one
side of p. On peaked rows (z ~ N(0, 3²), V = 50257) that settles ~97% of the rounds of p = 0.4 and
~85% of p = 0.9, so top-p costs about one read; a round the bounds reject leaves S as it was.

Conditioned on landing in the nucleus, a draw from S ⊇ nucleus is a draw from the renormalized
nucleus, so every accepted round gives an exact sample, whichever way S shrank or did not. That
also holds for ``round_candidates`` > 1: a round then draws that many independent candidates from
S and examines the first the bounds do not reject (the rest are dropped unexamined) — one
cumulative sum and one set of bound reductions for several bound-rejected draws. A round
accepts with probability mass(nucleus) / mass(S) ≥ p, and S shrinks with each pass-decided
rejection (≈ log₂(1/p) rounds on a flat row), where ``nmst_fast/kernels/nucleus.py``'s cut takes ~6 reads.
A row still drawing after ``MAX_ROUNDS`` is flagged (flags[1]); the caller then draws it from the
cut (exact as well: the fallback's uniform comes from another Philox stream, independent of the
rejected rounds).

The acceptance test sums fp32 exponentials along each lane in column order, then float64 across
lanes and with eos, and keeps by the cut's float64 rule ("mass before < p; the first token
always"); the fixed summation order makes it monotone along the ranking (rounding is monotone):
the accepted tokens are exactly a prefix, so the rejection is exact for the nucleus those sums
define (within ~1e-7 of p it may differ from the float64 torch cut by one token, as the cut may).
Eos ranks by its float64 ζ_eos: as a pivot it becomes the largest fp32 value ≤ ζ_eos, with the
column rule only when ζ_eos is exact in fp32.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_power_of_2
from .lanes import LOG2E, fold_row_lanes, lane_pointers, merge_lanes, ranked_lane_mass
from .nucleus import _load_x, _row_head, tile_table_width
from .reductions import FUSED, add_pair, crossing_with, lowest_key
from .row_select import HEAD_CODES, Selection, _Outputs, _split_f64, _uniform_f64_stream

# A round the bounds reject leaves S as it was (a pass-rejected one shrinks it), so a row takes
# about 1/p rounds at worst: P(all rejected) ≤ (1 − p)^64 per row.
MAX_ROUNDS = 64
# Top-p candidates per round. A round the bounds reject costs about what a pass costs (a float64
# inverse CDF over the lanes, a gather, reductions: latency), and p = 0.4 took up to 18 rounds on
# an H200: drawing several candidates from S at once and examining the first the bounds
# do not reject shares one cumulative sum and one set of reductions among them. One until the
# GPU sweep times more (``profile_decoding --tables round-candidates``).
ROUND_CANDIDATES = 1
UNIFORM_STREAM = 2  # Philox stream of the rounds' uniforms (the cut's draw uses 1, the scan 0)


@triton.jit
def _fp32_floor(value):
    """The largest fp32 ≤ a float64 ``value`` (±inf kept), and whether it equals ``value``."""
    near = value.to(tl.float32)
    high = near.to(tl.float64) > value
    bits = near.to(tl.int32, bitcast=True)
    # One ulp towards −inf: the magnitude's bits grow for negatives, shrink for positives; +0 → −min.
    down = tl.where(near > 0.0, bits - 1, tl.where(near < 0.0, bits + 1, -2147483647)).to(tl.float32, bitcast=True)
    floor = tl.where(high, down, near)
    return floor, floor.to(tl.float64) == value


@triton.jit
def _ranked_before(x, cols, pivot_value, pivot_col):
    """Tokens (x, column) ranked before the pivot: a larger x, or the same x at a lower column (the
    pivot has the shape of ``x`` less its last axis)."""
    value = tl.expand_dims(pivot_value, -1)
    return (x > value) | ((x == value) & (cols < tl.expand_dims(pivot_col, -1)))


@triton.jit
def _bounds(lane_top, lane_top_e, lane_e, cand_value, cand_e, w, eos_term, slack, threshold):
    """Per row, whether the candidate (fp32 pivot ``cand_value``) is surely in the nucleus, or surely
    out, from the lane maxima alone — no pass over the row.

    The mass ranked before the candidate is at least the weights of the lane maxima above it (each
    such max ranks before it; a pass adds exactly those terms, and more), and at most S's masses
    of the lanes whose max reaches it (a lane whose max is below holds nothing ranked before it)
    less the candidate's own weight ``cand_e`` (0 for eos, which no lane holds).
    Both are taken with ``slack`` against the pass's own rounding; an undecided candidate takes the
    pass. On peaked rows the bounds settle most rounds (measured on an H200)."""
    cand = tl.expand_dims(cand_value, -1)  # (rows, candidates) against (rows, 1, lanes) tables
    # Both sums in one reduction (one set of barriers on a GPU).
    below = tl.where(lane_top > cand, lane_top_e, 0.0).to(tl.float64)
    reaching = tl.where(lane_top >= cand, lane_e, 0.0).to(tl.float64)
    if FUSED:
        lower, upper = tl.reduce((below, reaching), 2, add_pair)
    else:
        lower = tl.sum(below, axis=2)
        upper = tl.sum(reaching, axis=2)
    upper = tl.maximum(upper - cand_e * (1.0 - slack), 0.0)
    # 2^-100: the weights one fp32 path flushes to 0 and the other keeps (V · 2^-126 at most).
    sure_in = w * upper * (1.0 + slack) + 7.888609052210118e-31 + eos_term < threshold
    sure_out = w * lower * (1.0 - slack) + eos_term >= threshold
    return sure_in, sure_out


@triton.jit
def _row_draw_kernel(
    z_ptr, z_row_stride, n_rows, V, eos_index, inv_temp,
    log1m_eps_hi, log1m_eps_lo, steps_ptr, steps_stride, steps_value, state_ptr, state_stride,
    top_p_hi, top_p_lo, seed_ptr,
    token_ptr, log_prob_ptr,  # (rows,) int64 / fp64: the draw and its untruncated log-prob
    rounds_ptr,  # (rows,) int32: rounds this row took (for tuning and tests)
    # (rows,) int32: rounds whose acceptance test read the row (VERIFY: bound decisions the pass
    # contradicted); stored only when store_passes is non-zero.
    passes_ptr, store_passes,
    new_state_ptr, flags_ptr, no_row,  # flags: first bad / unresolved row; no_row (the batch size): none
    # A runtime bound, not a constexpr: Triton 3.6's TritonGPUCoalesce pass crashed on the loop a
    # bound of 0 (tests: every row to the fallback) constant-folds away.
    max_rounds,
    HEAD: tl.constexpr, STEPS_PER_ROW: tl.constexpr, HAS_STATE: tl.constexpr,
    STREAM: tl.constexpr, TRUNCATE: tl.constexpr, NTILES: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr, PREFETCH: tl.constexpr, BOUNDS: tl.constexpr, VERIFY: tl.constexpr,
    CANDS: tl.constexpr,  # candidates drawn per round (top-p; plain sampling: 1)
):
    HAS_EOS: tl.constexpr = HEAD != 0
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < n_rows
    base = z_ptr + rows.to(tl.int64)[:, None] * z_row_stride
    lanes = tl.arange(0, BLOCK_V)
    lane_ptrs = lane_pointers(z_ptr, z_row_stride, rows, n_rows, BLOCK_B, BLOCK_V)

    # 1. Per lane (a column position of the tile, across the row's tiles): max and Σ e^(x − max),
    # with no reduction across the tile in the loop (``row_scan.fold_lanes``); their merge gives M,
    # Σ e^(x − M) and the lane masses, the set S's first tables.
    lane_max, lane_sum, _no_argmax, _no_runners_up = fold_row_lanes(lane_ptrs, 0, V, eos_index, inv_temp * -LOG2E,
                                                                    False, 0, PREFETCH, HAS_EOS, BLOCK_B, BLOCK_V)
    max_z, lane_e = merge_lanes(lane_max, lane_sum, inv_temp)  # NaN/+inf rows: NaN, flagged below
    m = max_z * inv_temp
    log_norm, eos_zeta, p_eos, w, bad = _row_head(
        m, tl.sum(lane_e, axis=1), z_ptr, z_row_stride, rows, row_ok, eos_index, log1m_eps_hi, log1m_eps_lo,
        steps_ptr, steps_stride, steps_value, state_ptr, state_stride, new_state_ptr, HEAD, STEPS_PER_ROW,
        HAS_STATE, BLOCK_B)
    threshold = tl.cast(top_p_hi, tl.float64) + tl.cast(top_p_lo, tl.float64)
    seed = tl.load(seed_ptr)

    # 2. Rounds. The set S: the tokens ranked before the pivot (at first: every finite x), with eos
    # while eos_in; its mass is total, w × the per-lane masses lane_e plus eos's.
    pending = row_ok & ~bad
    pivot_value = tl.full((BLOCK_B,), float("-inf"), tl.float32)
    pivot_col = tl.full((BLOCK_B,), 0, tl.int32) + V
    eos_in = pending & (p_eos > 0.0)
    lane_e = tl.where(pending[:, None], lane_e, 0.0)
    # S's lane CDF: the cumulative float64 lane masses and their total. Only a pass-rejected round
    # changes S, so only such a round recomputes them; the rounds the bounds decide reuse them.
    cum = tl.cumsum(lane_e.to(tl.float64), axis=1)
    lane_total = tl.sum(lane_e.to(tl.float64), axis=1)
    total = tl.where(eos_in, p_eos, 0.0) + w * lane_total
    eos_floor, eos_exact = _fp32_floor(eos_zeta)  # eos as a pivot (fp32 compares along the row)
    token = tl.zeros((BLOCK_B,), tl.int64)
    zeta = tl.zeros((BLOCK_B,), tl.float64)
    rounds = tl.zeros((BLOCK_B,), tl.int32)
    passes = tl.zeros((BLOCK_B,), tl.int32)
    # The bounds' inputs (see _bounds): each lane's max x and its weight e^(x − M), computed as the
    # acceptance pass computes a weight; and the relative slack that covers the difference between
    # pass 1's lane masses and a pass's sums (both fp32 over ≤ NTILES terms per lane, exponents of
    # magnitude ≤ |M| + 150 rounded at 2^-24: generous, so a bound never decides against the pass).
    lane_top = lane_max * inv_temp
    lane_top_e = tl.exp2((lane_top - m[:, None]) * LOG2E)
    slack = (NTILES + 2) * (tl.abs(m).to(tl.float64) + 256.0) * 9.5367431640625e-07  # · 2^-20
    # Each round draws CANDS candidates from S at once, (rows, CANDS) below; the tables they share
    # get a candidates axis of 1.
    cand = tl.arange(0, CANDS)[None, :]
    lanes = lanes[None, :]
    steps_of_lane = tl.arange(0, NTILES)[None, None, :] * BLOCK_V
    lane_top = lane_top[:, None, :]
    lane_top_e = lane_top_e[:, None, :]
    # A round is a chain of reductions across the program (two to three barriers each at 16 warps: its
    # latency), so each step below takes one: the lane (per candidate), the column with
    # its value, both bounds, the examined candidate.
    r = 0
    while (tl.max(pending.to(tl.int32), axis=0) > 0) & (r < max_rounds):
        # Draw CANDS independent candidates from S: eos first, then tokens by lane (the lane, then its
        # column: the lane's columns are one per tile, NTILES strided loads per candidate).
        goal = _uniform_f64_stream(seed, (rows * max_rounds + r)[:, None] * CANDS + cand, STREAM) * total[:, None]
        eos_part = tl.where(eos_in, p_eos, 0.0)[:, None]
        goal_e = (goal - eos_part) / tl.where(w > 0.0, w, 1.0)[:, None]  # in units of e^(x − M)
        is_eos = eos_in[:, None] & ((goal < eos_part) | (lane_total <= 0.0)[:, None])
        # Every candidate searches the one cumulative sum in (rows, lanes) form — a (rows, CANDS,
        # lanes) search cost plain sampling twice the registers (sm_90).
        lane_weights = lane_e.to(tl.float64)
        before = cum - lane_weights  # each lane's mass before it: the scan's own prefix
        lane = tl.zeros((BLOCK_B, CANDS), tl.int32)
        skipped = tl.zeros((BLOCK_B, CANDS), tl.float64)
        for c in tl.static_range(CANDS):
            this = cand == c
            lane_c, skipped_c = crossing_with(cum, lane_weights, tl.sum(tl.where(this, goal_e, 0.0), axis=1), lanes,
                                              BLOCK_V, before, 0.0)
            lane = tl.where(this, lane_c[:, None], lane)
            skipped = tl.where(this, skipped_c[:, None], skipped)
        cols = lane[:, :, None] + steps_of_lane
        x = _load_x(base[:, :, None], cols, pending[:, None] & ~is_eos & (lane >= 0), V, eos_index, inv_temp,
                    HAS_EOS)
        e = tl.where(_ranked_before(x, cols, pivot_value[:, None], pivot_col[:, None]),
                     tl.exp2((x - m[:, None, None]) * LOG2E), 0.0)
        col, col_x = crossing_with(tl.cumsum(e, axis=2), e, (goal_e - skipped).to(tl.float32), cols, V, x,
                                   float("-inf"))
        drawn = pending[:, None] & (is_eos | (col >= 0))  # col < 0: rounding left no token; draw again

        # Eos's place against each candidate (float64, by the exact ζ_eos).
        x64 = col_x.to(tl.float64)
        eos_zeta_c = eos_zeta[:, None]
        eos_before = eos_in[:, None] & ~is_eos & ((eos_zeta_c > x64) | ((eos_zeta_c == x64) & (eos_index < col)))
        # The round's candidate: plain sampling's first draw; top-p's first one the bounds do not reject
        # (candidates are independent draws from S: skipping rejected ones is more rejection rounds,
        # and the later ones are dropped unexamined). VERIFY takes the first draw, to audit both bounds.
        decided_in = drawn & False
        decided_out = drawn & False
        if TRUNCATE:
            eos_term = tl.where(eos_before, p_eos[:, None], 0.0)
            cand_e = tl.where(is_eos, 0.0, tl.exp2((col_x - m[:, None]) * LOG2E)).to(tl.float64)  # as a pass weighs it
            sure_in, sure_out = _bounds(lane_top, lane_top_e, lane_e[:, None, :], tl.where(is_eos, eos_floor[:, None],
                                        col_x), cand_e, w[:, None], eos_term, slack[:, None], threshold)
            if BOUNDS:
                decided_in = drawn & sure_in & ~sure_out
                decided_out = drawn & sure_out & ~sure_in
        deciding = drawn & ~decided_out
        if VERIFY:
            deciding = drawn
        facts = (is_eos.to(tl.int32) | (eos_before.to(tl.int32) << 1) | (decided_in.to(tl.int32) << 2)
                 | (decided_out.to(tl.int32) << 3))
        key = tl.where(deciding, cand, CANDS)
        if FUSED:
            first, col, col_x, facts = tl.reduce((key, col, col_x, facts), 1, lowest_key)
        else:
            first = tl.min(key, axis=1)
            at = cand == first[:, None]
            col = tl.sum(tl.where(at, col, 0), axis=1)
            col_x = tl.sum(tl.where(at, col_x, 0.0), axis=1)
            facts = tl.sum(tl.where(at, facts, 0), axis=1)
        drawn = first < CANDS
        is_eos = drawn & ((facts & 1) != 0)
        eos_before = drawn & ((facts & 2) != 0)
        decided_in = drawn & ((facts & 4) != 0)
        decided_out = drawn & ((facts & 8) != 0)
        # The examined candidate as a pivot: eos at its fp32 floor (with its column only when exact).
        x64 = col_x.to(tl.float64)
        cand_value = tl.where(is_eos, eos_floor, col_x)
        cand_col = tl.where(is_eos, tl.where(eos_exact, eos_index, 0), col)

        accept = drawn  # plain sampling: the first draw is the answer
        shrink = drawn & False  # rows whose S narrows to the tokens ranked before the candidate (top-p only)
        mass_before = total
        if TRUNCATE:
            eos_term = tl.where(eos_before, p_eos, 0.0)
            need_pass = drawn & ~decided_in & ~decided_out
            pass_accept = drawn & False
            run_pass = tl.max(need_pass.to(tl.int32), axis=0) > 0
            if VERIFY:
                run_pass = tl.max(drawn.to(tl.int32), axis=0) >= 0  # every round (to audit the bounds)
            if run_pass:
                # One pass: the mass ranked before the candidate, per lane (S's tables if it is rejected).
                next_e = ranked_lane_mass(lane_ptrs, 0, V, eos_index, inv_temp, m, cand_value, cand_col, PREFETCH,
                                          HAS_EOS, BLOCK_B, BLOCK_V)
                next_total = tl.sum(next_e.to(tl.float64), axis=1)
                mass_before = w * next_total + eos_term
                pass_accept = (mass_before < threshold) | (mass_before == 0.0)  # the first token is always kept
                # A pass-rejected candidate shrinks S to the tokens ranked before it (the pass gave
                # their tables, and S's lane CDF is redone); one the bounds rejected leaves S as it
                # was: the next round draws from S again.
                narrows = need_pass & ~pass_accept
                lane_e = tl.where(narrows[:, None], next_e, lane_e)
                cum = tl.cumsum(lane_e.to(tl.float64), axis=1)
                lane_total = tl.where(narrows, next_total, lane_total)
            accept = decided_in | (need_pass & pass_accept)
            shrink = need_pass & ~pass_accept
            if VERIFY:
                passes += ((decided_in & ~pass_accept) | (decided_out & pass_accept)).to(tl.int32)
            else:
                passes += need_pass.to(tl.int32)
        token = tl.where(accept, tl.where(is_eos, eos_index, col).to(tl.int64), token)
        zeta = tl.where(accept, tl.where(is_eos, eos_zeta, x64), zeta)
        pivot_value = tl.where(shrink, cand_value, pivot_value)
        pivot_col = tl.where(shrink, cand_col, pivot_col)
        total = tl.where(shrink, mass_before, total)
        eos_in = tl.where(shrink, eos_before, eos_in)
        rounds += pending.to(tl.int32)
        pending = pending & ~accept
        r += 1

    tl.store(token_ptr + rows, token, mask=row_ok)
    tl.store(log_prob_ptr + rows, zeta - log_norm, mask=row_ok)
    tl.store(rounds_ptr + rows, rounds, mask=row_ok)
    if store_passes != 0:
        tl.store(passes_ptr + rows, passes, mask=row_ok)
    tl.atomic_min(flags_ptr, tl.min(tl.where(bad & row_ok, rows, no_row), axis=0))
    tl.atomic_min(flags_ptr + 1, tl.min(tl.where(pending, rows, no_row), axis=0))


def cuda_launch(V: int, *, top_p: bool = False, block_v: int = 2048, num_warps: Optional[int] = None,
                prefetch: bool = True, maxnreg: Optional[int] = None) -> dict:
    """One row per program on a GPU: its later passes re-read the row from L2. The defaults, from
    the H100 sweep at B = 256 (``benchmarks.profile_decoding``) of the kernel that still
    reduced every tile: 2048-column tiles with PREFETCH; plain sampling at 8 warps (2.4x the
    one-read floor at V = 50257; 4 and 16 warps 3.8x), top-p at 16 (6.2x vs 12.1x at 8 warps).
    ``maxnreg``: a cap on registers per thread (a compile option), so that more programs reside
    per SM (:func:`top_p_layout`)."""
    block_v = min(block_v, next_power_of_2(V))
    if num_warps is None:
        num_warps = 16 if top_p else 8
    launch = dict(BLOCK_B=1, BLOCK_V=block_v, NTILES=tile_table_width(V, block_v), PREFETCH=prefetch,
                  num_warps=num_warps)
    return launch if maxnreg is None else launch | {"maxnreg": maxnreg}


# Top-p's layout on a GPU. A 16-warp program over 2048-column tiles takes a whole SM's registers
# (128 per thread), so a batch of more rows than SMs runs in waves, each ending in its rows' rounds
# (chains of reductions while the SM reads nothing): at 256 x 50257 on an H100, two waves. Over
# 1024-column tiles, 8 warps fit 128 registers with no spill (sm_90, Triton 3.6: uncapped they take
# 174-188), so two programs reside per SM and such a batch runs in one wave. A lane then spans twice
# the columns, which leaves the rounds and the passes per row as they were (the interpreter, 256 x
# 50257 randn · 3: p = 0.4 1.72-1.84 rounds and 0.01-0.02 passes per row, p = 0.9 1.09-1.10 and
# 0.07-0.12, at either width). Batches of at most one row per SM keep the wide program,
# which streams its row with twice the threads.
WIDE_TOP_P = dict(block_v=2048, num_warps=16)
COMPACT_TOP_P = dict(block_v=1024, num_warps=8, maxnreg=128)
# Both by name, for the tools that compile or time each (compile_check, profile_decoding).
TOP_P_LAYOUTS = {"wide": WIDE_TOP_P, "compact": COMPACT_TOP_P}


def top_p_layout(rows: int, multi_processors: int) -> dict:
    """Keyword arguments of :func:`cuda_launch` for top-p over ``rows`` rows on a GPU with
    ``multi_processors`` SMs: the wide program while each row has an SM to itself, else two
    compact programs per SM."""
    return dict(WIDE_TOP_P if rows <= multi_processors else COMPACT_TOP_P)


def _interpreter_launch(rows: int, V: int, candidates: int = 1) -> dict:
    """The CPU interpreter pays mostly per operation: many rows per program (2^18 elements per
    tensor: a 10^5-row G-test batch ran ~3× faster than with 2^16, as fast as with 2^20), fewer
    with several ``candidates`` per round (their (rows, candidates, lanes) tensors)."""
    block_v = min(2048, next_power_of_2(V))
    n_tiles = tile_table_width(V, block_v)
    return dict(BLOCK_B=min(next_power_of_2(max(rows, 1)), max(1, (1 << 18) // (max(block_v, n_tiles) * candidates))),
                BLOCK_V=block_v, NTILES=n_tiles, PREFETCH=True)  # the GPU's code path


def default_launch(z: torch.Tensor, *, top_p: bool = False, candidates: int = 1) -> dict:
    """The launch :func:`draw_rows` takes for ``z`` (top-p or plain sampling; ``candidates`` per
    round) when given none."""
    B, V = z.shape
    if not z.is_cuda:
        return _interpreter_launch(B, V, candidates)
    if not top_p:
        return cuda_launch(V)
    return cuda_launch(V, top_p=True,
                       **top_p_layout(B, torch.cuda.get_device_properties(z.device).multi_processor_count))


def draw_rows(
    z: torch.Tensor,
    *,
    head: str,
    eos_index: int,
    eps: float,
    temperature: float,
    steps: int | torch.Tensor,
    state: Optional[torch.Tensor],
    seed: torch.Tensor,
    top_p_threshold: Optional[float] = None,
    launch: Optional[dict] = None,
    bounds: bool = True,
    passes: Optional[torch.Tensor] = None,
    verify: bool = False,
    round_candidates: Optional[int] = None,
) -> tuple[Selection, torch.Tensor]:
    """Draw one token per row from each row's step distribution, or from its top-p truncation.

    Args:
        z: (B, V) fp32/bf16/fp16 logits with unit stride along V (any row stride).
        head: "va" | "nmst" | "st"; eos_index, eps: the head's; temperature divides non-eos logits.
        steps: t of this step: an int, or a (B,) int64 tensor (stride 0 allowed).
        state: "st" only: (B,) float64 running log(1 − α) before this step (None: 0).
        seed: one-element int64 tensor for the draw.
        top_p_threshold: None: plain sampling (one read). Else top-p by rejection: keep tokens
            while the mass ranked before them is below this (top_p minus the caller's rounding slack).
        launch: block sizes, PREFETCH and num_warps, for tuning sweeps (``benchmarks.profile_decoding``);
            None: :func:`default_launch`.
        bounds: top-p: decide a round from the lane maxima when they settle it (no pass over the
            row); False: every round reads the row (the earlier kernel, for comparisons).
        passes: an optional (B,) int32 output: per row, the rounds that read the row.
        verify: tests: every round also reads the row, and ``passes`` counts the rounds whose
            bound decision the pass contradicted (there must be none); each round examines its first
            candidate (with one candidate per round the draws are unchanged).
        round_candidates: top-p: candidates drawn per round (1, 2 or 4; None:
            ``ROUND_CANDIDATES``); each round examines the first the bounds do not reject.
    Returns:
        (:class:`nmst_fast.kernels.row_select.Selection`, rounds: (B,) int32 rounds per row). ``flags[0]`` < B
        names a row with no distribution (NaN); ``flags[1]`` < B a row still without a token after
        ``MAX_ROUNDS`` rounds (top-p: still rejected; plain: only fp32 rounding can make a round
        miss) — its token is invalid, the caller draws it another way.
    """
    B, V = z.shape
    if z.stride(1) != 1:
        raise ValueError("z must have unit stride along V")
    truncate = top_p_threshold is not None
    cands = ROUND_CANDIDATES if round_candidates is None else round_candidates
    if cands not in (1, 2, 4):  # 8 spilled 832 bytes per thread at 16 warps (sm_90)
        raise ValueError(f"round_candidates must be 1, 2 or 4, got {round_candidates}")
    cands = cands if truncate else 1  # plain sampling takes its first draw
    out = _Outputs(z, head, eps, steps, state)
    rounds = torch.empty(B, dtype=torch.int32, device=z.device)
    if B:
        launch = default_launch(z, top_p=truncate, candidates=cands) if launch is None else launch
        _row_draw_kernel[(cdiv(B, launch["BLOCK_B"]),)](
            z, z.stride(0), B, V, eos_index, 1.0 / temperature, *out.head_args,
            *_split_f64(top_p_threshold if truncate else 2.0), seed,
            out.tokens, out.log_probs, rounds, rounds if passes is None else passes, int(passes is not None),
            out.state, out.flags, B, MAX_ROUNDS,
            HEAD=HEAD_CODES[head], STEPS_PER_ROW=out.steps_per_row, HAS_STATE=out.has_state,
            STREAM=UNIFORM_STREAM, TRUNCATE=truncate, BOUNDS=bounds, VERIFY=verify, CANDS=cands,
            **launch,
        )
    return out.selection(head), rounds
