"""Split-softmax row kernels: the V-wide part shared by the VA, ST and NMST heads.

One program handles one row and walks V in BLOCK_V tiles, so any V works
(not only multiples of the block) and no row has to fit in registers.
Arithmetic is fp32 whatever the storage dtype (bf16/fp16/fp32).

* ``split_lse``: L = logsumexp over non-eos columns (online max/sum) and z_target; L is NaN on a row where
  any non-eos logit (before a cap) is NaN or infinite (the fused loss's data check).
* ``split_statistics``: with L known, the sums the head's per-token statistics need (Σ e^(z−L)·z, Σ e^(2(z−L)),
  Σ z over the non-eos columns) and the non-eos max and its first column, in one read.
* ``split_softmax_grad_``: overwrite the row with its logit gradient
  dz_v = coef · exp(z_v − L) (v ≠ eos), dz_eos = grad_eos, plus grad_target at the target.

With ``softcap`` c (the SOFTCAP constexpr) both kernels read the row's raw logits x and work on
y = c · tanh(x / c) (Gemma 2/3's final logit softcapping): L, z_target and the gradient are the
capped logits', and the grad kernel multiplies each finished column gradient (eos and target
entries included) by dy/dx = 1 − tanh² = sech²(x / c).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .host_math import next_power_of_2


@triton.jit
def _softcap(x, softcap):
    """(c · tanh(x / c), sech²(x / c)) in fp32 for x fp32, accurate to a few ulps at any |x| (no
    overflow: only e^(−2|u|) ≤ 1 is formed; NaN stays NaN). Small |u| take tanh's odd series, where
    1 − e^(−2|u|) would cancel."""
    u = x / softcap
    a = tl.abs(u)
    e = tl.exp(-2.0 * a)
    us = tl.where(a < 0.25, u, 0.0)  # the series' argument: no overflow in u² where it goes unused
    u2 = us * us
    series = us * (1.0 + u2 * (-1.0 / 3.0 + u2 * (2.0 / 15.0 + u2 * (-17.0 / 315.0 + u2 * (62.0 / 2835.0)))))
    t = tl.where(a < 0.25, series, tl.where(u < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e))
    return softcap * t, 4.0 * e / ((1.0 + e) * (1.0 + e))


@triton.jit
def _split_lse_kernel(
    z_ptr,
    z_row_stride,
    targets_ptr,
    lse_ptr,
    z_target_ptr,
    V,
    eos_index,
    softcap,
    BLOCK_V: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_row_stride
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.full((), 0.0, tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        keep = (cols < V) & (cols != eos_index)
        x = tl.load(z_row + cols, mask=keep, other=float("-inf")).to(tl.float32)
        # x − x of the raw logits joins the sum: 0 while every one is finite, NaN (and L with it) from the first
        # NaN or infinite one on, a cap or not
        raw = tl.where(keep, x - x, 0.0)
        if SOFTCAP:
            x = tl.where(keep, _softcap(x, softcap)[0], float("-inf"))  # masked columns stay -inf, not -c
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        # A tile holding only eos/out-of-range columns leaves the max at -inf; shift by 0 then,
        # since exp(-inf - -inf) would be NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(x - shift) + raw, axis=0)
        running_max = new_max
    # L in float64 from the fp32 (max, sum): rounding m + log(sum) to fp32 cost ulp(|L|) (1e-3 at
    # |L| = 1e4) in the loss L − z_target; this keeps it at the sum's own ~1e-7.
    tl.store(lse_ptr + row, running_max.to(tl.float64) + tl.log(running_sum.to(tl.float64)))
    target = tl.load(targets_ptr + row)
    z_target = tl.load(z_row + target).to(tl.float32)
    if SOFTCAP:
        z_target = _softcap(z_target, softcap)[0]
    tl.store(z_target_ptr + row, z_target)


@triton.jit
def _split_statistics_kernel(
    z_ptr,
    z_row_stride,
    shift_ptr,
    out_ptr,
    V,
    eos_index,
    softcap,
    BLOCK_V: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_row_stride
    shift = tl.load(shift_ptr + row)
    shift = tl.where(shift == shift, shift, 0.0)  # a NaN row's sums are NaN anyway
    weighted = tl.full((), 0.0, tl.float32)
    squares = tl.full((), 0.0, tl.float32)
    total = tl.full((), 0.0, tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    top_column = tl.full((), -1, tl.int64)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        keep = (cols < V) & (cols != eos_index)
        x = tl.load(z_row + cols, mask=keep, other=0.0).to(tl.float32)
        if SOFTCAP:
            x = _softcap(x, softcap)[0]
        e = tl.where(keep, tl.exp(x - shift), 0.0)
        weighted += tl.sum(e * tl.where(keep, x, 0.0), axis=0)
        squares += tl.sum(e * e, axis=0)
        total += tl.sum(tl.where(keep, x, 0.0), axis=0)
        masked = tl.where(keep, x, float("-inf"))
        tile_best = tl.max(masked, axis=0)
        # the tile's first column of its max (the smallest index among ties)
        tile_where = tl.min(tl.where((masked == tile_best) & keep, cols, V), axis=0).to(tl.int64)
        higher = tile_best > best
        top_column = tl.where(higher, tile_where, top_column)
        best = tl.where(higher, tile_best, best)
    tl.store(out_ptr + row * 5 + 0, weighted.to(tl.float64))
    tl.store(out_ptr + row * 5 + 1, squares.to(tl.float64))
    tl.store(out_ptr + row * 5 + 2, total.to(tl.float64))
    tl.store(out_ptr + row * 5 + 3, best.to(tl.float64))
    tl.store(out_ptr + row * 5 + 4, top_column.to(tl.float64))


@triton.jit
def _split_softmax_grad_kernel(
    z_ptr,
    z_row_stride,
    targets_ptr,
    lse_ptr,
    coef_ptr,
    grad_eos_ptr,
    grad_target_ptr,
    V,
    eos_index,
    softcap,
    BLOCK_V: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_row_stride
    lse = tl.load(lse_ptr + row)
    coef = tl.load(coef_ptr + row)
    grad_eos = tl.load(grad_eos_ptr + row)
    grad_target = tl.load(grad_target_ptr + row)
    target = tl.load(targets_ptr + row)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_range = cols < V
        x = tl.load(z_row + cols, mask=in_range, other=0.0).to(tl.float32)
        if SOFTCAP:
            x, dy_dx = _softcap(x, softcap)
        g = coef * tl.exp(x - lse)
        g = tl.where(cols == eos_index, grad_eos, g)
        g = tl.where(cols == target, g + grad_target, g)
        if SOFTCAP:
            g = g * dy_dx  # the chain rule through the cap, on the finished column gradient
        tl.store(z_row + cols, g.to(z_ptr.dtype.element_ty), mask=in_range)


# Launch shape per kernel: (BLOCK_V cap, num_warps), from a sweep over a (2048, 256000) bf16
# chunk on an H200 (benchmarks/profile_loss.py): the read-only LSE pass peaks with 4 warps,
# the read+write gradient pass with 16. Benchmarks override these to sweep tilings.
LAUNCH = {"lse": (4096, 4), "statistics": (4096, 4), "grad": (4096, 16)}


def _launch_args(kernel: str, V: int, softcap) -> dict:
    block_v, num_warps = LAUNCH[kernel]
    return {"BLOCK_V": min(block_v, next_power_of_2(V)), "num_warps": num_warps, "SOFTCAP": softcap is not None}


def _check_softcap(softcap) -> float:
    """The cap as the kernels' runtime float (1.0, unused, without one)."""
    if softcap is None:
        return 1.0
    if not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap!r}")
    return float(softcap)


