"""The split-V row scan of the one-launch decoding step (``scan_select.py``): one read of the logits.

Programs tile the (B, V) logits as BLOCK_B rows × one slice of V (a small batch still fills the GPU)
and walk the slice in BLOCK_V tiles, keeping state per lane (``lanes.py``: no barrier in the loop).
Per (row, split) they leave, over the non-eos x = z · inv_temp: max and Σ e^(x − max) (the head's
L), and the first argmax (greedy), or one column drawn ∝ e^x (a lane by inverse CDF over the lane
masses, then a column of it; the finish picks a split by its mass), or the K best x (top-k). The K
best come from each lane's max and runners-up, checked against the largest value a lane dropped (a
split they do not settle is read again), ranked by one int64 key per column whose order is exactly
(value desc, column asc).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_power_of_2, scan_width
from .lanes import LOG2E, fold_row_lanes, lane_pointers, load_tile, merge_lanes
from .step_common import column_keys, crossing_with, decode_column_keys, philox_key, rng_state
from .workspace import step_buffers

MAX_CANDIDATES = 128  # the largest candidate list per row (a power of two, for tl.topk)
HAS_TOPK = hasattr(tl, "topk")  # tl.topk arrived in Triton 3.3; older ones serve greedy/sampling only


# The list of the lanes' maxima: by extraction (a max per candidate) up to EXTRACT_MAX_K, by a
# tl.topk of the lanes' keys above. A split the lanes' values do not settle is read again and the few
# values they dropped above the K-th enter one at a time (``_enter_dropped``; no tile is sorted).
EXTRACT_MAX_K = tl.constexpr(16)
# Values kept per lane (``lanes.keep_runners_up``): 2 up to K = 16, 3 above. On the GPU layout at
# 256 x 50257 the lanes' maxima alone re-read 11% of the splits at K = 16 and 86% at K = 64; these
# depths re-read none up to K = 64 and ~1% at K = 128 (``python -m benchmarks.lane_depth``).
PAIR_MAX_K = tl.constexpr(16)


@triton.jit
def _extract_into(best, x, above, cols, K: tl.constexpr):
    """``best`` (rows, K int64 keys; padding −2^63) merged with the keys of the columns ``above`` (at most
    K enter, in rank order, each replacing the smallest held key it outranks): a top-K of the union."""
    todo = tl.minimum(tl.sum(above.to(tl.int32), axis=1), K)  # more than K cannot all enter
    slots = tl.arange(0, K)[None, :]
    while tl.max(todo, axis=0) > 0:
        # The largest entering value and its lowest column (callers leave −inf columns out of
        # ``above``: they are padding); a NaN is no column.
        entering = above & (x == x)
        values = tl.where(entering, x, float("-inf"))
        index = tl.where(entering, cols, 2147483647)
        top = tl.max(values, axis=1)
        col = tl.min(tl.where(values == top[:, None], index, 2147483647), axis=1)
        found = (todo > 0) & (col < 2147483647)
        key = column_keys(top, col)
        smallest = tl.min(best, axis=1)
        slot = tl.min(tl.where(best == smallest[:, None], slots, K), axis=1)
        enters = found & (key > smallest)
        best = tl.where(enters[:, None] & (slots == slot[:, None]), key[:, None], best)
        above = above & (cols != col[:, None])
        todo -= 1
    return best


@triton.jit
def _draw_in_split(row_base, rows, row_ok, lo, hi, eos_index, inv_temp, lane_max, lane_mass, split_mass, key,
                   split, n_splits, V, HAS_EOS: tl.constexpr, BLOCK_V: tl.constexpr, LANE_TILES: tl.constexpr):
    """One column of the split drawn ∝ e^x and its raw z: a lane by inverse CDF over the lane masses,
    then a column of it (its ≤ LANE_TILES strided columns, re-read) by inverse CDF over their e^x.
    Column 0 (z −inf) when the split holds no mass (the finish never picks such a split). Uniforms:
    Philox stream 0 at counter row · splits + split."""
    w0, w1, _, _ = tl.randint4x(key, rows * n_splits + split)
    u_lane = tl.minimum(tl.uint_to_uniform_float(w0), 0.99999994)  # below 1: fp32 rounding can reach it
    u_col = tl.minimum(tl.uint_to_uniform_float(w1), 0.99999994)
    lanes = tl.arange(0, BLOCK_V)[None, :]
    lane, lane_top = crossing_with(tl.cumsum(lane_mass, axis=1), lane_mass, u_lane * split_mass, lanes, BLOCK_V,
                                   lane_max, float("-inf"))
    cols = lo + lane[:, None] + tl.arange(0, LANE_TILES)[None, :] * BLOCK_V
    ok = row_ok[:, None] & (lane[:, None] >= 0) & (cols < hi)
    if HAS_EOS:
        ok = ok & (cols != eos_index)
    z = tl.load(row_base + cols, mask=ok, other=float("-inf")).to(tl.float32)
    e = tl.where(z > float("-inf"), tl.exp2((z - lane_top[:, None]) * (inv_temp * LOG2E)), 0.0)
    col, col_z = crossing_with(tl.cumsum(e, axis=1), e, u_col * tl.sum(e, axis=1), cols, V, z, float("-inf"))
    return tl.where(col >= 0, col, 0), col_z


@triton.jit
def _enter_dropped(best, lane_ptrs, lo, hi, eos_index, inv_temp, floor_z, floor_start, HAS_EOS: tl.constexpr,
                   K: tl.constexpr, BLOCK_V: tl.constexpr):
    """The split's K best keys where its lanes' kept values do not settle them (a rare path): ``best``
    with the values the lanes dropped — ranked after the lane's last kept value (``floor_z`` from tile
    ``floor_start``) by raw z desc, then column asc — that rank above its K-th, by a second read."""
    lanes = tl.arange(0, BLOCK_V)[None, :]
    for start in range(lo, hi, BLOCK_V):
        z = load_tile(lane_ptrs, start, hi, eos_index, True, HAS_EOS, BLOCK_V)
        dropped = (z < floor_z) | ((z == floor_z) & (start > floor_start))
        best = _enter_above_kth(best, z * inv_temp, start + lanes, dropped, K)
    return best


@triton.jit
def _enter_above_kth(best, x, cols, allowed, K: tl.constexpr):
    """``best`` with the ``allowed`` finite columns (values ``x``) whose keys rank above its K-th."""
    above = allowed & (x > float("-inf")) & (column_keys(x, cols) > tl.min(best, axis=1)[:, None])
    return _extract_into(best, x, above, cols, K)


@triton.jit
def _lane_candidates(lane_max, lane_start, runners, inv_temp, K: tl.constexpr, DEPTH: tl.constexpr,
                     BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    """The K best keys among the lanes' kept values (max and DEPTH − 1 runners-up), and per row whether
    they are the split's K best: every value a lane did not keep is at most its pushed-out value, so
    they are when every pushed-out x is strictly below the K-th (or none is finite)."""
    x = lane_max * inv_temp
    cols = lane_start + tl.arange(0, BLOCK_V)[None, :]
    if K <= EXTRACT_MAX_K:
        best = _extract_into(tl.full((BLOCK_B, K), -9223372036854775808, tl.int64), x, x > float("-inf"), cols, K)
    else:
        best = tl.topk(tl.where(x > float("-inf"), column_keys(x, cols), -9223372036854775808), K, dim=1)
    # The runners-up, rank by rank (raw z; tiles at their starts).
    second, second_start, third, third_start, pushed_out = runners
    lanes = tl.arange(0, BLOCK_V)[None, :]
    best = _enter_above_kth(best, second * inv_temp, second_start + lanes, True, K)
    if DEPTH == 3:
        best = _enter_above_kth(best, third * inv_temp, third_start + lanes, True, K)
    kth_key = tl.min(best, axis=1)
    kth_value, _ = decode_column_keys(kth_key)
    pushed = tl.max(pushed_out * inv_temp, axis=1).to(tl.float64)
    exact = (pushed == float("-inf")) | ((kth_key != -9223372036854775808) & (pushed < kth_value))
    return best, exact


@triton.jit
def scan_split(z_ptr, z_row_stride, n_rows, V, split_width, eos_index, inv_temp, seed_ptr, max_ptr, sum_ptr,
               top_val_ptr, top_idx_ptr, draw_idx_ptr, key_ptr, HAS_EOS: tl.constexpr, DRAW: tl.constexpr,
               K: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, LANE_TILES: tl.constexpr):
    """This program's share of the scan: its BLOCK_B rows × split ``program_id(1)`` of V, read once, its
    partials stored at (row, split) (buffers and flags: :func:`scan_launch`)."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    lo = split * split_width
    hi = tl.minimum(lo + split_width, V)
    row_ok = rows < n_rows
    row_base = z_ptr + rows.to(tl.int64)[:, None] * z_row_stride
    lanes = tl.arange(0, BLOCK_V)[None, :]
    top_val = tl.full((BLOCK_B,), float("-inf"), tl.float32)
    top_idx = tl.zeros((BLOCK_B,), tl.int32)
    draw_idx = tl.zeros((BLOCK_B,), tl.int32)
    lane_ptrs = lane_pointers(z_ptr, z_row_stride, rows, n_rows, BLOCK_B, BLOCK_V)
    neg_scale = inv_temp * -LOG2E
    if K == 0:
        lane_max, lane_sum, lane_start, _no_runners_up = fold_row_lanes(lane_ptrs, lo, hi, eos_index, neg_scale,
                                                                        not DRAW, 0, False, HAS_EOS, BLOCK_B, BLOCK_V)
    else:
        # PREFETCH (each tile's load issued one tile ahead): the 1024-column tiles then keep 16 values
        # per thread in flight, as greedy's 2048 do, for 2-4 registers.
        DEPTH: tl.constexpr = 2 if K <= PAIR_MAX_K else 3
        lane_max, lane_sum, lane_start, runners = fold_row_lanes(lane_ptrs, lo, hi, eos_index, neg_scale, True, DEPTH,
                                                                 True, HAS_EOS, BLOCK_B, BLOCK_V)
        best, exact = _lane_candidates(lane_max, lane_start, runners, inv_temp, K, DEPTH, BLOCK_B, BLOCK_V)
        if tl.max((~exact).to(tl.int32), axis=0) > 0:
            floor_z, floor_start = (runners[0], runners[1]) if DEPTH == 2 else (runners[2], runners[3])  # last kept
            by_tiles = _enter_dropped(best, lane_ptrs, lo, hi, eos_index, inv_temp, floor_z, floor_start, HAS_EOS, K,
                                      BLOCK_V)
            best = tl.where(exact[:, None], best, by_tiles)
        best = tl.sort(best, dim=1, descending=True)  # readers take each split's list in rank order
        tl.store(key_ptr + (rows * n_splits + split)[:, None] * K + tl.arange(0, K)[None, :], best,
                 mask=row_ok[:, None])
    max_z, lane_mass = merge_lanes(lane_max, lane_sum, inv_temp)
    running_max = max_z * inv_temp
    running_sum = tl.sum(lane_mass, axis=1)
    if DRAW:
        draw_idx, top_val = _draw_in_split(row_base, rows, row_ok, lo, hi, eos_index, inv_temp, lane_max,
                                           lane_mass, running_sum, philox_key(seed_ptr, 0), split, n_splits, V, HAS_EOS,
                                           BLOCK_V, LANE_TILES)
    else:
        # The split's mass and the first column of its max (lanes hold their first maximum's tile).
        firsts = tl.where(lane_max == max_z[:, None], lane_start + lanes, V)
        first = tl.min(firsts, axis=1)
        top_val = max_z  # raw z: splits merge on it, so rounding of z · inv_temp cannot tie them
        top_idx = tl.where(max_z == float("-inf"), 0, first)
    out = rows * n_splits + split
    tl.store(max_ptr + out, running_max, mask=row_ok)
    tl.store(sum_ptr + out, running_sum, mask=row_ok)
    tl.store(top_val_ptr + out, top_val, mask=row_ok)
    tl.store(top_idx_ptr + out, top_idx, mask=row_ok)
    if DRAW:
        tl.store(draw_idx_ptr + out, draw_idx, mask=row_ok)


