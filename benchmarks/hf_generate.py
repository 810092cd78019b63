"""HF ``generate()`` with the head against the same model's plain ``generate()``: ``python -m benchmarks.hf_generate``.

A Llama-shaped model (``--hidden``, ``--layers``; random init, float32) over V ∈ ``--vocabs``: the plain model,
and a copy with the NMST head (:func:`nmst_fast.integrations.hf.apply_nmst`, ε = 1e-5, so no run ends early).
Both generate ``--new-tokens`` tokens (``min_new_tokens`` as many, no eos stop) from the same random prompts of
``--prompt`` tokens, B ∈ ``--batches``, greedy and sampled (temperature 0.7, top-k 50, top-p 0.9). The two runs of
each case alternate over ``--rounds`` rounds (the VM's drift hits them alike); the table holds the median of the
rounds' time per generated token, and the ratio head / plain of each round's pair, its median. The head's share
of a step: the time its eos column takes (:func:`nmst_fast.integrations.hf.generation.step_logits`, timed inside
the head's runs) over the head's whole step. On ``--threads`` torch threads (default 1, as the other CPU
benchmarks: a 2-thread region on a shared 2-core VM waits for a busy core). ``--device cuda`` on a GPU.
``--json PATH`` writes the table.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch


def _model(vocab: int, hidden: int, layers: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096,
                         bos_token_id=0, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(device).eval()


def _generate(model, prompts: torch.Tensor, new_tokens: int, sampled: bool) -> float:
    """Seconds of one ``generate()`` call."""
    options = dict(do_sample=True, temperature=0.7, top_k=50, top_p=0.9) if sampled else dict(do_sample=False)
    if prompts.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0, **options)
    if prompts.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> list[dict]:
    from nmst_fast.integrations.hf import apply_nmst
    from nmst_fast.integrations.hf import generation as hf_generation
    from nmst_fast.integrations.hf import patch as hf_patch

    torch.set_num_threads(args.threads)
    timed = {"seconds": 0.0}
    step_logits = hf_generation.step_logits

    def timed_step_logits(out, generation):
        if out.logits is not None and out.logits.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = step_logits(out, generation)
        if out.logits is not None and out.logits.device.type == "cuda":
            torch.cuda.synchronize()
        timed["seconds"] += time.perf_counter() - start
        return result

    hf_patch.step_logits = timed_step_logits  # the name the head's forward calls
    rows = []
    try:
        for vocab in args.vocabs:
            plain = _model(vocab, args.hidden, args.layers, args.device)
            head = apply_nmst(copy.deepcopy(plain), head="nmst", eps=1e-5, eos_token_id=1)
            for batch in args.batches:
                prompts = torch.randint(2, vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
                prompts = prompts.to(args.device)
                for sampled in (False, True):
                    for model in (plain, head):  # warm-up
                        _generate(model, prompts, 2, sampled)
                    plain_s, head_s, share = [], [], []
                    for _ in range(args.rounds):
                        torch.manual_seed(0)
                        plain_s.append(_generate(plain, prompts, args.new_tokens, sampled))
                        timed["seconds"] = 0.0
                        torch.manual_seed(0)
                        head_s.append(_generate(head, prompts, args.new_tokens, sampled))
                        share.append(timed["seconds"] / head_s[-1])
                    row = dict(vocab=vocab, batch=batch, sampling="sampled" if sampled else "greedy",
                               plain_ms_per_token=1e3 * statistics.median(plain_s) / args.new_tokens,
                               head_ms_per_token=1e3 * statistics.median(head_s) / args.new_tokens,
                               ratio=statistics.median(h / p for h, p in zip(head_s, plain_s)),
                               head_share=statistics.median(share))
                    rows.append(row)
                    print(f"V={vocab} B={batch} {row['sampling']}: plain {row['plain_ms_per_token']:.3f} ms/token, "
                          f"head {row['head_ms_per_token']:.3f} ms/token, ratio {row['ratio']:.3f}, "
                          f"head's share {100 * row['head_share']:.1f}%", flush=True)
    finally:
        hf_patch.step_logits = step_logits
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf_generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--vocabs", type=int, nargs="+", default=[128256, 50257])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(argv)
    rows = run(args)
    if args.json is not None:
        args.json.write_text(json.dumps(dict(args={k: str(v) if isinstance(v, Path) else v
                                                   for k, v in vars(args).items()}, rows=rows), indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
