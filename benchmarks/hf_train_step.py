"""One HF training step of a Llama-shaped model under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (the usual CPU
bf16 recipe), with the head against the same model's plain HF loss: ``python -m benchmarks.hf_train_step``.

The model (``--hidden``, ``--layers``, V = ``--vocab``; random init, float32 weights, untied output layer): the
plain one, and a copy with the NMST head (:func:`nmst_fast.integrations.hf.apply_nmst`). A step: the forward with
``labels`` (a batch of ``--batch`` × ``--seq`` random tokens) inside autocast, backward, and AdamW's step. Under
autocast the head's fused loss takes the bf16 hidden states and the output layer's weight cast to bf16, as
``F.linear`` would, and runs on the CPU's bf16 GEMMs with its row pass in C++; the plain model forms the (B, T, V)
bf16 logits and HF's float32 cross-entropy of them. The two alternate over ``--rounds`` rounds after one untimed
step each; the table holds each one's median step and the median of the rounds' ratios head / plain.
``--json PATH`` writes the result.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch


def _model(vocab: int, hidden: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096,
                         bos_token_id=0, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(config).train()


def step(model, optimizer, ids: torch.Tensor) -> float:
    """Seconds of one training step."""
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict:
    from nmst_fast.integrations.hf import apply_nmst

    plain = _model(args.vocab, args.hidden, args.layers)
    head = apply_nmst(copy.deepcopy(plain), head="nmst", eps=1e-5)
    ids = torch.randint(2, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    models = {"plain HF loss": plain, "NMST head": head}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-5) for name, model in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    for name, model in models.items():
        step(model, optimizers[name], ids)  # untimed: first-call set-up (the head's kernels load here)
    for r in range(args.rounds):
        for name in (models if r % 2 == 0 else reversed(list(models))):
            times[name].append(step(models[name], optimizers[name], ids))
    ratios = [h / p for h, p in zip(times["NMST head"], times["plain HF loss"])]
    return {"shape": dict(V=args.vocab, H=args.hidden, layers=args.layers, B=args.batch, T=args.seq),
            "threads": torch.get_num_threads(), "rounds": args.rounds,
            "median_s": {name: statistics.median(ts) for name, ts in times.items()},
            "head_over_plain": statistics.median(ratios), "ratio_range": (min(ratios), max(ratios))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_train_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
