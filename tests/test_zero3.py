"""DeepSpeed ZeRO stage 3 on 2 CPU ranks (gloo), in one torchrun launch (tests/distributed/zero3_ranks.py):
an ``apply_nmst`` Llama's step (loss, every full gradient, the weights after an SGD step) equals one
process's for every head, untied and tied; the fused loss reads the output layer's weight inside that
layer's call, where ZeRO-3 gathers it, so the weight is not gathered while the decoder stack runs;
with the loss moved outside the layer's call, the same check sees it gathered there. A model built
partitioned (deepspeed.zero.Init) is refused with a clear error."""

import importlib.util

import pytest

from helpers import torchrun


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is a test dependency (pyproject.toml extra 'test'): present in CI")
def test_zero3_step_equals_one_process_and_the_output_weight_is_gathered_in_its_call():
    proc = torchrun("zero3_ranks.py", 2, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for rank in (0, 1):
        for tied in ("untied", "tied"):
            for head in ("nmst", "st", "va"):
                assert f"rank {rank}/2: ZeRO-3 {head} {tied} equals one process" in proc.stdout
            assert (f"rank {rank}/2: ZeRO-3 {tied}, the loss outside the output layer's call: the weight is "
                    "gathered through the decoder stack") in proc.stdout
        assert f"rank {rank}/2: a model built under zero.Init is refused" in proc.stdout
