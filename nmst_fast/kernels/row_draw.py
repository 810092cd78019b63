"""Top-p (nucleus) sampling, one program per row: rejection rounds, about one to two reads.

A token j is in the nucleus iff the mass ranked before it (probability desc, column asc) is below p.
One pass gives per lane (``lanes.py``) the max and Σ e^(x − max) of the non-eos x = z / temperature,
then the head's float64 scalars. Each round draws a candidate j from the current set S (at first
every token: eos by its exact mass, a lane by the lane masses, a column along that lane) and weighs
the mass ranked before j: below p, j is the draw; otherwise S becomes the tokens ranked before j and
the next round draws from it. A draw from S ⊇ nucleus that lands in the nucleus is an exact sample.

The lane maxima bound the ranked-before mass (:func:`_bounds`) and settle most rounds without a pass
(~97% at p = 0.4, ~85% at 0.9 on N(0, 3²) rows). A round accepts with probability ≥ p; from
FORCED_PASS_ROUND on every rejection takes the pass (S shrinks); a row still drawing after MAX_ROUNDS
is flagged (flags[1]) for the torch path. The pass sums fp32 along each lane in column order, then
float64: monotone along the ranking, so the accepted tokens are exactly a prefix (within ~1e-7 of p
the cut may differ from the float64 torch cut by one token). Eos as a pivot is the largest fp32 ≤
ζ_eos, with the column rule only when ζ_eos is exact in fp32.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_power_of_2, scan_width
from .lanes import LOG2E, fold_row_lanes, lane_pointers, merge_lanes, ranked_lane_mass
from .row_scan import multi_processors
from .step_common import (
    HEAD_CODES,
    NO_ROW,
    Outputs,
    Selection,
    advance_calls,
    crossing_with,
    head_inputs,
    philox_key,
    rng_state,
    split_f64,
    survival_terms,
    uniform_f64,
    with_lse,
)

MAX_ROUNDS = 64  # P(a row is left after them) ≤ (1 − p)^64
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
    """The head's float64 scalars per row from the non-eos (max M, Σ e^(x−M)): (log_norm, ζ_eos, p_eos,
    w = e^(M − log_norm), bad): token v has mass w·e^(x_v − M); bad rows get w = p_eos = 0."""
    lse = m.to(tl.float64) + tl.log(tl.where(row_ok, s, 1.0).to(tl.float64))
    eos_z, t, prev = head_inputs(z_ptr, z_row_stride, rows, row_ok, eos_index, steps_ptr, steps_stride, steps_value,
                                 state_ptr, state_stride, HEAD, STEPS_PER_ROW, HAS_STATE, BLOCK_B)
    survival = survival_terms(eos_z, t, prev, rows, row_ok, log1m_eps_hi, log1m_eps_lo, new_state_ptr, HEAD)
    log_norm, eos_zeta, bad = with_lse(lse, survival, HEAD)
    p_eos = tl.where(bad, 0.0, tl.exp(eos_zeta - log_norm))  # VA: ζ_eos = −inf, 0
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
def _bounds(lane_top, lane_top_e, lane_e, cand_value, cand_e, w, eos_term, slack, threshold):
    """Per row, whether the candidate (fp32 pivot ``cand_value``) is surely in the nucleus, or surely out,
    from the lane maxima alone: the mass ranked before it is at least the weights of the lane maxima
    above it, and at most S's masses of the lanes whose max reaches it less its own weight ``cand_e``
    (0 for eos); both with ``slack`` against the pass's rounding."""
    cand = tl.expand_dims(cand_value, -1)  # (rows, 1) against (rows, lanes) tables
    below = tl.where(lane_top > cand, lane_top_e, 0.0).to(tl.float64)
    reaching = tl.where(lane_top >= cand, lane_e, 0.0).to(tl.float64)
    lower = tl.sum(below, axis=1)
    upper = tl.maximum(tl.sum(reaching, axis=1) - cand_e * (1.0 - slack), 0.0)
    # 2^-100: the weights one fp32 path flushes to 0 and the other keeps (V · 2^-126 at most).
    sure_in = w * upper * (1.0 + slack) + 7.888609052210118e-31 + eos_term < threshold
    sure_out = w * lower * (1.0 - slack) + eos_term >= threshold
    return sure_in, sure_out


