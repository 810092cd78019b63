"""Launch arithmetic on Python ints for the wrappers' hot path (``triton.cdiv`` and
``triton.next_power_of_2`` cost ~5 µs a call from host code)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for ints, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# Triton 3.6's tl.cumsum lowering asserts on a table narrower than the per-thread vector of the
# kernel's 16-byte row loads (H100, V = 512-4096); padded columns hold no mass.
MIN_SCAN_WIDTH = 8


def scan_width(n: int) -> int:
    """Columns of a table that a kernel scans: ``n`` padded to a power of two >= MIN_SCAN_WIDTH."""
    return max(MIN_SCAN_WIDTH, next_power_of_2(n))
