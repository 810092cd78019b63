"""Generation throughput (tokens/s) of the paper's LSTM (2×512, tied) with an NMST head.

    python -m benchmarks.report_generation
    python -m benchmarks.report_generation --device cuda   # the fused selection kernels on a GPU
    python -m benchmarks.report_generation --json benchmarks/results/generation.json   # the table as JSON too

Random-init weights (no training data needed): throughput depends on shapes, not on
what the model says. V = 33278 is WikiText-2's word vocabulary; contexts are 10 tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import nmst_fast
from nmst_fast.models import RecurrentLM

STRATEGIES = {"greedy": {}, "top_k": dict(top_k=4), "nucleus": dict(top_p=0.4), "beam": dict(num_beams=4)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=33278)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (impl='auto' picks the Triton selection on CUDA)")
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device")
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = RecurrentLM(args.vocab, eos_index=args.vocab - 1, arch="lstm", head="nmst", eps=1e-5).eval().to(device)
    with torch.no_grad():
        # Random weights put p(eos) near 1/2 at t = 1, so every sequence would stop at once.
        # Point the (tied) eos embedding against the typical hidden state: s << 0, and the
        # continuations run to max_length, as a trained model's mostly would at these lengths.
        probe, _ = model(torch.randint(0, args.vocab - 1, (64, 20), device=device))
        direction = probe.reshape(-1, probe.shape[-1]).mean(0)
        model.embedding.weight[args.vocab - 1] = -200.0 * direction / direction.norm() ** 2
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} CPU threads"
    print(f"LSTM 2x512 tied, V={args.vocab}, NMST eps=1e-5, max_length={args.max_length}, torch {torch.__version__}, "
          f"{where}")
    print("| batch | strategy | returned tokens | seconds | tokens/s |")
    print("|---:|---|---:|---:|---:|")
    rows = []
    for B in args.batches:
        contexts = torch.randint(0, args.vocab - 1, (B, 10), device=device)
        for name, kw in STRATEGIES.items():
            def run(name=name, kw=kw):
                return nmst_fast.generate(model, contexts, strategy=name, max_length=args.max_length,
                                          generator=torch.Generator(device).manual_seed(0), **kw)

            if device.type == "cuda":
                run()  # compiles the Triton kernels for these shapes: not part of the throughput
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            tokens = int(out.lengths.sum())  # tokens returned (beam search evaluates num_beams rows per item)
            print(f"| {B} | {name} | {tokens} | {seconds:.2f} | {tokens / seconds:.0f} |", flush=True)
            rows.append(dict(batch=B, strategy=name, tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds))
    if args.json is not None:
        args.json.write_text(json.dumps(dict(torch=torch.__version__, device=where, vocab=args.vocab,
                                             max_length=args.max_length, rows=rows), indent=1))


if __name__ == "__main__":
    main()
