"""``step_common.crossing_with``, the decoding kernels' inverse-CDF pick against a plain reference, on small
random inputs with the edge cases (zero weights, rows with none, targets below 0 and past the total),
in two and three dimensions.
"""

import pytest
import torch
import triton
import triton.language as tl

from nmst_fast.kernels.step_common import crossing_with

from helpers import DEVICE


@triton.jit
def _crossing_kernel(w_ptr, target_ptr, pick_ptr, before_ptr, col_ptr, R: tl.constexpr, C: tl.constexpr,
                     N: tl.constexpr):
    # (R, C, N) weights: the row draw's (rows, candidates, columns) form; C = 1 is the (rows, lanes) one.
    r = tl.arange(0, R)[:, None, None]
    c = tl.arange(0, C)[None, :, None]
    index = tl.arange(0, N)[None, None, :]
    w = tl.load(w_ptr + (r * C + c) * N + index)
    out = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    target = tl.load(target_ptr + out)
    cum = tl.cumsum(w, axis=2)
    columns = index * 3 + 1  # an int payload, as the draws' columns
    pick, before = crossing_with(cum, w, target, index, N, cum - w, float("-inf"))
    _, col = crossing_with(cum, w, target, index, N, columns, -1)
    tl.store(pick_ptr + out, pick)
    tl.store(before_ptr + out, before)
    tl.store(col_ptr + out, col)


def _crossing(w: torch.Tensor, target: torch.Tensor):
    R, C, N = w.shape
    pick = torch.empty(R, C, dtype=torch.int32, device=DEVICE)
    before = torch.empty(R, C, dtype=torch.float64, device=DEVICE)
    col = torch.empty(R, C, dtype=torch.int32, device=DEVICE)
    _crossing_kernel[(1,)](w.to(DEVICE), target.to(DEVICE), pick, before, col, R=R, C=C, N=N)
    return pick.cpu(), before.cpu(), col.cpu()


def _crossing_reference(w: torch.Tensor, target: torch.Tensor):
    cum = w.cumsum(-1)
    positive = w > 0
    index = torch.arange(w.shape[-1]).expand_as(w)
    first = torch.where((cum > target[..., None]) & positive, index, w.shape[-1]).amin(-1)
    last = torch.where(positive, index, -1).amax(-1)
    return torch.where(first < w.shape[-1], first, last)


@pytest.mark.parametrize("shape", [(8, 1, 16), (2, 4, 8)])
def test_crossing_matches_the_reference(shape):
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(shape, generator=gen, dtype=torch.float64)
    w[torch.rand(shape, generator=gen) < 0.4] = 0.0
    w[0, 0] = 0.0  # a row with no positive weight: pick -1, payloads "none"
    total = w.sum(-1)
    target = total * (torch.rand(shape[:2], generator=gen, dtype=torch.float64) * 1.3 - 0.1)
    pick, before, col = _crossing(w, target)
    assert torch.equal(pick.long(), _crossing_reference(w, target)), f"seed={seed}"
    cum_before = (w.cumsum(-1) - w).gather(-1, pick.clamp(min=0).long()[..., None])[..., 0]
    assert torch.equal(before, torch.where(pick >= 0, cum_before, float("-inf")))
    assert torch.equal(col, torch.where(pick >= 0, pick * 3 + 1, -1))
    assert int(pick[0, 0]) == -1



def test_crossing_picks_only_positive_weights():
    """The inverse-CDF step of every draw picks a positive weight: a zero weight after
    the crossing can read above the target on a GPU (its scan is not monotone to the last ulp), a
    negative target (rounding below the CDF's start) must not pick the leading zero weights, and
    rounding past the total takes the last positive weight."""
    weights = torch.tensor([0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 0.5, 0.0], dtype=torch.float64)
    w = weights.repeat(8, 1, 1)
    w[5] = 0.0  # nothing to draw: -1, which the callers treat as no token
    target = torch.tensor([-1e-30, 0.5, 1.0, 3.2, 3.5, 0.0, 0.0, 2.9], dtype=torch.float64)[:, None]
    pick, before, _ = _crossing(w, target)
    assert pick[:, 0].tolist() == [2, 2, 3, 6, 6, -1, 2, 3]
    assert before[:, 0].tolist() == [0.0, 0.0, 1.0, 3.0, 3.0, float("-inf"), 0.0, 1.0]
