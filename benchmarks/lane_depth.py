"""How often a candidate scan re-reads its split, by the number of values each lane keeps.

    python -m benchmarks.lane_depth        # B in {256, 32}, V = 50257, K = 4 … 128, depths 1-4

A candidate scan (``nmst_fast/kernels/row_scan.py``) keeps each lane's DEPTH largest values and
the largest one it dropped; a split is read again when a dropped value may rank among its K best,
that is when some lane holds more than DEPTH of them. This counts those splits exactly as the kernel
decides (kept values' K-th against the largest dropped value) on the GPU's launch layout
(``row_scan.cuda_launch_shape``, an H100's 132 SMs), from per-lane sorts in torch: no GPU needed.
Which columns hold a row's K best is what matters, so i.i.d. rows (N(0, 3²)) stand for any logits
whose best tokens lie at unrelated ids.
"""

from __future__ import annotations

import argparse

import torch

from nmst_fast.kernels.row_scan import cuda_launch_shape, split_layout


def reread_fraction(logits: torch.Tensor, K: int, depth: int, batch: int, multi_processors: int = 132) -> float:
    """The share of (row, split) programs that re-read their split, for ``logits`` (R, V) laid out as
    a batch of ``batch`` rows would be, with lists of ``K`` (a power of two) and ``depth`` kept values."""
    rows, V = logits.shape
    _, block_v, splits = cuda_launch_shape(batch, V, K, multi_processors)
    width, splits = split_layout(V, block_v, splits)
    rereads = 0
    for split in range(splits):
        part = logits[:, split * width:(split + 1) * width]
        tiles = -(-part.shape[1] // block_v)
        lanes = torch.full((rows, tiles * block_v), float("-inf"), dtype=logits.dtype)
        lanes[:, :part.shape[1]] = part
        if tiles <= depth:  # every value kept
            continue
        ranked = lanes.view(rows, tiles, block_v).sort(dim=1, descending=True).values  # each lane, best first
        kth = ranked[:, :depth].reshape(rows, -1).topk(K, dim=1).values[:, -1]
        dropped = ranked[:, depth].amax(dim=1)
        rereads += int(((dropped > float("-inf")) & ~(dropped < kth)).sum())
    return rereads / (rows * splits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 32])
    parser.add_argument("--rows", type=int, default=256, help="rows drawn per case")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    logits = torch.randn(args.rows, args.vocab, generator=gen) * 3
    depths = (1, 2, 3, 4)
    print(f"Splits re-read by a candidate scan, V = {args.vocab}, {args.rows} rows ~ N(0, 3²), seed {args.seed}")
    print("| B | K | splits | " + " | ".join(f"depth {d}" for d in depths) + " |")
    print("|---:|---:|---:|" + "---:|" * len(depths))
    for batch in args.batches:
        for K in (4, 8, 16, 32, 64, 128):
            _, block_v, splits = cuda_launch_shape(batch, args.vocab, K, 132)
            splits = split_layout(args.vocab, block_v, splits)[1]
            shares = [reread_fraction(logits, K, depth, batch) for depth in depths]
            print(f"| {batch} | {K} | {splits} | " + " | ".join(f"{share:.2%}" for share in shares) + " |")


if __name__ == "__main__":
    main()
