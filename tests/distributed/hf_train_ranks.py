"""Run under torchrun (gloo): the training step's checks (hf_step_ranks.py), then ``python -m train.hf``
four times, in one process group, as the test of data-parallel and sharded training needs them
(tests/test_train_hf_ddp.py): one launch instead of five.

    torchrun --standalone --nproc_per_node 2 tests/distributed/hf_train_ranks.py OUT -- TRAIN_HF_FLAGS...

The runs, each ``train.hf.main`` as the command runs it, write to OUT/ddp (data-parallel), OUT/fsdp
(``--fsdp``) and OUT/cut (``--fsdp``, stopped after its first epoch, then resumed by a second run).
The process group the step checks join is kept for the runs (kept_group.py); leaving it at the end
must end gloo's threads (gloo_threads.py).
"""

import sys
from pathlib import Path

import torch
from gloo_threads import gloo_threads  # this script's folder leads sys.path
from hf_step_ranks import check_steps
from kept_group import kept_group

from train import distributed
from train.hf import main as train_hf


def main() -> None:
    out, flags = Path(sys.argv[1]), sys.argv[sys.argv.index("--") + 1:]
    world, _ = distributed.init("cpu", timeout_minutes=10.0)
    with kept_group():
        check_steps(world)
        train_hf(["--out", str(out / "ddp"), *flags])
        train_hf(["--out", str(out / "fsdp"), *flags, "--fsdp"])
        train_hf(["--out", str(out / "cut"), *flags, "--fsdp", "--stop-after", "1"])
        epoch = torch.load(out / "cut" / "train_state.pt", weights_only=False)["epoch"]
        print(f"cut after epoch {epoch}", flush=True)
        train_hf(["--out", str(out / "cut"), *flags, "--fsdp"])
    # Leaving the group after FSDP2 runs ended gloo's threads: DTensor's caches, which keep the device
    # mesh and through it the group, were emptied first (train.distributed.drop_device_mesh_caches).
    left = gloo_threads()
    assert not left, f"rank {world.rank}: gloo threads outlived the process group: {left}"


if __name__ == "__main__":
    main()
