"""Scale a gradient accumulator by a device scalar and store it in the parameter's dtype, in one pass.

The fused loss forms dW (and db) in its forward pass, summed over chunks in fp32 for
bf16/fp16 weights. Backward must still multiply by the upstream gradient, which is only
known then. Casting in the forward and scaling in the backward would cost two passes over
the V×H gradient (fp32 read + bf16 write, then bf16 read + write); this kernel does both at
once (fp32 read + bf16 write), rounds once instead of twice, and reads the scale from
device memory, so backward needs no host sync to know it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_math import cdiv

_BLOCK = 4096  # elements per program: 16 per thread at 8 warps, wide enough to stream at bandwidth


@triton.jit
def _scale_cast_kernel(src_ptr, scale_ptr, dst_ptr, n, TO_BF16: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    scale = tl.load(scale_ptr).to(tl.float32)
    y = tl.load(src_ptr + offsets, mask=inside).to(tl.float32) * scale
    if TO_BF16:
        # Round to nearest even on the 16 bits bf16 drops, by integer arithmetic: what torch and
        # the GPU's cvt.rn do, spelled out because Triton's interpreter truncates fp32 -> bf16.
        bits = y.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(y != y, 0x7FC0, rounded)  # NaN stays a (quiet) NaN
        tl.store(dst_ptr + offsets, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=inside)
    else:
        tl.store(dst_ptr + offsets, y.to(dst_ptr.dtype.element_ty), mask=inside)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def scale_cast(src: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(src * scale).to(dtype)`` in one pass, the product in fp32.

    Args:
        src: contiguous fp32 / bf16 / fp16 tensor of any shape (a gradient accumulator, or the
            loss's dh in the input dtype: scaled in fp32, so a scale like 1/N is never rounded to
            16 bits first, and with no fp32 copy of it).
        scale: one-element tensor on ``src``'s device, any float dtype.
        dtype: the output dtype (fp32, bf16 or fp16), rounded to nearest even.
    Returns:
        A new contiguous tensor shaped like ``src``.
    """
    if src.dtype not in _DTYPES or dtype not in _DTYPES:
        raise TypeError(f"scale_cast maps fp32/bf16/fp16 to fp32/bf16/fp16, got {src.dtype} -> {dtype}")
    if not src.is_contiguous():
        raise ValueError("scale_cast needs a contiguous src")
    if scale.numel() != 1 or scale.device != src.device:
        raise ValueError(f"scale must be one element on {src.device}, got {tuple(scale.shape)} on {scale.device}")
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    n = src.numel()
    if n:
        _scale_cast_kernel[(cdiv(n, _BLOCK),)](src, scale, out, n, TO_BF16=dtype == torch.bfloat16,
                                               BLOCK=_BLOCK, num_warps=8)
    return out
