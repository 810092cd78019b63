"""One-read row scan for decoding: split logsumexp, first argmax, a draw per split, top-K candidates.

Programs tile the (B, V) logits as BLOCK_B rows × one slice of V (split-V, so a
small batch still spreads over every SM); each walks its slice in BLOCK_V tiles,
so a step reads the logits once and writes O(B · splits · K) numbers — no (B, V)
probability tensor, no sort of the vocabulary. The wrapper merges the splits.

For every row, over the columns other than ``eos_index`` (all columns when HAS_EOS
is off), with x = z · inv_temp:
  * lse  = logsumexp(x)                                   (L of the NMST head)
  * top  = max(x) and its first (lowest) index            (greedy)
  * draw = one column of the split drawn ∝ e^x            (sampling; the select kernel
           picks a split by its mass, so the pick is an exact softmax sample)
  * candidates = the K largest x, ties → lower index      (top-k / top-p)
Every variant keeps per-lane state instead of per-tile reductions (``nmst_fast/kernels/lanes.py``: a
lane is a column position of the tile, followed across the split's tiles), so the loops of
greedy, the draw and the candidates have no barrier; one reduction after the loop merges the lanes. The
draw then picks a lane by inverse CDF over the lane masses and a column of that lane by inverse
CDF over its few strided columns (re-read once per split): no per-element noise or logarithms.
Candidates come from each lane's max and 1-3 runners-up, checked by the largest value a lane did not
keep (a split they do not settle is read again by tiles). The seed is read from a
device tensor, so drawing it from a CUDA generator needs no host sync; the draw depends on
(seed, row, tiling). Candidates are ranked by one int64 key per column,
(orderable float bits of x) << 32 | (2³¹ − 1 − column): key order is exactly
(value desc, column asc), so a plain top-k of keys breaks ties the required way.
The caller adds eos with O(B) float64 math (``nmst_fast/kernels/row_select.py`` does it for greedy
and sampling in one more launch).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_power_of_2, scan_width
from .lanes import LOG2E, fold_row_lanes, lane_pointers, last_kept, load_tile, merge_lanes, tile_spans
from .reductions import FUSED, add_and_min, crossing_with, larger_then_lower
from .workspace import step_buffers

# The largest candidate list the kernel keeps per row (a power of two; tl.topk needs one).
MAX_CANDIDATES = 128
HAS_TOPK = hasattr(tl, "topk")  # tl.topk arrived in Triton 3.3; older ones serve greedy/sampling only


@triton.jit
def column_keys(x, cols):
    """One int64 key per (fp32 value, column): keys sorted descending are (value desc, column asc)."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 == +0.0 as floats: give them one key so they tie
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-int order == float order
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)


# Candidate lists start from the lanes' maxima and runners-up (``_lane_candidates``). The list of the
# lanes' maxima is taken by extraction for K <= EXTRACT_MAX_K (one reduction per candidate) and by a
# tl.topk of the lanes' keys (a bitonic sort) above it. Where the lanes' values do not settle a split,
# it is read again and the few values the lanes dropped above the K-th enter one at a time
# (``_enter_dropped``): no tile is sorted (a tl.topk per re-read tile took 80 more registers at
# K = 64, for a path that runs about once in a hundred steps).
EXTRACT_MAX_K = tl.constexpr(16)
# Values each lane keeps (its max and runners-up, ``lanes.keep_runners_up``): the split's K best are
# among them unless some lane holds more than that many of them, about C(K, DEPTH + 1) / lanes^DEPTH
# of the splits for values in random columns. At 256 x 50257 (randn · 3, 1024 lanes) the
# lanes' maxima alone left 2 of 512 splits to re-read at K = 4, ~60 at K = 16 and ~430 at K = 64;
# 2 values per lane up to K = 8, 3 up to 32 and 4 above leave ~0-1 per step. Each rank costs ~6
# instructions per element in the loop.
PAIR_MAX_K = tl.constexpr(8)
TRIPLE_MAX_K = tl.constexpr(32)


