"""python -m train.hf's training step on 2 gloo ranks (torchrun), data-parallel (DDP) and sharded (FSDP2:
fully_shard per decoder layer, on the output layer and the root): one process's loss and gradients
for every head, with ragged shares and an empty one (tests/distributed/hf_step_ranks.py). The loss
reads the output layer's weight inside that layer's own call, where FSDP2 has gathered it."""

from helpers import torchrun


def test_ddp_and_fsdp2_steps_equal_one_process():
    run = torchrun("hf_step_ranks.py", 2)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    for rank in (0, 1):
        assert f"rank {rank}/2: DDP and FSDP2 steps equal one process" in run.stdout
