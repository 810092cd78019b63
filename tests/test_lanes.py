"""nmst_fast/kernels/lanes.py: the per-lane fold's maxima and runners-up against a plain per-lane sort.

The candidate scans trust each lane's kept values and its pushed-out bound (``keep_runners_up``): a
value kept out of order or a bound too high only costs re-reads, never a wrong list, so the end-to-end
candidate tests cannot see it. This checks the fold itself, with ties, −inf runs and a partial tile.
"""

import pytest
import torch
import triton
import triton.language as tl

from nmst_fast.kernels import lanes

from helpers import DEVICE


@triton.jit
def _fold_kernel(z_ptr, V, out_val_ptr, out_col_ptr, pushed_ptr, DEPTH: tl.constexpr, BLOCK_V: tl.constexpr):
    # One row; per lane: its kept values (max, then the runners-up) and their columns, and the pushed-out value.
    ptrs = lanes.lane_pointers(z_ptr, V, tl.arange(0, 1), 1, 1, BLOCK_V)
    lane_max, _sum, lane_start, runners = lanes.fold_row_lanes(ptrs, 0, V, -1, -1.4426950408889634, True, DEPTH,
                                                               False, False, 1, BLOCK_V)
    second, second_start, third, third_start, pushed_out = runners
    index = tl.arange(0, BLOCK_V)[None, :]
    tl.store(out_val_ptr + index, lane_max)
    tl.store(out_col_ptr + index, lane_start + index)
    tl.store(out_val_ptr + BLOCK_V + index, second)
    tl.store(out_col_ptr + BLOCK_V + index, second_start + index)
    tl.store(out_val_ptr + 2 * BLOCK_V + index, third)
    tl.store(out_col_ptr + 2 * BLOCK_V + index, third_start + index)
    tl.store(pushed_ptr + index, pushed_out)


def _reference(z: torch.Tensor, depth: int, block_v: int):
    """Per lane: its values sorted by (value desc, column asc); the first ``depth`` finite ones with their
    columns (−inf beyond), and the largest value after them (−inf if none)."""
    values = torch.full((3, block_v), float("-inf"))
    cols = torch.full((3, block_v), -1)
    pushed = torch.full((block_v,), float("-inf"))
    for lane in range(block_v):
        lane_cols = torch.arange(lane, z.shape[0], block_v)
        ranked = sorted(((float(z[c]), int(c)) for c in lane_cols), key=lambda vc: (-vc[0], vc[1]))
        ranked = [vc for vc in ranked if vc[0] > float("-inf")]
        for rank, (value, col) in enumerate(ranked[:depth]):
            values[rank, lane], cols[rank, lane] = value, col
        if len(ranked) > depth:
            pushed[lane] = ranked[depth][0]
    return values, cols, pushed


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("block_v", [8, 32])
def test_runners_up_are_each_lanes_best_in_rank_order(depth, block_v):
    """Each lane keeps its ``depth`` largest values in (value desc, column asc) order with their columns,
    and the pushed-out value is the largest of the rest: fresh random rows with heavy ties, a run of
    −inf, a new maximum late in the row (it pushes every rank down) and a partial last tile."""
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    for _ in range(6):  # a few rows: each lane case (a value between two kept ranks, ...) is common, not certain
        V = block_v * int(torch.randint(3, 12, (1,), generator=gen)) + int(torch.randint(1, block_v, (1,),
                                                                                           generator=gen))
        z = (torch.randn(V, generator=gen) * 2).round()  # ties within lanes
        z[torch.rand(V, generator=gen) < 0.15] = float("-inf")
        z[-block_v:] += 6.0  # late maxima
        out_val = torch.empty(3 * block_v, device=DEVICE)
        out_col = torch.empty(3 * block_v, dtype=torch.int32, device=DEVICE)
        pushed = torch.empty(block_v, device=DEVICE)
        _fold_kernel[(1,)](z.to(DEVICE), V, out_val, out_col, pushed, DEPTH=depth, BLOCK_V=block_v)
        values, cols, expected_pushed = _reference(z, depth, block_v)
        got_val = out_val.cpu().view(3, block_v)[:depth]
        got_col = out_col.cpu().view(3, block_v)[:depth].long()
        assert torch.equal(got_val, values[:depth]), seed
        finite = values[:depth] > float("-inf")
        assert torch.equal(got_col[finite], cols[:depth][finite]), seed
        assert torch.equal(pushed.cpu(), expected_pushed), seed