@triton.jit
def _extract_into(best, x, above, cols, K: tl.constexpr):
    """``best`` (rows, K int64 keys; padding −2^63) updated with the columns ``above`` (which the caller
    has found to rank above its K-th key): at most K of them, taken in rank order (value desc, column
    asc), each replacing the smallest held key if it ranks above it. Same result as a top-K of best ∪
    the keys of the columns ``above``."""
    todo = tl.minimum(tl.sum(above.to(tl.int32), axis=1), K)  # more than K cannot all enter
    slots = tl.arange(0, K)[None, :]
    while tl.max(todo, axis=0) > 0:
        # The largest entering value and its lowest column, in one reduction. Ties go to the lowest
        # column (callers leave −inf columns out of ``above``: they are padding); a NaN is no column.
        entering = above & (x == x)
        values = tl.where(entering, x, float("-inf"))
        index = tl.where(entering, cols, 2147483647)
        if FUSED:
            top, col = tl.reduce((values, index), 1, larger_then_lower)
        else:
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
def decode_column_keys(keys):
    """(x as float64, column) of keys made by ``column_keys``; padding decodes to (-inf, -1).
    The torch twin is :func:`decode_keys`."""
    padding = keys == -9223372036854775808
    ordered = (keys >> 32).to(tl.int32)
    value_bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    values = tl.where(padding, float("-inf"), value_bits.to(tl.float32, bitcast=True).to(tl.float64))
    return values, tl.where(padding, -1, 0x7FFFFFFF - (keys & 0xFFFFFFFF))


@triton.jit
def uniform_pair(seed, rows, index, per_row):
    """Two U[0, 1) per row from Philox stream 0 at counter row · per_row + index (one counter per
    tile or split of a row). Capped below 1: a reservoir test against a ratio of exactly 1 (a tile
    holding all the mass so far) always passes."""
    w0, w1, _, _ = tl.randint4x(seed, rows * per_row + index)
    return (tl.minimum(tl.uint_to_uniform_float(w0), 0.99999994),
            tl.minimum(tl.uint_to_uniform_float(w1), 0.99999994))


@triton.jit
def _draw_in_split(row_base, rows, row_ok, lo, hi, eos_index, inv_temp, lane_max, lane_mass, split_mass, seed,
                   split, n_splits, V, HAS_EOS: tl.constexpr, BLOCK_V: tl.constexpr, LANE_TILES: tl.constexpr):
    """One column of the split drawn ∝ e^x and its raw z: a lane by inverse CDF over the lane masses,
    then a column of that lane (its ≤ LANE_TILES strided columns, re-read: a few scattered loads once
    per split) by inverse CDF over their e^x. P(lane) · P(column | lane) = P(column). Column 0 (z −inf)
    when the split holds no mass (the select kernel never picks such a split). The z goes with the
    partials, so the finish needs no dependent load of the drawn column."""
    u_lane, u_col = uniform_pair(seed, rows, split, n_splits)
    lanes = tl.arange(0, BLOCK_V)[None, :]
    # The lane and its max z in one reduction.
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
def _dropped_span(best, lane_ptrs, first, last, hi, eos_index, inv_temp, floor_z, floor_start, MASKED: tl.constexpr,
                  HAS_EOS: tl.constexpr, K: tl.constexpr, BLOCK_V: tl.constexpr):
    """``best`` with the columns of the tiles starting in [first, last) that their lane dropped — ranked
    after its last kept value (``floor_z`` from tile ``floor_start``) in the fold's order: raw z desc,
    then column asc — and that rank above best's K-th key. Eos, columns past the split and −inf ones
    (padding) load as −inf and never enter."""
    lanes = tl.arange(0, BLOCK_V)[None, :]
    for start in range(first, last, BLOCK_V):
        z = load_tile(lane_ptrs, start, hi, eos_index, MASKED, HAS_EOS, BLOCK_V)
        dropped = (z < floor_z) | ((z == floor_z) & (start > floor_start))
        best = _enter_above_kth(best, z * inv_temp, start + lanes, dropped, K)
    return best


@triton.jit
def _enter_dropped(best, lane_ptrs, lo, hi, eos_index, inv_temp, floor_z, floor_start, HAS_EOS: tl.constexpr,
                   K: tl.constexpr, BLOCK_V: tl.constexpr):
    """The split's K best keys where its lanes' kept values do not settle them: ``best`` (the K best
    kept values) with the values the lanes dropped that rank above its K-th, by a second read of the
    split (:func:`_dropped_span` over ``lanes.tile_spans``). Few enter (the excess of the lanes that
    held more of the K best than they keep), one reduction each, so no tile needs a sort."""
    eos_start, eos_end, whole_end = tile_spans(lo, hi, eos_index, HAS_EOS, BLOCK_V)
    best = _dropped_span(best, lane_ptrs, lo, eos_start, hi, eos_index, inv_temp, floor_z, floor_start, False,
                         HAS_EOS, K, BLOCK_V)
    best = _dropped_span(best, lane_ptrs, eos_start, eos_end, hi, eos_index, inv_temp, floor_z, floor_start, True,
                         HAS_EOS, K, BLOCK_V)
    best = _dropped_span(best, lane_ptrs, eos_end, whole_end, hi, eos_index, inv_temp, floor_z, floor_start, False,
                         HAS_EOS, K, BLOCK_V)
    return _dropped_span(best, lane_ptrs, whole_end, hi, hi, eos_index, inv_temp, floor_z, floor_start, True,
                         HAS_EOS, K, BLOCK_V)


