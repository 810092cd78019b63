"""Top-p (nucleus) sampling, one program per row: rejection rounds, about one to two reads.

Rank tokens by (probability desc, column asc); the nucleus is the prefix of that ranking that
stops at the first token whose ranked-before mass reaches p. So one token j is in the nucleus iff
the mass of the tokens ranked before it is below p, a test one pass over the row decides. Hence:

1. one pass: per lane of the row, the max and Σ e^(x − max) of the non-eos x = z / temperature;
   then M, Σ e^(x−M), the head's float64 scalars (:func:`_row_head`) and the lane masses. A lane
   is a column position of the BLOCK_V-wide tile followed across the row's tiles (columns l,
   l + BLOCK_V, …): the passes keep their sums per lane, so their loops reduce nothing across the
   tile (no barrier; ``lanes.fold_lanes``), and one reduction per pass merges the lanes;
2. rounds: draw a candidate j by inverse CDF from the current set S (at first: every token; eos
   by its exact mass, the lane from the per-lane masses, the column by a cumulative sum along
   that one lane), then one pass sums the mass ranked before j, per lane. Below p: j is the draw.
   Otherwise every token from j down is outside the nucleus: S becomes the tokens ranked before j
   (whose per-lane masses that pass just produced) and the next round draws from it.

Most rounds need no pass: the lane maxima bound the ranked-before mass (:func:`_bounds`: at least
the weights of the lane maxima ranked before j, at most S's masses of the lanes whose max reaches
j, less j's own weight), and a round is decided without reading the row when the bounds fall on
one side of p. On peaked rows (z ~ N(0, 3²), V = 50257) that settles ~97% of the rounds of p = 0.4
and ~85% of p = 0.9, so top-p costs about one read; a round the bounds reject leaves S as it was.

Conditioned on landing in the nucleus, a draw from S ⊇ nucleus is a draw from the renormalized
nucleus, so every accepted round gives an exact sample, whichever way S shrank or did not. A
round accepts with probability mass(nucleus) / mass(S) ≥ p, and S shrinks with each pass-decided
rejection (≈ log₂(1/p) rounds on a flat row); from ``FORCED_PASS_ROUND`` on, every rejection takes
the pass. A row still drawing after ``MAX_ROUNDS`` is flagged (flags[1]); the caller then draws it by
the torch path.

The acceptance test sums fp32 exponentials along each lane in column order, then float64 across
lanes and with eos, and keeps by the torch path's float64 rule ("mass before < p; the first token
always"); the fixed summation order makes it monotone along the ranking (rounding is monotone):
the accepted tokens are exactly a prefix, so the rejection is exact for the nucleus those sums
define (within ~1e-7 of p it may differ from the float64 torch cut by one token).
Eos ranks by its float64 ζ_eos: as a pivot it becomes the largest fp32 value ≤ ζ_eos, with the
column rule only when ζ_eos is exact in fp32.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_power_of_2, scan_width
from .lanes import LOG2E, fold_row_lanes, lane_pointers, merge_lanes, ranked_lane_mass
from .reductions import FUSED, add_pair, crossing_with
from .row_scan import multi_processors
from .row_select import (
    HEAD_CODES,
    Selection,
    _head_inputs,
    _Outputs,
    _split_f64,
    _survival_terms,
    _uniform_f64_stream,
    _with_lse,
)

# Every round accepts with probability ≥ p, so P(a row is left after MAX_ROUNDS) ≤ (1 − p)^64. A
# round the bounds reject leaves S as it was; a pass-rejected one shrinks it (its mass about halves),
# so from round FORCED_PASS_ROUND on every rejection takes the pass and the acceptance odds grow.
MAX_ROUNDS = 64
FORCED_PASS_ROUND = 32
UNIFORM_STREAM = 2  # Philox stream of the rounds' uniforms (the select kernels' draw uses 1, the scan 0)


def tile_table_width(V: int, block_v: int) -> int:
    """Columns of a row's per-tile table: the tile count, padded as a scanned table (``scan_width``)."""
    return scan_width(cdiv(V, block_v))


