"""Triton's tl.sort and tl.xor_sum as the CPU tests run them (tests/conftest.py hands the interpreter's
xor reductions to numpy)."""

import torch
import triton
import triton.language as tl

from helpers import DEVICE


@triton.jit
def _sort_kernel(x_ptr, sorted_ptr, xor_ptr, R: tl.constexpr, N: tl.constexpr):
    offsets = tl.arange(0, R)[:, None] * N + tl.arange(0, N)[None, :]
    x = tl.load(x_ptr + offsets)
    tl.store(sorted_ptr + offsets, tl.sort(x, dim=1, descending=True))
    tl.store(xor_ptr + tl.arange(0, R), tl.xor_sum(x, axis=1))


def test_sort_and_xor_sum_are_exact_on_int64_keys():
    """tl.sort (the candidate lists' ranking, int64 keys) and tl.xor_sum, on which its swaps rest, give
    numpy's order and bits, negatives and ties included (the CPU tests take numpy's xor reduction
    for the interpreter's element-by-element one: tests/conftest.py)."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randint(-(2**62), 2**62, (4, 64), generator=gen, dtype=torch.int64)
    x[0, :32] = x[0, 32:]  # ties
    x[1] = torch.randint(-3, 3, (64,), generator=gen)
    x = x.to(DEVICE)
    out, xor = torch.empty_like(x), torch.empty(4, dtype=torch.int64, device=DEVICE)
    _sort_kernel[(1,)](x, out, xor, R=4, N=64)
    expected = torch.sort(x.cpu(), dim=1, descending=True).values
    assert torch.equal(out.cpu(), expected)
    for row in range(4):
        bits = 0
        for value in x[row].tolist():
            bits ^= value
        assert xor[row].item() == bits
