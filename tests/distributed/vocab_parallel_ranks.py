"""Run under torchrun (gloo): the vocabulary-parallel loss equals one process's on the whole weight.

    torchrun --standalone --nproc_per_node 3 tests/distributed/vocab_parallel_ranks.py [--fail-rank R | --overlap |
                                                                                         --grad-filter]

Without flags, every rank checks the loss over the whole group, then ranks 0 and 1 again over a group of
the two of them.

Every rank builds the same random inputs, computes the single-process loss and gradients on the
whole weight (float64, chunked), then the vocab-parallel loss on its own uneven slice, and checks
loss, dh, and its slice of dW and db, for every head, reduction and backend, with eos and targets
on either side of the shard boundaries. ``--fail-rank R``: rank R's weight slice holds a NaN, which
must stop every rank with the same ValueError (none left waiting in a collective). ``--overlap``:
the last rank claims its neighbour's first row too, which every rank must refuse. ``--grad-filter``: the gradient
filter on shards of whole filter blocks (of a larger vocabulary, peaked rows) equals one process's filter, and it
skips blocks.
"""

import argparse
import os

import torch
import torch.distributed as dist

from benchmarks.grad_filter import peaked_rows
from nmst_fast import grad_filter, linear_nmst_loss, vocab_order
from train import distributed

V, H, B, T = 37, 8, 3, 7


def bounds(world: int) -> list[int]:
    """Uneven contiguous slices of [0, V): each larger than the last."""
    weights = list(range(1, world + 1))
    cuts = [0]
    for w in weights:
        cuts.append(cuts[-1] + max(2, V * w // sum(weights)))
    cuts[-1] = V
    return cuts


def inputs(seed: int, eos: int, cuts: list[int]):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, dtype=torch.float64, generator=gen)
    weight = torch.randn(V, H, dtype=torch.float64, generator=gen) * 2
    bias = torch.randn(V, dtype=torch.float64, generator=gen)
    targets = torch.randint(0, V, (B, T), generator=gen)
    edges = [c for c in cuts[1:-1]] + [c - 1 for c in cuts[1:-1]]
    targets[0, : len(edges)] = torch.tensor(edges)[:T]  # targets on both sides of every boundary
    targets[1, 2], targets[2, 5], targets[2, 0] = eos, eos, -100
    steps = torch.arange(1, T + 1).expand(B, T).clone()
    steps[1, :2] = 0  # context
    steps[2, 4:] = torch.arange(1, T - 3)  # a packed second sequence (ST restarts)
    return hidden, weight, bias, targets, steps


def check(rank: int, world: int, group) -> int:
    cuts = bounds(world)
    lo, hi = cuts[rank], cuts[rank + 1]
    cases = 0
    # Every (eos place, head) pair with both backends; the reductions run as a Latin square over those
    # pairs (each reduction meets every eos place and every head once): a reduction only weighs the
    # per-token losses and their gradients, after the collectives.
    for i, eos in enumerate((cuts[1] - 1, cuts[1], V - 1)):
        for j, head in enumerate(("nmst", "st", "va")):
            reduction = ("mean", "sum", "none")[(i + j) % 3]
            for impl in ("chunked", "triton"):
                dtype = torch.float64 if impl == "chunked" else torch.float32
                tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5)
                h, w, b, y, t = inputs(1000 * eos + cases, eos, cuts)
                args = dict(eos_index=eos, eps=0.05, head=head, steps=t, ignore_index=-100, reduction=reduction)
                full = [x.clone().to(dtype).requires_grad_() for x in (h, w, b)]
                want = linear_nmst_loss(full[0], full[1], y, bias=full[2], impl="chunked", chunk_size=5, **args)
                upstream = torch.linspace(0.5, 1.5, want.numel(), dtype=dtype).view(want.shape)
                (want * upstream).sum().backward()
                mine = [h.clone().to(dtype).requires_grad_(), w[lo:hi].clone().to(dtype).requires_grad_(),
                        b[lo:hi].clone().to(dtype).requires_grad_()]
                got = linear_nmst_loss(mine[0], mine[1], y, bias=mine[2], impl=impl, chunk_size=5,
                                       process_group=group, vocab_start=lo, **args)
                (got * upstream).sum().backward()
                where = f"rank {rank} eos {eos} {head} {reduction} {impl}"
                torch.testing.assert_close(got, want, **tol, msg=where)
                torch.testing.assert_close(mine[0].grad, full[0].grad, **tol, msg=f"dh {where}")
                torch.testing.assert_close(mine[1].grad, full[1].grad[lo:hi], **tol, msg=f"dW {where}")
                torch.testing.assert_close(mine[2].grad, full[2].grad[lo:hi], **tol, msg=f"db {where}")
                cases += 1
    return cases