@triton.jit
def _enter_above_kth(best, x, cols, allowed, K: tl.constexpr):
    """``best`` with the ``allowed`` finite columns (values ``x``) whose keys rank above its K-th. Keys,
    not values, decide: these columns are not in column order after the list's."""
    above = allowed & (x > float("-inf")) & (column_keys(x, cols) > tl.min(best, axis=1)[:, None])
    return _extract_into(best, x, above, cols, K)


@triton.jit
def _enter_runners_up(best, values, starts, inv_temp, BLOCK_V: tl.constexpr, K: tl.constexpr):
    """``best`` with the lanes' values of one rank (raw z, and their tiles' ``starts``) that rank above
    its K-th key."""
    return _enter_above_kth(best, values * inv_temp, starts + tl.arange(0, BLOCK_V)[None, :], True, K)


@triton.jit
def _lane_candidates(lane_max, lane_start, runners, inv_temp, K: tl.constexpr, DEPTH: tl.constexpr,
                     BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    """The K best keys among the lanes' kept values (each lane's max and DEPTH − 1 runners-up,
    ``lanes.keep_runners_up``), and per row whether they are the split's K best.

    Every value a lane did not keep is at most its pushed-out value, so the kept values hold the K
    best when every lane's pushed-out x is below the K-th of them (strictly: an equal x at a lower
    column would rank above it), or when no lane pushed out a finite value. Otherwise (more than
    DEPTH of the K best in one lane, or a tie there) the caller reads the split again."""
    x = lane_max * inv_temp
    cols = lane_start + tl.arange(0, BLOCK_V)[None, :]
    if K <= EXTRACT_MAX_K:
        best = _extract_into(tl.full((BLOCK_B, K), -9223372036854775808, tl.int64), x, x > float("-inf"), cols, K)
    else:
        best = tl.topk(tl.where(x > float("-inf"), column_keys(x, cols), -9223372036854775808), K, dim=1)
    second, second_start, third, third_start, fourth, fourth_start, pushed_out = runners
    if DEPTH >= 2:
        best = _enter_runners_up(best, second, second_start, inv_temp, BLOCK_V, K)
    if DEPTH >= 3:
        best = _enter_runners_up(best, third, third_start, inv_temp, BLOCK_V, K)
    if DEPTH == 4:
        best = _enter_runners_up(best, fourth, fourth_start, inv_temp, BLOCK_V, K)
    kth_key = tl.min(best, axis=1)
    kth_value, _ = decode_column_keys(kth_key)
    pushed = tl.max(pushed_out * inv_temp, axis=1).to(tl.float64)
    exact = (pushed == float("-inf")) | ((kth_key != -9223372036854775808) & (pushed < kth_value))
    return best, exact


@triton.jit
def scan_split(z_ptr, z_row_stride, n_rows, V, split_width, eos_index, inv_temp, seed_ptr, max_ptr, sum_ptr,
               top_val_ptr, top_idx_ptr, draw_idx_ptr, key_ptr, HAS_EOS: tl.constexpr, DRAW: tl.constexpr,
               K: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, LANE_TILES: tl.constexpr):
    """This program's share of the scan: its BLOCK_B rows × split ``program_id(1)`` of V, read once,
    its partials stored at (row, split) (arguments as ``_row_scan_kernel``). Also the first half of
    ``nmst_fast/kernels/scan_select.py``'s one-launch step."""
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
        # Greedy and the draw: per-lane state, one reduction after the loop (see lanes.fold_lanes).
        lane_max, lane_sum, lane_start, _no_runners_up = fold_row_lanes(lane_ptrs, lo, hi, eos_index, neg_scale,
                                                                        not DRAW, 0, False, HAS_EOS, BLOCK_B, BLOCK_V)
    else:
        # The lanes' maxima and runners-up as candidates, checked by what the lanes pushed out; no
        # reduction per tile. A split they do not settle is read again for what the lanes dropped.
        # PREFETCH: each tile's load issued one tile ahead. The 1024-column tiles put 8 values per
        # thread in flight where greedy's 2048 put 16 (4 resident programs either way at small K:
        # 117-124 registers); with it 16 too, for 2-4 registers (the row draw's plain sampling went
        # 59 -> 42 µs with it at low occupancy: measured on an H100).
        DEPTH: tl.constexpr = 2 if K <= PAIR_MAX_K else (3 if K <= TRIPLE_MAX_K else 4)
        lane_max, lane_sum, lane_start, runners = fold_row_lanes(lane_ptrs, lo, hi, eos_index, neg_scale, True, DEPTH,
                                                                 True, HAS_EOS, BLOCK_B, BLOCK_V)
        best, exact = _lane_candidates(lane_max, lane_start, runners, inv_temp, K, DEPTH, BLOCK_B, BLOCK_V)
        if tl.max((~exact).to(tl.int32), axis=0) > 0:
            floor_z, floor_start = last_kept(lane_max, lane_start, runners, DEPTH)
            by_tiles = _enter_dropped(best, lane_ptrs, lo, hi, eos_index, inv_temp, floor_z, floor_start, HAS_EOS, K,
                                      BLOCK_V)
            best = tl.where(exact[:, None], best, by_tiles)
        best = tl.sort(best, dim=1, descending=True)  # readers take each split's list in rank order
        tl.store(key_ptr + (rows * n_splits + split)[:, None] * K + tl.arange(0, K)[None, :], best,
                 mask=row_ok[:, None])
    max_z, lane_mass = merge_lanes(lane_max, lane_sum, inv_temp)
    running_max = max_z * inv_temp
    if DRAW:
        running_sum = tl.sum(lane_mass, axis=1)
        draw_idx, top_val = _draw_in_split(row_base, rows, row_ok, lo, hi, eos_index, inv_temp, lane_max,
                                           lane_mass, running_sum, tl.load(seed_ptr), split, n_splits, V, HAS_EOS,
                                           BLOCK_V, LANE_TILES)
    else:
        # The split's mass and the first index of its max (lanes hold the tile of their first maximum;
        # ties → the lowest column) in one reduction: the program's last step before its stores.
        firsts = tl.where(lane_max == max_z[:, None], lane_start + lanes, V)
        if FUSED:
            running_sum, first = tl.reduce((lane_mass, firsts), 1, add_and_min)
        else:
            running_sum = tl.sum(lane_mass, axis=1)
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


def interpreter_block_rows(rows: int, block_v: int) -> int:
    """Rows per program in the CPU interpreter, which pays per operation, not per element: as many
    as make 2^18-element tiles (CI's million-draw tests depend on it)."""
    return max(1, min((1 << 18) // block_v, next_power_of_2(rows)))


# The split-V layout on a GPU. Plain and drawing scans (greedy, sampling): 2048-column tiles and
# ⌊4·SMs / B⌋ splits per row, one wave of about 4 programs per SM (B = 256 → 2 splits, 32 → 16 on
# 132 SMs): the best count timed on an H200 for greedy at B = 1-256 and for sampling at V = 128256,
# within 12% of the best elsewhere (``python -m benchmarks.profile_decoding``).
SCAN_BLOCK_V = 2048
SCAN_PROGRAMS_PER_SM = 4
# Candidate scans keep each lane's max, mass, tile and 1-3 runners-up in 1024-column tiles, so fewer
# programs reside per SM (ptxas: 117-124 registers for the list by extraction, 4 per SM; 168 for the
# tl.topk of the lanes' keys, 3 per SM); they also take one wave of what resides. Not timed yet.
CANDIDATE_BLOCK_V = 1024
SMALL_K_PROGRAMS_PER_SM = 4
LARGE_K_PROGRAMS_PER_SM = 3
# The finishing program of a row (``scan_select``) merges splits × K candidate keys in registers (a
# tl.topk of them): candidate scans take at most this many keys' worth of splits.
FINISH_KEYS = 512


@functools.lru_cache(maxsize=None)
def multi_processors(index: Optional[int]) -> int:
    """SMs of a CUDA device (None: the current one), asked once (a decoding step's host time counts)."""
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


def _partial_layout(rows: int, splits: int, K: int, draws: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each per-split output of one scan: (rows, splits) each; "draw_idx" only when
    ``draws``, "keys" (rows, splits, K) only when K > 0 (an allocation costs the decoding step's
    host a few µs)."""
    shape = (rows, splits)
    layout = {"max": (shape, torch.float32), "sum": (shape, torch.float32), "top_val": (shape, torch.float32),
              "top_idx": (shape, torch.int32)}
    if draws:
        layout["draw_idx"] = (shape, torch.int32)
    if K:
        layout["keys"] = ((rows, splits, K), torch.int64)
    return layout


def _as_seed(seed: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(seed, torch.Tensor):
        if seed.dtype == torch.int64 and seed.shape == (1,) and seed.device == device:
            return seed
        if seed.numel() != 1 or seed.dtype.is_floating_point:
            raise ValueError("seed must be a one-element integer tensor")
        return seed.reshape(1).to(device=device, dtype=torch.int64)
    return torch.tensor([seed], dtype=torch.int64, device=device)


def split_layout(V: int, block_v: int, splits: int) -> tuple[int, int]:
    """(columns per split, splits) for about ``splits`` splits of whole BLOCK_V tiles covering V
    (fewer splits when rounding the width up to whole tiles leaves some empty)."""
    split_width = cdiv(cdiv(V, splits), block_v) * block_v
    return split_width, cdiv(V, split_width)


@dataclass
class ScanLaunch:
    """What one launch of the scan takes: its grid, its arguments in ``scan_split``'s order (the
    partials' buffers included), its compile-time flags, and the partials it will leave, (rows,
    splits) each ("keys": (rows, splits, K)): "max"/"sum", the split's max x and Σ e^(x − max);
    "top_val"/"top_idx", its largest raw z and that z's first column; a drawing scan's "draw_idx",
    one drawn column per split, with that column's raw z in "top_val"."""

    grid: tuple[int, int]
    args: tuple
    meta: dict
    parts: dict[str, torch.Tensor]
    sync: Optional[torch.Tensor] = None  # the workspace's zeroed int32 slots (``sync_slots``), if asked for


def scan_launch(z: torch.Tensor, *, eos_index: int | None, temperature: float, seed: int | torch.Tensor | None,
                candidates: int, launch: tuple[int, int] | None, sync_slots: Optional[int] = None) -> ScanLaunch:
    """Check a scan's arguments and lay out its launch (buffers allocated): ``z`` (B, V) with unit
    stride along V; ``eos_index`` the column left out (None: none); x = z / ``temperature``;
    ``seed`` (int or one-element integer tensor; None: no draw) draws a column per split;
    ``candidates``: keep the K = next power of two >= it best x (at most MAX_CANDIDATES);
    ``launch``: (BLOCK_V, splits) instead of the automatic layout.

    ``sync_slots``: the partials are scratch of the step workspace (``nmst_fast/kernels/workspace.py``: only
    valid during this launch, for a kernel that consumes them itself), which also hands out this
    many zeroed int32 slots as ``sync``; None: the partials are fresh tensors (a kernel after the
    scan reads them)."""
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
    seed_tensor = _as_seed(seed, z.device) if draws else unused
    args = (z, z.stride(0), B, V, split_width, -1 if eos_index is None else eos_index, 1.0 / temperature, seed_tensor,
            parts["max"], parts["sum"], parts["top_val"], parts["top_idx"], parts.get("draw_idx", unused),
            parts.get("keys", unused))
    return ScanLaunch(grid, args, meta | {"HAS_EOS": eos_index is not None}, parts, sync)


@functools.lru_cache(maxsize=4096)
def launch_plan(B: int, V: int, candidates: int, launch: tuple[int, int] | None, draws: bool,
                 device_index: Optional[int]) -> tuple[tuple[int, int], int, dict, dict]:
    """(grid, columns per split, the partials' layout, the kernel's compile-time flags) of a scan,
    computed once per shape (``device_index``: the CUDA device, -1 for the interpreter); the flags
    are shared: callers add to a copy."""
    # At least 2: Triton 3.6's tl.topk fails to compile for k = 1.
    K = max(2, next_power_of_2(candidates)) if candidates else 0
    if device_index == -1:
        width = min(2048, next_power_of_2(V))  # the interpreter: one split, many rows per program
        block_b, block_v, splits = interpreter_block_rows(B, width), width, 1
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
    return (cdiv(B, block_b), splits), split_width, _partial_layout(B, splits, K, draws), meta