def _check_rows(z: torch.Tensor, targets: torch.Tensor) -> None:
    if z.dim() != 2 or z.stride(1) != 1:
        raise ValueError("z must be a 2-D tensor with unit stride along V")
    if targets.shape != (z.shape[0],):
        raise ValueError(f"targets must have shape ({z.shape[0]},), got {tuple(targets.shape)}")


def split_lse(
    z: torch.Tensor, targets: torch.Tensor, eos_index: int, softcap: Optional[float] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row logsumexp over non-eos columns and the target logit.

    Args:
        z: (rows, V) logits, fp16/bf16/fp32, unit stride along V.
        targets: (rows,) int64 in [0, V) (callers clamp ignored targets).
        eos_index: column excluded from the logsumexp (-1: none, a vocabulary shard without eos).
        softcap: c > 0 or None: work on c · tanh(z / c) (z itself is only read).
    Returns:
        (lse float64, z_target float32), each (rows,).
    """
    _check_rows(z, targets)
    rows, V = z.shape
    lse = torch.empty(rows, device=z.device, dtype=torch.float64)
    z_target = torch.empty(rows, device=z.device, dtype=torch.float32)
    if rows:
        _split_lse_kernel[(rows,)](z, z.stride(0), targets, lse, z_target, V, eos_index, _check_softcap(softcap),
                                   **_launch_args("lse", V, softcap))
    return lse, z_target


def split_statistics(z: torch.Tensor, shift: torch.Tensor, eos_index: int,
                     softcap: Optional[float] = None) -> torch.Tensor:
    """Per row of ``z`` (rows, V) over its non-eos columns y (capped with ``softcap``): (rows, 5) float64 of
    Σ e^(y − m)·y, Σ e^(2(y − m)), Σ y, max y and its first column, m = ``shift`` (rows,) as float32 (the row's L:
    the caller corrects the first two for its rounding)."""
    if z.dim() != 2 or z.stride(1) != 1:
        raise ValueError("z must be a 2-D tensor with unit stride along V")
    rows, V = z.shape
    out = torch.empty(rows, 5, device=z.device, dtype=torch.float64)
    if rows:
        _split_statistics_kernel[(rows,)](z, z.stride(0), shift.float().contiguous(), out, V, eos_index,
                                          _check_softcap(softcap), **_launch_args("statistics", V, softcap))
    return out


def split_softmax_grad_(
    z: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    coef: torch.Tensor,
    grad_eos: torch.Tensor,
    grad_target: torch.Tensor,
    eos_index: int,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Overwrite ``z`` (rows, V) with its logit gradient; every other argument is (rows,) float32
    (``lse`` may come as :func:`split_lse` gives it, float64: the kernel takes it in fp32).

    With ``softcap`` c, ``z`` holds raw logits x, ``lse`` / ``coef`` / ``grad_*`` are those of the
    capped y = c · tanh(x / c), and ``z`` becomes the gradient with respect to x."""
    _check_rows(z, targets)
    rows, V = z.shape
    if rows:
        _split_softmax_grad_kernel[(rows,)](
            z, z.stride(0), targets, lse.float(), coef, grad_eos, grad_target, V, eos_index, _check_softcap(softcap),
            **_launch_args("grad", V, softcap),
        )
    return z