def check_filtered(rank: int, world: int, group) -> tuple[int, float]:
    """The filtered loss's gradients on shards that start at multiples of the filter's block (so each shard's blocks
    are one process's) equal one process's, for every head and both backends, at two thresholds; returns the cases
    and the least kept share of a chunk's vocabulary this rank's filter recorded."""
    block = grad_filter.FILTER_BLOCK
    vocab = block * (world + 1) + 77  # shards of 1, 1, ..., 2 blocks and a partial one
    cuts = [block * r for r in range(world)] + [vocab]
    lo, hi = cuts[rank], cuts[rank + 1]
    cases, least = 0, 1.0
    for j, head in enumerate(("nmst", "st", "va")):
        eos = (block - 1, block, vocab - 1)[j]  # the last entry of a shard, the first of one, the last of all
        hidden, weight = peaked_rows(3 * 37, 24, vocab, gamma=2.0, seed=j)
        gen = torch.Generator().manual_seed(j)
        targets = torch.randint(0, vocab, (3, 37), generator=gen)
        targets[:, ::9], targets[1, 5] = eos, -100
        steps = torch.arange(1, 38).repeat(3, 1)
        for impl in ("chunked", "triton"):
            dtype = torch.float64 if impl == "chunked" else torch.float32
            # the filter's block sums and their corrections are float32 in every dtype, summed over the ranks
            tol = dict(rtol=1e-6, atol=1e-8) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5)
            for g in (1e-3, 0.3):
                args = dict(eos_index=eos, eps=0.05, head=head, steps=steps, grad_filter=g, impl=impl, chunk_size=32)
                h = hidden.view(3, 37, -1).to(dtype)
                full = [h.clone().requires_grad_(), weight.to(dtype).clone().requires_grad_()]
                with vocab_order.ids_kept():  # shards keep the ids' order (nmst_fast.vocab_order): one process's in it
                    want = linear_nmst_loss(full[0], full[1], targets, **args)
                    want.backward()
                mine = [h.clone().requires_grad_(), weight[lo:hi].to(dtype).clone().requires_grad_()]
                with grad_filter.recorded_kept_shares() as shares:
                    got = linear_nmst_loss(mine[0], mine[1], targets, process_group=group, vocab_start=lo, **args)
                    got.backward()
                least = min([least, *shares])
                where = f"rank {rank} filtered {head} {impl} g {g}"
                torch.testing.assert_close(got, want, **tol, msg=where)
                torch.testing.assert_close(mine[0].grad, full[0].grad, **tol, msg=f"dh {where}")
                torch.testing.assert_close(mine[1].grad, full[1].grad[lo:hi], **tol, msg=f"dW {where}")
                cases += 1
    return cases, least


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int)
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--grad-filter", action="store_true")
    args = parser.parse_args()
    # A rank that raises must not leave the others waiting: collectives time out instead of hanging.
    # Joined and left as the training commands do (train.distributed: its teardown ends gloo's threads).
    me, _ = distributed.init("cpu", timeout_minutes=1.0)
    rank, world = me.rank, me.size
    group = dist.new_group(list(range(world)))
    try:
        if args.fail_rank is not None or args.overlap:
            cuts = bounds(world)
            lo, hi = cuts[rank], cuts[rank + 1]
            if args.overlap and rank == world - 1:
                lo -= 1
            h, w, b, y, t = inputs(0, V - 1, cuts)
            w = w[lo:hi].clone()
            if rank == args.fail_rank:
                w[0, 0] = float("nan")
            linear_nmst_loss(h, w, y, eos_index=V - 1, eps=0.05, process_group=group, vocab_start=lo)
            raise SystemExit("the bad input went unnoticed")
        if args.grad_filter:
            cases, least = check_filtered(rank, world, group)
            print(f"rank {rank}/{world}: {cases} filtered cases equal to one process, least kept share {least:.3f}",
                  flush=True)
            return
        cases = check(rank, world, group)
        print(f"rank {rank}/{world}: {cases} cases equal to one process", flush=True)
        # The first two ranks again as a group of their own (the other ranks only join its creation):
        # two shards, the first and the last, without another launch.
        pair = dist.new_group([0, 1])
        if rank < 2:
            cases = check(rank, 2, pair)
            print(f"rank {rank}/2: {cases} cases equal to one process", flush=True)
    finally:
        distributed.close()


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU: the Triton kernels in the interpreter
    main()
