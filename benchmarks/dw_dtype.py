"""dW's error against float64 with the default fp32 accumulator and with the opt-in ``dw_dtype``.

    python -m benchmarks.dw_dtype                       # N = 4096, H = 512, V = 8192, chunks of 512, bf16, CPU
    python -m benchmarks.dw_dtype --device cuda --rows 16384 --hidden 768 --vocab 50257

For every head, the relative (Frobenius) error of dW for the same bf16 inputs, against the float64
reference on their exact values: plain bf16 autograd on materialized logits (what a user runs
without the fused loss), the fused loss with its default fp32 dW accumulator, and with
``dw_dtype=torch.bfloat16`` (one rounding per chunk of rows; the accumulator in half the bytes).
Prints a table and writes it as JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import nmst_fast

SEQ = 64


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dw_dtype", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4096, help="a multiple of 64 (sequences of 64 steps)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=512,
                   help="rows per chunk: dW is a sum of rows / chunk GEMMs (the library's default chunk would "
                        "take these rows in one)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path, help="also write the table here")
    return p


def _dw(h, W, y, steps, head, impl, dtype, dw_dtype, chunk):
    leaf = W.to(dtype).detach().requires_grad_()
    nmst_fast.linear_nmst_loss(h.to(dtype), leaf, y, eos_index=0, eps=1e-3, head=head, steps=steps, impl=impl,
                               dw_dtype=dw_dtype, chunk_size=chunk).backward()
    return leaf.grad.double()


def measure(args) -> dict:
    gen = torch.Generator().manual_seed(0)
    # Inputs rounded to bf16 once: every variant sees the same values, the reference their exact ones.
    # Rows of SEQ steps (t = 1..SEQ): ST's running sum goes along them.
    shape = (args.rows // SEQ, SEQ)
    h = torch.randn(*shape, args.hidden, generator=gen).bfloat16().double().to(args.device)
    W = (torch.randn(args.vocab, args.hidden, generator=gen) / args.hidden**0.5).bfloat16().double().to(args.device)
    y = torch.randint(0, args.vocab, shape, generator=gen).to(args.device)
    steps = None
    rows = []
    for head in ("nmst", "st", "va"):
        want = _dw(h, W, y, steps, head, "reference", torch.float64, None, None)
        error = lambda got: float((got - want).norm() / want.norm())  # noqa: E731
        fused = "triton" if torch.device(args.device).type == "cuda" else "chunked"
        rows.append(dict(head=head,
                         plain_bf16=error(_dw(h, W, y, steps, head, "reference", torch.bfloat16, None, None)),
                         fused_fp32_acc=error(_dw(h, W, y, steps, head, fused, torch.bfloat16, None, args.chunk)),
                         fused_bf16_acc=error(_dw(h, W, y, steps, head, fused, torch.bfloat16, torch.bfloat16,
                                                  args.chunk))))
    return dict(shape=dict(rows=args.rows, hidden=args.hidden, vocab=args.vocab, chunk=args.chunk),
                device=args.device, accumulator_bytes=dict(fp32=args.vocab * args.hidden * 4,
                                                          bf16=args.vocab * args.hidden * 2), errors=rows)


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    result = measure(args)
    print(f"dW relative error vs float64, {args.rows} x {args.hidden} x {args.vocab}, chunks of {args.chunk} rows, "
          f"bf16 inputs, {args.device}")
    print("| head | plain bf16 autograd | fused, fp32 accumulator | fused, dw_dtype=bf16 |")
    print("|---|---:|---:|---:|")
    for r in result["errors"]:
        print(f"| {r['head']} | {r['plain_bf16']:.2e} | {r['fused_fp32_acc']:.2e} | {r['fused_bf16_acc']:.2e} |")
    b = result["accumulator_bytes"]
    print(f"dW accumulator: {b['fp32'] / 2**20:.1f} MiB fp32, {b['bf16'] / 2**20:.1f} MiB bf16")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
