"""Which optional kernel backends this environment can run."""

from __future__ import annotations

import functools


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package imports (kernels then run on CUDA, or on CPU in its interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def cpu_has_fp16_arithmetic() -> bool:
    """Whether this CPU multiplies float16 natively (AVX512-FP16 or AMX-FP16): oneDNN's fp16 GEMMs then run
    at least at fp32's rate. Without either they emulate fp16 about 100x slower than bf16 (AVX-512, AVX2)."""
    import torch

    get = getattr(torch.cpu, "get_capabilities", None)
    if get is None:
        return False
    capabilities = get()
    return bool(capabilities.get("avx512_fp16") or capabilities.get("amx_fp16"))


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (oneDNN's bf16 GEMMs then run on them: about 5x fp32's rate)."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())
