"""nmst_fast/kernels/reductions.py: the GPU's one-reduction forms against the interpreter's separate reductions.

The kernels run the separate form in the interpreter (a tuple reduction there is a Python loop per
element), so these tests are what checks the fused form and its combine functions: both forms on small
random inputs with the edge cases (zero weights, rows with none, targets below 0 and past the total,
a tie for the lowest key), in two and three dimensions, equal to each other and to a plain reference.
"""

import pytest
import torch
import triton
import triton.language as tl

from nmst_fast.kernels import reductions

from helpers import DEVICE


@triton.jit
def _crossing_kernel(w_ptr, target_ptr, pick_ptr, before_ptr, col_ptr, R: tl.constexpr, C: tl.constexpr,
                     N: tl.constexpr, FUSED: tl.constexpr):
    # (R, C, N) weights: the row draw's (rows, candidates, columns) form; C = 1 is the (rows, lanes) one.
    r = tl.arange(0, R)[:, None, None]
    c = tl.arange(0, C)[None, :, None]
    index = tl.arange(0, N)[None, None, :]
    w = tl.load(w_ptr + (r * C + c) * N + index)
    out = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    target = tl.load(target_ptr + out)
    cum = tl.cumsum(w, axis=2)
    columns = index * 3 + 1  # an int payload, as the draws' columns
    pick, before = reductions.crossing_with(cum, w, target, index, N, cum - w, float("-inf"), FUSED)
    _, col = reductions.crossing_with(cum, w, target, index, N, columns, -1, FUSED)
    tl.store(pick_ptr + out, pick)
    tl.store(before_ptr + out, before)
    tl.store(col_ptr + out, col)


def _crossing(w: torch.Tensor, target: torch.Tensor, fused: bool):
    R, C, N = w.shape
    pick = torch.empty(R, C, dtype=torch.int32, device=DEVICE)
    before = torch.empty(R, C, dtype=torch.float64, device=DEVICE)
    col = torch.empty(R, C, dtype=torch.int32, device=DEVICE)
    _crossing_kernel[(1,)](w.to(DEVICE), target.to(DEVICE), pick, before, col, R=R, C=C, N=N, FUSED=fused)
    return pick.cpu(), before.cpu(), col.cpu()


def _crossing_reference(w: torch.Tensor, target: torch.Tensor):
    cum = w.cumsum(-1)
    positive = w > 0
    index = torch.arange(w.shape[-1]).expand_as(w)
    first = torch.where((cum > target[..., None]) & positive, index, w.shape[-1]).amin(-1)
    last = torch.where(positive, index, -1).amax(-1)
    return torch.where(first < w.shape[-1], first, last)


@pytest.mark.parametrize("shape", [(8, 1, 16), (2, 4, 8)])
def test_crossing_forms_agree(shape):
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(shape, generator=gen, dtype=torch.float64)
    w[torch.rand(shape, generator=gen) < 0.4] = 0.0
    w[0, 0] = 0.0  # a row with no positive weight: pick -1, payloads "none"
    total = w.sum(-1)
    target = total * (torch.rand(shape[:2], generator=gen, dtype=torch.float64) * 1.3 - 0.1)
    fused, separate = _crossing(w, target, True), _crossing(w, target, False)
    for got_fused, got_separate in zip(fused, separate):
        assert torch.equal(got_fused, got_separate), f"seed={seed}"
    pick, before, col = fused
    assert torch.equal(pick.long(), _crossing_reference(w, target)), f"seed={seed}"
    cum_before = (w.cumsum(-1) - w).gather(-1, pick.clamp(min=0).long()[..., None])[..., 0]
    assert torch.equal(before, torch.where(pick >= 0, cum_before, float("-inf")))
    assert torch.equal(col, torch.where(pick >= 0, pick * 3 + 1, -1))
    assert int(pick[0, 0]) == -1



def test_crossing_picks_only_positive_weights():
    """The inverse-CDF step of every draw picks a positive weight, in both forms: a zero weight after
    the crossing can read above the target on a GPU (its scan is not monotone to the last ulp), a
    negative target (rounding below the CDF's start) must not pick the leading zero weights, and
    rounding past the total takes the last positive weight."""
    weights = torch.tensor([0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 0.5, 0.0], dtype=torch.float64)
    w = weights.repeat(8, 1, 1)
    w[5] = 0.0  # nothing to draw: -1, which the callers treat as no token
    target = torch.tensor([-1e-30, 0.5, 1.0, 3.2, 3.5, 0.0, 0.0, 2.9], dtype=torch.float64)[:, None]
    for fused in (True, False):
        pick, before, _ = _crossing(w, target, fused)
        assert pick[:, 0].tolist() == [2, 2, 3, 6, 6, -1, 2, 3], fused
        assert before[:, 0].tolist() == [0.0, 0.0, 1.0, 3.0, 3.0, float("-inf"), 0.0, 1.0], fused