@triton.jit
def _row_draw_kernel(
    z_ptr, z_row_stride, n_rows, V, eos_index, inv_temp,
    log1m_eps_hi, log1m_eps_lo, steps_ptr, steps_stride, steps_value, state_ptr, state_stride,
    top_p_hi, top_p_lo, seed_ptr,  # the RNG state (step_common.rng_state), advanced by the last program
    token_ptr, log_prob_ptr,  # (rows,) int64 / fp64: the draw and its untruncated log-prob
    rounds_ptr,  # (rows,) int32: rounds this row took
    passes_ptr,  # (rows,) int32: rounds whose acceptance test read the row
    new_state_ptr, flags_ptr,  # flags: first bad / unresolved row, atomic_min'ed
    # Runtime bounds: Triton 3.6 crashed on the loop a constexpr bound of 0 folds away.
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

    # 1. Per lane: max and Σ e^(x − max); merged: M, Σ e^(x − M) and the lane masses (S's first tables).
    lane_max, lane_sum, _no_argmax, _no_runners_up = fold_row_lanes(lane_ptrs, 0, V, eos_index, inv_temp * -LOG2E,
                                                                    False, 0, PREFETCH, HAS_EOS, BLOCK_B, BLOCK_V)
    max_z, lane_e = merge_lanes(lane_max, lane_sum, inv_temp)  # NaN/+inf rows: NaN, flagged below
    m = max_z * inv_temp
    log_norm, eos_zeta, p_eos, w, bad = _row_head(
        m, tl.sum(lane_e, axis=1), z_ptr, z_row_stride, rows, row_ok, eos_index, log1m_eps_hi, log1m_eps_lo,
        steps_ptr, steps_stride, steps_value, state_ptr, state_stride, new_state_ptr, HEAD, STEPS_PER_ROW,
        HAS_STATE, BLOCK_B)
    threshold = tl.cast(top_p_hi, tl.float64) + tl.cast(top_p_lo, tl.float64)
    key = philox_key(seed_ptr, STREAM)

    # 2. Rounds. S: the tokens ranked before the pivot (at first: all), with eos while eos_in; its mass
    # is total = w × Σ lane_e (+ eos's).
    pending = row_ok & ~bad
    pivot_value = tl.full((BLOCK_B,), float("-inf"), tl.float32)
    pivot_col = tl.full((BLOCK_B,), 0, tl.int32) + V
    eos_in = pending & (p_eos > 0.0)
    lane_e = tl.where(pending[:, None], lane_e, 0.0)
    # S's lane CDF, recomputed only when a pass-rejected round changes S.
    cum = tl.cumsum(lane_e.to(tl.float64), axis=1)
    lane_total = tl.sum(lane_e.to(tl.float64), axis=1)
    total = tl.where(eos_in, p_eos, 0.0) + w * lane_total
    eos_floor, eos_exact = _fp32_floor(eos_zeta)  # eos as a pivot (fp32 compares along the row)
    token = tl.zeros((BLOCK_B,), tl.int64)
    zeta = tl.zeros((BLOCK_B,), tl.float64)
    rounds = tl.zeros((BLOCK_B,), tl.int32)
    passes = tl.zeros((BLOCK_B,), tl.int32)
    # The bounds' inputs: each lane's max x and its weight (as a pass weighs it), and a generous relative
    # slack for fp32 sums of ≤ NTILES terms per lane with exponents up to |M| + 150.
    lane_top = lane_max * inv_temp
    lane_top_e = tl.exp2((lane_top - m[:, None]) * LOG2E)
    slack = (NTILES + 2) * (tl.abs(m).to(tl.float64) + 256.0) * 9.5367431640625e-07  # · 2^-20
    steps_of_lane = tl.arange(0, NTILES)[None, :] * BLOCK_V
    r = 0
    while (tl.max(pending.to(tl.int32), axis=0) > 0) & (r < max_rounds):
        # Draw a candidate from S: eos first, then a lane, then its column (NTILES strided loads).
        goal = uniform_f64(key, rows * max_rounds + r) * total
        eos_part = tl.where(eos_in, p_eos, 0.0)
        goal_e = (goal - eos_part) / tl.where(w > 0.0, w, 1.0)  # in units of e^(x − M)
        is_eos = eos_in & ((goal < eos_part) | (lane_total <= 0.0))
        lane_weights = lane_e.to(tl.float64)
        lane, skipped = crossing_with(cum, lane_weights, goal_e, lanes, BLOCK_V, cum - lane_weights, 0.0)
        cols = lane[:, None] + steps_of_lane
        x = _load_x(base, cols, pending & ~is_eos & (lane >= 0), V, eos_index, inv_temp, HAS_EOS)
        # S: the tokens ranked before the pivot (a larger x, or the same x at a lower column).
        in_s = (x > pivot_value[:, None]) | ((x == pivot_value[:, None]) & (cols < pivot_col[:, None]))
        e = tl.where(in_s, tl.exp2((x - m[:, None]) * LOG2E), 0.0)
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
        # A bound-rejected round leaves S as it was; from FORCED_PASS_ROUND on, rejections take the pass.
        decided_out = drawn & sure_out & ~sure_in & (rounds < forced_pass_round)

        need_pass = drawn & ~decided_in & ~decided_out
        pass_accept = tl.zeros((BLOCK_B,), tl.int1)
        mass_before = total
        if tl.max(need_pass.to(tl.int32), axis=0) > 0:
            # One pass: the mass ranked before the candidate, per lane (S's next tables if rejected).
            next_e = ranked_lane_mass(lane_ptrs, 0, V, eos_index, inv_temp, m, cand_value, cand_col, PREFETCH,
                                      HAS_EOS, BLOCK_B, BLOCK_V)
            next_total = tl.sum(next_e.to(tl.float64), axis=1)
            mass_before = w * next_total + eos_term
            pass_accept = (mass_before < threshold) | (mass_before == 0.0)  # the first token is always kept
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
    tl.atomic_min(flags_ptr, tl.min(tl.where(bad & row_ok, rows, NO_ROW), axis=0))
    tl.atomic_min(flags_ptr + 1, tl.min(tl.where(pending, rows, NO_ROW), axis=0))
    # Every program read the RNG state before counting in: the last advances its calls, zeroes the count.
    if tl.atomic_add(seed_ptr + 2, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(seed_ptr + 2, 0)
        advance_calls(seed_ptr)


def cuda_launch(V: int, *, block_v: int = 2048, num_warps: int = 16, prefetch: bool = True,
                maxnreg: Optional[int] = None) -> dict:
    """One row per program on a GPU (later passes re-read the row from L2); defaults from the H100
    sweep at B = 256 (``benchmarks.profile_decoding``). ``maxnreg``: a register cap per thread."""
    block_v = min(block_v, next_power_of_2(V))
    launch = dict(BLOCK_B=1, BLOCK_V=block_v, NTILES=tile_table_width(V, block_v), PREFETCH=prefetch,
                  num_warps=num_warps)
    return launch if maxnreg is None else launch | {"maxnreg": maxnreg}


# Layouts on a GPU (:func:`cuda_launch`'s arguments): a wide program (16 warps, 2048-column tiles) takes a
# whole SM, so batches of at most one row per SM use it; larger ones take two compact programs per SM (8
# warps, 1024 columns, 128 registers without spills) and run in one wave. Rounds and passes per row are
# the same at either width (interpreter, 256 x 50257).
TOP_P_LAYOUTS = {"wide": dict(block_v=2048, num_warps=16), "compact": dict(block_v=1024, num_warps=8, maxnreg=128)}


def default_launch(z: torch.Tensor) -> dict:
    """A copy of the launch :func:`draw_rows` takes for ``z`` when given none."""
    return dict(_default_launch(*z.shape, z.device.index if z.is_cuda else -1))


@functools.lru_cache(maxsize=4096)
def _default_launch(B: int, V: int, device_index: Optional[int]) -> dict:
    """:func:`default_launch` by shape and CUDA device; -1, the CPU interpreter, which pays per
    operation: many rows per program (2^18 elements per tensor), on the GPU's code path."""
    if device_index != -1:
        return cuda_launch(V, **TOP_P_LAYOUTS["wide" if B <= multi_processors(device_index) else "compact"])
    block_v = min(2048, next_power_of_2(V))
    n_tiles = tile_table_width(V, block_v)
    return dict(BLOCK_B=min(next_power_of_2(max(B, 1)), max(1, (1 << 18) // max(block_v, n_tiles))),
                BLOCK_V=block_v, NTILES=n_tiles, PREFETCH=True)


def draw_rows(
    z: torch.Tensor,
    *,
    head: str,
    eos_index: int,
    eps: float,
    temperature: float,
    steps: int | torch.Tensor,
    state: Optional[torch.Tensor],
    seed: int | torch.Tensor,
    top_p_threshold: float,
    launch: Optional[dict] = None,
    flags: Optional[torch.Tensor] = None,
) -> tuple[Selection, torch.Tensor, torch.Tensor]:
    """One token per row from the top-p truncation of each row's step distribution.

    Args:
        z: (B, V) fp32/bf16/fp16 logits with unit stride along V (any row stride, 0 included).
        head, eos_index, eps, temperature, steps, state, seed, flags: as ``scan_select.scan_select``.
        top_p_threshold: keep tokens while the mass ranked before them is below this (top_p less the
            caller's rounding slack).
        launch: block sizes, PREFETCH and num_warps (tuning sweeps); None: :func:`default_launch`.
    Returns:
        (:class:`step_common.Selection`, rounds (B,) int32, passes (B,) int32: the rounds that read the
        row). ``flags[1]`` < B: a row left without a token after MAX_ROUNDS rounds.
    """
    B, V = z.shape
    if z.stride(1) != 1:
        raise ValueError("z must have unit stride along V")
    out = Outputs(z, head, eps, steps, state, flags=flags)
    rounds = torch.empty(B, dtype=torch.int32, device=z.device)
    passes = torch.empty(B, dtype=torch.int32, device=z.device)
    if B:
        launch = _default_launch(B, V, z.device.index if z.is_cuda else -1) if launch is None else launch
        _row_draw_kernel[(cdiv(B, launch["BLOCK_B"]),)](
            z, z.stride(0), B, V, eos_index, 1.0 / temperature, *out.head_args, *split_f64(top_p_threshold),
            rng_state(seed, z.device),
            out.tokens, out.log_probs, rounds, passes, out.state, out.flags, MAX_ROUNDS, FORCED_PASS_ROUND,
            HEAD=HEAD_CODES[head], STEPS_PER_ROW=out.steps_per_row, HAS_STATE=out.has_state, STREAM=UNIFORM_STREAM,
            **launch,
        )
    return out.selection(head), rounds, passes
