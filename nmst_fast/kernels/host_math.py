"""Launch arithmetic on Python ints, for the wrappers' hot path.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions: called from host code they
still unwrap every argument, ~5 µs a call (Triton 3.6 and 3.9, this CPU). A decoding step computed
about ten of them, ~50 µs of the per-step host time that small batches pay on a GPU. These are
the same integers for n >= 1.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for ints, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# Triton 3.6's scan lowering (tl.cumsum) asserts when a table to scan is narrower than the
# per-thread vector its layout inherits from the kernel's 16-byte-aligned row loads (on an H100:
# per-tile tables of 1-2 tiles at V = 512-4096, and one-split tables; Triton 3.9
# compiles them). Padded columns hold no mass.
MIN_SCAN_WIDTH = 8


def scan_width(n: int) -> int:
    """Columns of a table that a kernel scans: ``n`` padded to a power of two >= MIN_SCAN_WIDTH."""
    return max(MIN_SCAN_WIDTH, next_power_of_2(n))
