"""Launch arithmetic on Python ints for the wrappers' hot path (``triton.cdiv`` and
``triton.next_power_of_2`` cost ~5 µs a call from host code), and the host's side of the kernels'
conventions; no Triton import, so the decoding step reads them before any kernel module loads."""

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


# The flags' "no row": the kernels atomic_min flagged rows into a pair, and a pair that collects several
# calls' rows (a deferred DecodingStep's, or a captured step's replays) starts here.
NO_ROW = 2**31 - 1