# The split-V layout on a GPU: one wave of programs. Greedy and sampling: 2048-column tiles, ⌊4·SMs / B⌋
# splits per row (the best count timed on an H200 at B = 1-256, ``benchmarks.profile_decoding``).
# Candidate scans: 1024-column tiles, 4 programs per SM (3 for the tl.topk list's 168 registers; not
# timed yet), and at most FINISH_KEYS keys per row for the finish's tl.topk.
SCAN_BLOCK_V = 2048
SCAN_PROGRAMS_PER_SM = 4
CANDIDATE_BLOCK_V = 1024
SMALL_K_PROGRAMS_PER_SM = 4
LARGE_K_PROGRAMS_PER_SM = 3
FINISH_KEYS = 512


@functools.lru_cache(maxsize=None)
def multi_processors(index: Optional[int]) -> int:
    """SMs of a CUDA device (None: the current one), asked once."""
    return torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index
                                            ).multi_processor_count


@functools.lru_cache(maxsize=4096)
def cuda_launch_shape(B: int, V: int, candidates: int, multi_processors: int) -> tuple[int, int, int]:
    """(BLOCK_B, BLOCK_V, splits) of a scan on a GPU of ``multi_processors`` SMs: enough programs to
    fill it even for one row (also what ``compile_check`` compiles)."""
    B = max(B, 1)  # an empty batch launches nothing; its shape only has to exist
    if not candidates:
        block_v = min(SCAN_BLOCK_V, next_power_of_2(V))
        splits = SCAN_PROGRAMS_PER_SM * multi_processors // B
    else:
        block_v = min(CANDIDATE_BLOCK_V, next_power_of_2(V))
        per_sm = SMALL_K_PROGRAMS_PER_SM if candidates <= EXTRACT_MAX_K.value else LARGE_K_PROGRAMS_PER_SM
        splits = min(per_sm * multi_processors // B, FINISH_KEYS // candidates)  # candidates: K, a power of 2
    return 1, block_v, max(1, min(splits, cdiv(V, block_v)))


def split_layout(V: int, block_v: int, splits: int) -> tuple[int, int]:
    """(columns per split, splits) for about ``splits`` splits of whole BLOCK_V tiles covering V."""
    split_width = cdiv(cdiv(V, splits), block_v) * block_v
    return split_width, cdiv(V, split_width)


@dataclass
class ScanLaunch:
    """One scan launch: grid, arguments in ``scan_split``'s order, compile-time flags, and the partials
    it leaves, (rows, splits) each: "max"/"sum" (the split's max x and Σ e^(x − max)), "top_val"/"top_idx"
    (its largest raw z and first column), a draw's "draw_idx" (its drawn column, whose raw z goes to
    "top_val"), and top-k's "keys" (rows, splits, K)."""

    grid: tuple[int, int]
    args: tuple
    meta: dict
    parts: dict[str, torch.Tensor]
    sync: Optional[torch.Tensor] = None  # the workspace's zeroed int32 slots (``sync_slots``), if asked for


def scan_launch(z: torch.Tensor, *, eos_index: int | None, temperature: float, seed: int | torch.Tensor | None,
                candidates: int, launch: tuple[int, int] | None, sync_slots: Optional[int] = None) -> ScanLaunch:
    """Check a scan's arguments and lay out its launch: ``z`` (B, V) with unit stride along V;
    ``eos_index`` the column left out (None: none); x = z / ``temperature``; ``seed`` (see
    :func:`rng_state`; None: no draw) draws a column per split; ``candidates``: keep the K = next power
    of two >= it best x; ``launch``: (BLOCK_V, splits) instead of the automatic layout; ``sync_slots``:
    take the partials, and this many zeroed int32 slots as ``sync``, from ``workspace.py`` (None: fresh)."""
    if z.dim() != 2 or z.stride(1) != 1:
        raise ValueError("z must be a 2-D tensor with unit stride along V")
    if not 0 <= candidates <= MAX_CANDIDATES or (candidates and not HAS_TOPK):
        raise ValueError(f"candidates must lie in [0, {MAX_CANDIDATES}] (and needs tl.topk), got {candidates}")
    B, V = z.shape
    draws = seed is not None
    grid, split_width, layout, meta = launch_plan(B, V, candidates, launch, draws, z.device.index if z.is_cuda else -1)
    if sync_slots is None or not B:
        parts = {name: torch.empty(shape, dtype=dtype, device=z.device) for name, (shape, dtype) in layout.items()}
        sync = None
    else:
        sync, *buffers = step_buffers(z.device, sync_slots, tuple(layout.values()))
        parts = dict(zip(layout, buffers))
    unused = parts["top_idx"]  # the pointer the kernel gets for outputs it does not write
    seed_tensor = rng_state(seed, z.device) if draws else unused
    args = (z, z.stride(0), B, V, split_width, -1 if eos_index is None else eos_index, 1.0 / temperature, seed_tensor,
            parts["max"], parts["sum"], parts["top_val"], parts["top_idx"], parts.get("draw_idx", unused),
            parts.get("keys", unused))
    return ScanLaunch(grid, args, meta | {"HAS_EOS": eos_index is not None}, parts, sync)


@functools.lru_cache(maxsize=4096)
def launch_plan(B: int, V: int, candidates: int, launch: tuple[int, int] | None, draws: bool,
                 device_index: Optional[int]) -> tuple[tuple[int, int], int, dict, dict]:
    """(grid, columns per split, the partials' layout, compile-time flags) of a scan, once per shape
    (``device_index``: -1 for the interpreter: one split, rows per program for 2^18-element tiles)."""
    # At least 2: Triton 3.6's tl.topk fails to compile for k = 1.
    K = max(2, next_power_of_2(candidates)) if candidates else 0
    if device_index == -1:
        block_v, splits = min(2048, next_power_of_2(V)), 1
        block_b = max(1, min((1 << 18) // block_v, next_power_of_2(B)))
    else:
        block_b, block_v, splits = cuda_launch_shape(B, V, K, multi_processors(device_index))
    if launch is not None:
        block_v, splits = launch
        if K > block_v:
            raise ValueError(f"launch's BLOCK_V ({block_v}) must hold the {K} candidates")
    K = min(K, block_v)  # only when V < K: a row has fewer columns than candidates asked for
    split_width, splits = split_layout(V, block_v, splits)
    meta = dict(DRAW=draws, K=K, BLOCK_B=block_b, BLOCK_V=block_v,
                LANE_TILES=scan_width(split_width // block_v) if draws else 1, num_warps=4)
    # The partials: (shape, dtype) of each ("draw_idx" only for a draw, "keys" only for candidates).
    names = ("max", "sum", "top_val", "top_idx") + (("draw_idx",) if draws else ())
    layout = {name: ((B, splits), torch.int32 if name.endswith("idx") else torch.float32) for name in names}
    if K:
        layout["keys"] = ((B, splits, K), torch.int64)
    return (cdiv(B, block_b), splits), split_width, layout, meta
