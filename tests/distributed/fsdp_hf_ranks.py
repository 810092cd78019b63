"""Run under torchrun (gloo): an HF causal LM patched with apply_nmst and sharded with FSDP2
(``fully_shard`` per decoder layer, on the output layer and on the root) trains as one process does.

    torchrun --standalone --nproc_per_node 2 tests/distributed/fsdp_hf_ranks.py

Each rank takes its share of one global batch of ragged rows; the loss is summed and divided by the
global count of supervised tokens (HF's ``num_items_in_batch``) and, as HF Trainer does, multiplied by
the world size before backward, since FSDP averages the ranks' gradients: the update equals one
process's on the whole batch. The fused loss reads the output layer's
weight inside that layer's own call, where FSDP2 has gathered it (outside, it is a sharded DTensor).
"""

from datetime import timedelta

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard

from nmst_fast.integrations.hf import apply_nmst

V, EOS = 61, 60


def model(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=48, eos_token_id=EOS)
    return transformers.LlamaForCausalLM(config)


def batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (4, 10), generator=gen)
    labels = ids.clone()
    labels[0, :3], labels[1, :6], labels[3, 7:] = -100, -100, -100  # prompts and padding: ragged counts
    labels[2, 5] = EOS
    return ids, labels


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        ids, labels = batch()
        count = int((labels[:, 1:] != -100).sum())
        for head in ("nmst", "st", "va"):
            one = apply_nmst(model(), head=head, eps=0.05)
            want = one(ids, labels=labels).loss
            want.backward()

            sharded = apply_nmst(model(), head=head, eps=0.05)
            # The output layer is its own FSDP unit (as large-vocabulary models shard it): its weight is
            # gathered only during its own call.
            for layer in [*sharded.model.layers, sharded.lm_head]:
                fully_shard(layer)
            fully_shard(sharded)
            mine = slice(rank, None, world)
            loss = sharded(ids[mine], labels=labels[mine], num_items_in_batch=count).loss
            (loss * world).backward()  # FSDP divides the summed gradients by the world size
            total = loss.detach().clone()
            dist.all_reduce(total)
            torch.testing.assert_close(total, want.detach(), rtol=1e-5, atol=1e-6, msg=f"loss {head}")
            for (name, p), q in zip(one.named_parameters(), sharded.parameters()):
                torch.testing.assert_close(q.grad.full_tensor(), p.grad, rtol=1e-4, atol=1e-6,
                                           msg=f"{head} {name}")
        print(f"rank {rank}/{world}: FSDP2 equals one process", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
