"""Run under torchrun (2 gloo ranks, DeepSpeed's CPU accelerator): an ``apply_nmst`` Llama trained
one step with DeepSpeed ZeRO stage 3 gives one process's loss, gradients and updated weights, for
every head, with an untied and a tied output layer.

    torchrun --standalone --nproc_per_node 2 tests/distributed/zero3_ranks.py

(tests/test_zero3.py runs it.) Every parameter is partitioned (no persistence threshold), so outside
a module's call the output layer's weight is a 0-size placeholder. The checks, on every rank:

* the step (``engine(...)``, ``engine.backward``, ``engine.step``) on each rank's share of a global
  batch of ragged rows equals one process's step on the whole batch without DeepSpeed: the loss, every
  parameter's full gradient and every parameter after one SGD step; then the loss at the new weights;
* in both forwards the output layer's weight is not gathered while the decoder stack runs (at its final
  norm): the fused loss reads it inside the layer's own call alone, where ZeRO-3's hooks gather it and
  release it after;
* with the loss run outside the output layer's call, that check sees the weight gathered through the
  decoder stack. (The loss is still right: during the engine's forward ZeRO-3 gathers a partitioned
  weight wherever it is read, but for the module that is running, the whole model, and from the next
  forward on before the decoder stack. The layer's call keeps the gather to the layer.)

A model built partitioned (under ``deepspeed.zero.Init``) is refused by ``apply_nmst`` with a clear error.

DeepSpeed's CPU accelerator; gloo's collectives; torch.optim.SGD: no DeepSpeed op is compiled.
"""

import os

os.environ["DS_ACCELERATOR"] = "cpu"  # read when deepspeed is imported; also on a GPU machine

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402
from deepspeed.utils import safe_get_full_grad  # noqa: E402

import nmst_fast.integrations.hf as nmst_hf  # noqa: E402
from nmst_fast.integrations.hf import apply_nmst  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the tests' shared builders
from hf_models import EOS, tiny_model  # noqa: E402

LR = 1.0
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    # Every parameter partitioned: by default ZeRO-3 keeps parameters under 1e5 elements whole on
    # every rank, which is all of this model's, and the checks would not see a placeholder. No
    # prefetch and no reuse: from the second forward on, ZeRO-3 would gather the next modules' weights
    # ahead of their calls (this whole model in one bucket) and keep a tied weight gathered from the
    # embedding's call to the output layer's, and the check of where the output weight is gathered
    # would not see the loss's own reads.
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "model_persistence_threshold": 0,
                          "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0},
    "zero_allow_untested_optimizer": True,  # torch.optim.SGD: no compiled optimizer op
    "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unless told; one process's step does not clip
}


def model(head: str, tied: bool):
    return apply_nmst(tiny_model("llama", dtype=torch.float32, tie_word_embeddings=tied), head=head, eps=0.05)


def batch():
    """4 rows of 10 tokens; the labels ignore a context, padding and most of a row, so that rank 0's
    share (rows 0-1) holds 15 scored tokens and rank 1's (rows 2-3) 7; N = 22."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, EOS, (4, 10), generator=gen)
    ids[0, -1] = EOS
    ids[2, 5] = EOS
    labels = ids.clone()
    labels[1, :3] = -100
    labels[2, 6:] = -100
    labels[3, :-3] = -100
    return ids, labels, int((labels[:, 1:] != -100).sum())


def one_process(head: str, tied: bool):
    """Loss, gradients, and the loss and parameters after one SGD step, in one process."""
    net = model(head, tied)
    ids, labels, n = batch()
    loss = net(input_ids=ids, labels=labels, num_items_in_batch=n).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in net.named_parameters()}
    torch.optim.SGD(net.parameters(), lr=LR).step()
    with torch.no_grad():
        after = net(input_ids=ids, labels=labels, num_items_in_batch=n).loss
    return loss.detach(), grads, {name: p.detach().clone() for name, p in net.named_parameters()}, after


def summed(value: torch.Tensor) -> torch.Tensor:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value


def zero3(head: str, tied: bool):
    """The model under a ZeRO-3 engine, its output weight partitioned, and the list that records the
    weight's status each time the decoder stack reaches its final norm."""
    net = model(head, tied)
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=LR), config=CONFIG)
    weight = net.lm_head.weight  # read outside any forward: not gathered
    assert weight.ds_status == ZeroParamStatus.NOT_AVAILABLE and weight.numel() == 0, weight.ds_summary()
    at_norm = []
    net.model.norm.register_forward_pre_hook(lambda module, args: at_norm.append(weight.ds_status))
    return engine, at_norm