@triton.jit
def _load_x(base, cols, rows_on, V, eos_index, inv_temp, HAS_EOS: tl.constexpr):
    """x = z · inv_temp at ``cols`` ((rows, tile) columns) of the rows ``rows_on`` (fp32; −inf outside
    the row and for eos)."""
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
        eos_z, t, prev = _head_inputs(z_ptr, z_row_stride, rows, row_ok, eos_index, steps_ptr, steps_stride,
                                      steps_value, state_ptr, state_stride, HEAD, STEPS_PER_ROW, HAS_STATE, BLOCK_B)
        a_floor, log_alpha, eos_nan = _survival_terms(eos_z, t, prev, rows, row_ok, log1m_eps_hi, log1m_eps_lo,
                                                      new_state_ptr, HEAD)
        log_norm, eos_zeta = _with_lse(lse, a_floor, log_alpha)
        bad = bad | eos_nan
        p_eos = tl.where(bad, 0.0, tl.exp(eos_zeta - log_norm))
    else:
        log_norm = lse
        eos_zeta = tl.full((BLOCK_B,), float("-inf"), tl.float64)
        p_eos = tl.zeros((BLOCK_B,), tl.float64)
    w = tl.where(row_ok & ~bad, tl.exp(m.to(tl.float64) - log_norm), 0.0)
    return log_norm, eos_zeta, p_eos, w, bad


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
    pass."""
    cand = tl.expand_dims(cand_value, -1)  # (rows, 1) against (rows, lanes) tables
    # Both sums in one reduction (one set of barriers on a GPU).
    below = tl.where(lane_top > cand, lane_top_e, 0.0).to(tl.float64)
    reaching = tl.where(lane_top >= cand, lane_e, 0.0).to(tl.float64)
    if FUSED:
        lower, upper = tl.reduce((below, reaching), 1, add_pair)
    else:
        lower = tl.sum(below, axis=1)
        upper = tl.sum(reaching, axis=1)
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
    rounds_ptr,  # (rows,) int32: rounds this row took
    passes_ptr,  # (rows,) int32: rounds whose acceptance test read the row
    new_state_ptr, flags_ptr, no_row,  # flags: first bad / unresolved row; no_row (the batch size): none
    # A runtime bound, not a constexpr: Triton 3.6's TritonGPUCoalesce pass crashed on the loop a
    # bound of 0 (tests: every row to the fallback) constant-folds away.
    max_rounds, forced_pass_round,
    HEAD: tl.constexpr, STEPS_PER_ROW: tl.constexpr, HAS_STATE: tl.constexpr,
    STREAM: tl.constexpr, NTILES: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr, PREFETCH: tl.constexpr,
):
    HAS_EOS: tl.constexpr = HEAD != 0
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < n_rows
    base = z_ptr + rows.to(tl.int64)[:, None] * z_row_stride
    lanes = tl.arange(0, BLOCK_V)[None, :]
    lane_ptrs = lane_pointers(z_ptr, z_row_stride, rows, n_rows, BLOCK_B, BLOCK_V)

    # 1. Per lane: max and Σ e^(x − max), with no reduction across the tile in the loop; their merge
    # gives M, Σ e^(x − M) and the lane masses, the set S's first tables.
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
    steps_of_lane = tl.arange(0, NTILES)[None, :] * BLOCK_V
    r = 0
    while (tl.max(pending.to(tl.int32), axis=0) > 0) & (r < max_rounds):
        # Draw a candidate from S: eos first, then a token by lane (the lane, then its column: the
        # lane's columns are one per tile, NTILES strided loads).
        goal = _uniform_f64_stream(seed, rows * max_rounds + r, STREAM) * total
        eos_part = tl.where(eos_in, p_eos, 0.0)
        goal_e = (goal - eos_part) / tl.where(w > 0.0, w, 1.0)  # in units of e^(x − M)
        is_eos = eos_in & ((goal < eos_part) | (lane_total <= 0.0))
        lane_weights = lane_e.to(tl.float64)
        lane, skipped = crossing_with(cum, lane_weights, goal_e, lanes, BLOCK_V, cum - lane_weights, 0.0)
        cols = lane[:, None] + steps_of_lane
        x = _load_x(base, cols, pending & ~is_eos & (lane >= 0), V, eos_index, inv_temp, HAS_EOS)
        e = tl.where(_ranked_before(x, cols, pivot_value, pivot_col), tl.exp2((x - m[:, None]) * LOG2E), 0.0)
        col, col_x = crossing_with(tl.cumsum(e, axis=1), e, (goal_e - skipped).to(tl.float32), cols, V, x,
                                   float("-inf"))
        drawn = pending & (is_eos | (col >= 0))  # col < 0: rounding left no token; draw again

        # Eos's place against the candidate (float64, by the exact ζ_eos), then the bounds.
        x64 = col_x.to(tl.float64)
        eos_before = eos_in & ~is_eos & ((eos_zeta > x64) | ((eos_zeta == x64) & (eos_index < col)))
        eos_term = tl.where(eos_before, p_eos, 0.0)
        # The candidate as a pivot: eos at its fp32 floor (with its column only when exact).
        cand_value = tl.where(is_eos, eos_floor, col_x)
        cand_col = tl.where(is_eos, tl.where(eos_exact, eos_index, 0), col)
        cand_e = tl.where(is_eos, 0.0, tl.exp2((col_x - m) * LOG2E)).to(tl.float64)  # as a pass weighs it
        sure_in, sure_out = _bounds(lane_top, lane_top_e, lane_e, cand_value, cand_e, w, eos_term, slack, threshold)
        decided_in = drawn & sure_in & ~sure_out
        # A bound-rejected round leaves S as it was; from FORCED_PASS_ROUND on every rejection takes the
        # pass, which narrows S, so a row runs out of rounds only with vanishing probability.
        decided_out = drawn & sure_out & ~sure_in & (rounds < forced_pass_round)

        need_pass = drawn & ~decided_in & ~decided_out
        pass_accept = tl.zeros((BLOCK_B,), tl.int1)
        mass_before = total
        if tl.max(need_pass.to(tl.int32), axis=0) > 0:
            # One pass: the mass ranked before the candidate, per lane (S's tables if it is rejected).
            next_e = ranked_lane_mass(lane_ptrs, 0, V, eos_index, inv_temp, m, cand_value, cand_col, PREFETCH,
                                      HAS_EOS, BLOCK_B, BLOCK_V)
            next_total = tl.sum(next_e.to(tl.float64), axis=1)
            mass_before = w * next_total + eos_term
            pass_accept = (mass_before < threshold) | (mass_before == 0.0)  # the first token is always kept
            # A pass-rejected candidate shrinks S to the tokens ranked before it (the pass gave their
            # tables, and S's lane CDF is redone); one the bounds rejected leaves S as it was: the
            # next round draws from S again.
            narrows = need_pass & ~pass_accept
            lane_e = tl.where(narrows[:, None], next_e, lane_e)
            cum = tl.cumsum(lane_e.to(tl.float64), axis=1)
            lane_total = tl.where(narrows, next_total, lane_total)
        accept = decided_in | (need_pass & pass_accept)
        shrink = need_pass & ~pass_accept
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
    tl.store(passes_ptr + rows, passes, mask=row_ok)
    tl.atomic_min(flags_ptr, tl.min(tl.where(bad & row_ok, rows, no_row), axis=0))
    tl.atomic_min(flags_ptr + 1, tl.min(tl.where(pending, rows, no_row), axis=0))


def cuda_launch(V: int, *, block_v: int = 2048, num_warps: int = 16, prefetch: bool = True,
                maxnreg: Optional[int] = None) -> dict:
    """One row per program on a GPU: its later passes re-read the row from L2. The defaults, from
    the H100 sweep at B = 256 (``benchmarks.profile_decoding``): 2048-column tiles with PREFETCH
    at 16 warps (6.2x the one-read floor vs 12.1x at 8 warps). ``maxnreg``: a cap on registers per
    thread (a compile option), so that more programs reside per SM (:func:`top_p_layout`)."""
    block_v = min(block_v, next_power_of_2(V))
    launch = dict(BLOCK_B=1, BLOCK_V=block_v, NTILES=tile_table_width(V, block_v), PREFETCH=prefetch,
                  num_warps=num_warps)
    return launch if maxnreg is None else launch | {"maxnreg": maxnreg}


# The layout on a GPU. A 16-warp program over 2048-column tiles takes a whole SM's registers
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
    """Keyword arguments of :func:`cuda_launch` for ``rows`` rows on a GPU with ``multi_processors``
    SMs: the wide program while each row has an SM to itself, else two compact programs per SM."""
    return dict(WIDE_TOP_P if rows <= multi_processors else COMPACT_TOP_P)


@functools.lru_cache(maxsize=4096)
def _interpreter_launch(rows: int, V: int) -> dict:
    """The CPU interpreter pays mostly per operation: many rows per program (2^18 elements per
    tensor: a 10^5-row G-test batch ran ~3× faster than with 2^16, as fast as with 2^20)."""
    block_v = min(2048, next_power_of_2(V))
    n_tiles = tile_table_width(V, block_v)
    return dict(BLOCK_B=min(next_power_of_2(max(rows, 1)), max(1, (1 << 18) // max(block_v, n_tiles))),
                BLOCK_V=block_v, NTILES=n_tiles, PREFETCH=True)  # the GPU's code path


def default_launch(z: torch.Tensor) -> dict:
    """The launch :func:`draw_rows` takes for ``z`` when given none (a copy: the caller may change it)."""
    return dict(_default_launch(*z.shape, z.device.index if z.is_cuda else -1))


@functools.lru_cache(maxsize=4096)
def _default_launch(B: int, V: int, device_index: Optional[int]) -> dict:
    """:func:`default_launch` by shape and CUDA device (-1: the interpreter), computed once each."""
    if device_index == -1:
        return _interpreter_launch(B, V)
    return cuda_launch(V, **top_p_layout(B, multi_processors(device_index)))


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
    top_p_threshold: float,
    launch: Optional[dict] = None,
    flags: Optional[torch.Tensor] = None,
) -> tuple[Selection, torch.Tensor, torch.Tensor]:
    """Draw one token per row from the top-p truncation of each row's step distribution.

    Args:
        z: (B, V) fp32/bf16/fp16 logits with unit stride along V (any row stride, 0 included).
        head: "va" | "nmst" | "st"; eos_index, eps: the head's; temperature divides non-eos logits.
        steps: t of this step: an int, or a (B,) int64 tensor (stride 0 allowed).
        state: "st" only: (B,) float64 running log(1 − α) before this step (None: 0).
        seed: one-element int64 tensor for the draw.
        top_p_threshold: keep tokens while the mass ranked before them is below this (top_p minus
            the caller's rounding slack).
        launch: block sizes, PREFETCH and num_warps, for tuning sweeps (``benchmarks.profile_decoding``);
            None: :func:`default_launch`.
        flags: a (2,) int32 tensor to write the flags to (None: a new one).
    Returns:
        (:class:`nmst_fast.kernels.row_select.Selection`, rounds, passes): rounds (B,) int32 per row,
        passes (B,) int32 the rounds whose acceptance test read the row. ``flags[0]`` < B names a
        row with no distribution (NaN); ``flags[1]`` < B a row still rejected after ``MAX_ROUNDS``
        rounds — its token is invalid, the caller draws it another way.
    """
    B, V = z.shape
    if z.stride(1) != 1:
        raise ValueError("z must have unit stride along V")
    out = _Outputs(z, head, eps, steps, state, flags=flags)
    rounds = torch.empty(B, dtype=torch.int32, device=z.device)
    passes = torch.empty(B, dtype=torch.int32, device=z.device)
    if B:
        launch = _default_launch(B, V, z.device.index if z.is_cuda else -1) if launch is None else launch
        _row_draw_kernel[(cdiv(B, launch["BLOCK_B"]),)](
            z, z.stride(0), B, V, eos_index, 1.0 / temperature, *out.head_args, *_split_f64(top_p_threshold), seed,
            out.tokens, out.log_probs, rounds, passes, out.state, out.flags, B, MAX_ROUNDS, FORCED_PASS_ROUND,
            HEAD=HEAD_CODES[head], STEPS_PER_ROW=out.steps_per_row, HAS_STATE=out.has_state, STREAM=UNIFORM_STREAM,
            **launch,
        )
    return out.selection(head), rounds, passes
