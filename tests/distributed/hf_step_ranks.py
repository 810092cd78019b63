"""Run under torchrun (gloo): ``python -m train.hf``'s training step over the ranks gives one process's
loss and gradients, data-parallel (DDP) and sharded (FSDP2), for every head.

    torchrun --standalone --nproc_per_node 2 tests/distributed/hf_step_ranks.py

(tests/test_train_hf_ddp.py runs :func:`check_steps` inside the launch of hf_train_ranks.py.)

The step is the command's own: :func:`train.distributed.shard` (DDP, or ``fully_shard`` per decoder layer, on
the output layer and on the root), :func:`train.loop.token_batches` (each rank's share of a global batch of
ragged rows: the shares hold different token counts, and one global batch holds a single row, so one
rank's share is empty) and :func:`train.loop.backward`. Under FSDP2 the fused loss reads the output
layer's weight inside that layer's own call, where it is gathered (outside, it is a sharded DTensor).
Leaving the process group afterwards must end gloo's threads (gloo_threads.py).
"""

import sys
from pathlib import Path

import torch
from gloo_threads import gloo_threads  # this script's folder leads sys.path

from nmst_fast.integrations.hf import apply_nmst
from train import distributed
from train.distributed import shard
from train.loop import backward, token_batches

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the tests' shared builders
from hf_models import EOS, tiny_model  # noqa: E402


def model(head: str):
    return apply_nmst(tiny_model("llama", dtype=torch.float32), head=head, eps=0.05, context_length=3)


def sequences():
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 6, 9, 12, 13, 14, 30]  # with 64 tokens a batch: [5 6 9 12], [13 14], [30]
    return [torch.randint(0, EOS, (n - 1,), generator=gen).tolist() + [EOS] for n in lengths]


def gradients(net, world, fsdp: bool):
    step = shard(net, world, fsdp)
    losses = [backward(step, batch, tokens, world, "cpu")
              for batch, tokens in token_batches(sequences(), 64, 0, EOS, shuffle=False, world=world)]
    grads = {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for name, p in net.named_parameters()}
    return losses, grads


def check_steps(world: distributed.World) -> None:
    """Every head's DDP and FSDP2 step on ``world`` against one process's (each rank computes that
    itself, without collectives); prints one line per rank."""
    for head in ("nmst", "st", "va"):
        want_losses, want = gradients(model(head), distributed.World(), fsdp=False)
        for fsdp in (False, True):
            losses, grads = gradients(model(head), world, fsdp)
            kind = "FSDP2" if fsdp else "DDP"
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{kind} {head} losses: {m}")
            for name, g in want.items():
                torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{kind} {head} {name}: {m}")
    print(f"rank {world.rank}/{world.size}: DDP and FSDP2 steps equal one process", flush=True)


def main() -> None:
    world, _ = distributed.init("cpu", timeout_minutes=2.0)
    try:
        check_steps(world)
    finally:
        distributed.close()
    # Leaving the group after the FSDP2 steps ended gloo's threads (train.distributed.drop_device_mesh_caches).
    left = gloo_threads()
    assert not left, f"rank {world.rank}: gloo threads outlived the process group: {left}"


if __name__ == "__main__":
    main()