@triton.jit
def _pair_sums_kernel(key_ptr, a_ptr, b_ptr, min_ptr, sums_ptr, R: tl.constexpr, C: tl.constexpr, FUSED: tl.constexpr):
    at = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    key = tl.load(key_ptr + at)
    a = tl.load(a_ptr + at)
    b = tl.load(b_ptr + at)
    if FUSED:
        total_a, total_b = tl.reduce((a, b), 1, reductions.add_pair)
        _, min_key = tl.reduce((b, key), 1, reductions.add_and_min)
    else:  # the kernels' interpreted form
        total_a, total_b = tl.sum(a, axis=1), tl.sum(b, axis=1)
        min_key = tl.min(key, axis=1)
    rows = tl.arange(0, R)
    tl.store(sums_ptr + rows * 2, total_a)
    tl.store(sums_ptr + rows * 2 + 1, total_b.to(tl.float64))
    tl.store(min_ptr + rows, min_key)


def test_pair_sums_agree():
    """The bounds' two sums, and a sum with a min (the scan's split mass and first index of its max),
    fused and as the interpreted kernels take them."""
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    R, C = 8, 4
    key = torch.stack([torch.randperm(C, generator=gen) for _ in range(R)]).to(torch.int32)
    a = torch.randint(0, 1000, (R, C), generator=gen, dtype=torch.int32)
    b = torch.randn(R, C, generator=gen, dtype=torch.float64)
    for fused in (True, False):
        lowest = torch.empty(R, dtype=torch.int32, device=DEVICE)
        sums = torch.empty(R, 2, dtype=torch.float64, device=DEVICE)
        _pair_sums_kernel[(1,)](key.to(DEVICE), a.to(DEVICE), b.to(DEVICE), lowest, sums, R=R, C=C, FUSED=fused)
        assert torch.equal(lowest.cpu(), key.min(dim=1).values), f"seed={seed}"
        torch.testing.assert_close(sums.cpu(), torch.stack([a.double().sum(1), b.sum(1)], dim=1), rtol=1e-12,
                                   atol=1e-12)


@triton.jit
def _max_index_kernel(v_ptr, top_ptr, col_ptr, R: tl.constexpr, N: tl.constexpr, FUSED: tl.constexpr):
    at = tl.arange(0, R)[:, None] * N + tl.arange(0, N)[None, :]
    v = tl.load(v_ptr + at)
    index = tl.where(v > float("-inf"), tl.arange(0, N)[None, :] * 7, 2147483647)  # −inf: padding
    if FUSED:
        top, col = tl.reduce((v, index), 1, reductions.larger_then_lower)
    else:  # the kernels' interpreted form
        top = tl.max(v, axis=1)
        col = tl.min(tl.where(v == top[:, None], index, 2147483647), axis=1)
    tl.store(top_ptr + tl.arange(0, R), top)
    tl.store(col_ptr + tl.arange(0, R), col)


def test_max_and_lowest_index_forms_agree():
    """The top-k extraction's pick: the largest value, ties to the lowest index; padding (−inf at an
    index past every real one) only where a row has nothing else."""
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    R, N = 8, 16
    v = torch.randint(-3, 3, (R, N), generator=gen).float()  # many ties
    v[torch.rand(R, N, generator=gen) < 0.3] = float("-inf")
    v[0] = float("-inf")
    got = {}
    for fused in (True, False):
        top = torch.empty(R, dtype=torch.float32, device=DEVICE)
        col = torch.empty(R, dtype=torch.int32, device=DEVICE)
        _max_index_kernel[(1,)](v.to(DEVICE), top, col, R=R, N=N, FUSED=fused)
        got[fused] = (top.cpu(), col.cpu())
    expected_top = v.amax(dim=1)
    first = torch.where(v == expected_top[:, None], torch.arange(N) * 7, 2**31 - 1).amin(dim=1)
    expected_col = torch.where(expected_top > float("-inf"), first, 2**31 - 1).to(torch.int32)
    for fused in (True, False):
        assert torch.equal(got[fused][0], expected_top) and torch.equal(got[fused][1], expected_col), f"seed={seed}"


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
