"""Run under torchrun (gloo): the teardown of a training command, with collectives still in flight when
the process leaves the group, so that a gloo worker is still releasing their tensors as the
interpreter shuts down.

    PYTHONPATH=. torchrun --standalone --nproc_per_node 2 tests/distributed/teardown_ranks.py [--in-flight K] [--fsdp]

It joins the group as the commands do (train.distributed.init), runs a DDP step (DDP's constructor
imports torch._dynamo, which imports torch.distributed.nn.functional) and waited-for collectives,
leaves K async all-reduces of temporary tensors queued (default 50), waits at a barrier with
``--barrier``, leaves the group (train.distributed.close) and exits; every rank prints the gloo
threads still running then.
``--in-flight`` widens the window a command leaves open by chance: a worker descheduled between the
end of the last collective and the release of its tensors. While a worker runs at exit, Python ends
it when it takes the GIL to free a tensor, and the unwinding aborts the process ("terminate called
without an active exception", exit code -6); leaving the group must end the workers first. A loop:

    for i in $(seq 20); do PYTHONPATH=. torchrun --standalone --nproc_per_node 2 \
        tests/distributed/teardown_ranks.py >/dev/null 2>&1 || echo failed; done | grep -c failed

Without the first import of train/distributed.py (torch.distributed.nn.functional then imported
after the group) the three gloo threads outlived the group on every rank of every run and 6 of 10
runs aborted; with it, 0 of 10, and no gloo thread outlived the group (torch 2.13, Python 3.11,
2 shared cores). ``--barrier`` without that import: 0 of 8 aborted, as gloo's barrier waits for the
queued all-reduces, but the threads still outlived the group in every run.

``--fsdp`` runs an FSDP2 step first, and rank 0 unwraps the model as ``save_pretrained`` does. Without
train.distributed's emptying of DTensor's caches (they keep the device mesh, which keeps the group)
and its import of DeepSpeed's communication module before the group (imported after it, by that
unwrap, its ``group.WORLD`` defaults keep the group), the group and its threads outlive the group's
destruction again; the counts of the loop with ``--fsdp`` are in benchmarks/RESULTS.md.
"""

import argparse

import torch
import torch.distributed as dist
from gloo_threads import gloo_threads  # this script's folder leads sys.path

from train import distributed


def step(world: distributed.World, in_flight: int) -> None:
    """A DDP step, waited-for collectives, then ``in_flight`` all-reduces left queued; the model is
    local, as in a command's run."""
    model = distributed.replicate(torch.nn.Linear(4, 4), world)
    model(torch.ones(2, 4)).sum().backward()
    distributed.all_sum([1.0], world)
    distributed.gather(world.rank, world)
    for _ in range(in_flight):
        dist.all_reduce(torch.ones(1000), async_op=True)


def sharded_step(world: distributed.World) -> None:
    """An FSDP2 step (fully_shard, AdamW), then rank 0 unwraps the model as ``save_pretrained`` does
    (accelerate's extract_model_from_parallel, which imports DeepSpeed where it is installed)."""
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    if world.is_main:
        from accelerate.utils import extract_model_from_parallel

        extract_model_from_parallel(model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--in-flight", type=int, default=50)
    parser.add_argument("--barrier", action="store_true", help="a barrier before leaving the group")
    parser.add_argument("--fsdp", action="store_true", help="an FSDP2 step and rank 0's unwrap first")
    args = parser.parse_args()
    world, _ = distributed.init("cpu", timeout_minutes=1.0)
    if args.fsdp:
        sharded_step(world)
    step(world, args.in_flight)
    if args.barrier:
        distributed.barrier(world)
    distributed.close()
    print(f"rank {world.rank}: gloo threads after leaving the group: {gloo_threads()}", flush=True)


if __name__ == "__main__":
    main()
