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
