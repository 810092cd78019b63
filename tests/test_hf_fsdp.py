"""FSDP2 on 2 gloo ranks (torchrun): a model patched with apply_nmst, its decoder layers, output layer
and root each sharded with fully_shard, gives one process's loss and gradients for every head
(tests/distributed/fsdp_hf_ranks.py); the loss reads the output layer's weight inside that layer's
own call, where FSDP2 has gathered it."""

from helpers import torchrun


def test_fsdp2_equals_one_process():
    run = torchrun("fsdp_hf_ranks.py", 2)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "rank 0/2: FSDP2 equals one process" in run.stdout and "rank 1/2: FSDP2 equals one process" in run.stdout