def check(head: str, tied: bool, rank: int, world: int) -> None:
    want_loss, want_grads, want_params, want_after = one_process(head, tied)
    engine, at_norm = zero3(head, tied)
    net = engine.module
    ids, labels, n = batch()
    share = slice(rank * 4 // world, (rank + 1) * 4 // world)
    what = f"{head} {'tied' if tied else 'untied'}"

    # Each rank's loss is its share's sum over the global token count; ZeRO averages the ranks'
    # gradients, so the loss is scaled by the world size for the global batch's gradient.
    loss = engine(input_ids=ids[share], labels=labels[share], num_items_in_batch=n).loss
    engine.backward(loss * world)
    torch.testing.assert_close(summed(loss), want_loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} loss: {m}")
    for name, p in net.named_parameters():
        torch.testing.assert_close(safe_get_full_grad(p), want_grads[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{what} {name} gradient: {m}")
    engine.step()
    params = dict(net.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        for name, p in params.items():
            torch.testing.assert_close(p.detach(), want_params[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{what} {name} after the step: {m}")
    with torch.no_grad():
        after = engine(input_ids=ids[share], labels=labels[share], num_items_in_batch=n).loss
    torch.testing.assert_close(summed(after), want_after, rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{what} loss after the step: {m}")
    # Gathered only inside its layer's call, in both forwards.
    assert at_norm == [ZeroParamStatus.NOT_AVAILABLE] * 2, f"{what}: the output weight at the final norm: {at_norm}"
    print(f"rank {rank}/{world}: ZeRO-3 {what} equals one process", flush=True)


def check_outside(tied: bool, rank: int, world: int) -> None:
    """The same step with the loss run outside the output layer's call: DeepSpeed still gathers the weight
    where the loss reads it, but for the module that runs (the whole model), from the next forward
    on before the decoder stack: the check above sees that."""
    what = "tied" if tied else "untied"
    inside = nmst_hf.scoring.in_output_layer
    nmst_hf.scoring.in_output_layer = lambda layer, hidden, compute: compute(hidden)
    try:
        engine, at_norm = zero3("nmst", tied)
        ids, labels, n = batch()
        share = slice(rank * 4 // world, (rank + 1) * 4 // world)
        engine.backward(engine(input_ids=ids[share], labels=labels[share], num_items_in_batch=n).loss)
        engine.step()
        with torch.no_grad():
            engine(input_ids=ids[share], labels=labels[share], num_items_in_batch=n)
    finally:
        nmst_hf.scoring.in_output_layer = inside
    assert at_norm == [ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.AVAILABLE], f"{what}: {at_norm}"
    print(f"rank {rank}/{world}: ZeRO-3 {what}, the loss outside the output layer's call: the weight is gathered "
          "through the decoder stack", flush=True)


def check_zero_init(rank: int, world: int) -> None:
    """A model built partitioned (under ``deepspeed.zero.Init``) is refused with a clear error: the
    probe needs the whole model."""
    config = model("va", tied=False).config
    config.pad_token_id = None  # transformers' init zeroes the padding row, which a partitioned embedding lacks
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        net = transformers.LlamaForCausalLM(config)
    try:
        apply_nmst(net, head="va")
    except ValueError as e:
        assert "partitioned by DeepSpeed ZeRO-3" in str(e), e
    else:
        raise AssertionError("apply_nmst patched a model built under deepspeed.zero.Init")
    print(f"rank {rank}/{world}: a model built under zero.Init is refused", flush=True)


def main() -> None:
    # DeepSpeed's CPU backend compiles a shared-memory all-reduce op at init (about 2 minutes on 2 cores,
    # a C++ toolchain needed) that only its inference all-reduce uses: ZeRO's collectives are gloo's.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    import train.distributed  # noqa: F401  (before the group exists: see that module's first import)

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        for tied in (False, True):
            for head in ("nmst", "st", "va"):
                check(head, tied, rank, world)
            check_outside(tied, rank, world)
        check_zero_init(rank, world)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
