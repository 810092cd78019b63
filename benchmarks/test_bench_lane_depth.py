"""benchmarks/lane_depth.py: the re-read count on rows whose K best sit in known lanes."""

import torch

from benchmarks.lane_depth import reread_fraction
from nmst_fast.kernels.row_scan import cuda_launch_shape, split_layout

V, K, BATCH = 50257, 4, 256


def _rows_with_best_at(columns_per_row: list[list[int]]) -> torch.Tensor:
    logits = -torch.arange(V, dtype=torch.float32).repeat(len(columns_per_row), 1) * 1e-4  # distinct, falling
    for row, columns in zip(logits, columns_per_row):
        row[columns] = torch.linspace(10.0, 9.0, len(columns))
    return logits


def test_reread_fraction_counts_splits_whose_lanes_hold_more_than_depth_of_the_best():
    _, block_v, splits = cuda_launch_shape(BATCH, V, K, 132)
    width, splits = split_layout(V, block_v, splits)
    assert splits == 2 and width > 3 * block_v
    spread = [0, 1, 2, 3]  # four lanes of split 0: its lanes' maxima settle it
    two_in_lane_0 = [0, block_v, 2, 3]  # 2 values per lane settle split 0
    one_lane = [0, block_v, 2 * block_v, 3 * block_v]  # 4 values per lane settle split 0
    logits = _rows_with_best_at([spread, two_in_lane_0, one_lane])
    # 6 programs (3 rows x 2 splits); only split 0 of the last two rows can need more than the lanes keep.
    assert [reread_fraction(logits, K, depth, BATCH) for depth in (1, 2, 3, 4)] == [2 / 6, 1 / 6, 1 / 6, 0.0]
