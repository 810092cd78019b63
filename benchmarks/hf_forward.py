"""A forward without labels of a model with a head (its logits carry the head's eos column) against the same model's
plain forward: ``python -m benchmarks.hf_forward``.

A Llama-shaped model (``--hidden``, ``--layers``; random init, float32, untied output layer) over V ∈ ``--vocabs``:
the plain model and a copy with the NMST head (:func:`nmst_fast.integrations.hf.apply_nmst`). Both run
``model(ids)`` under ``torch.no_grad`` on a batch of ``--batch`` × ``--seq`` tokens; the head's forward then writes
the eos entry of every position (one pass over the (B, T, V) logits for each token's L: the CPU row kernel). The
two alternate over ``--rounds`` rounds after one untimed forward each; the table holds the medians and the median of
the rounds' ratios head / plain. ``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from .hf_train_step import _model


def run(args: argparse.Namespace) -> list[dict]:
    from nmst_fast.integrations.hf import apply_nmst

    rows = []
    for vocab in args.vocabs:
        plain = _model(vocab, args.hidden, args.layers).eval()
        head = apply_nmst(copy.deepcopy(plain), head="nmst", eps=1e-5)
        ids = torch.randint(2, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
        models = {"plain": plain, "head": head}
        times: dict[str, list[float]] = {name: [] for name in models}
        with torch.no_grad():
            for model in models.values():
                model(ids)
            for r in range(args.rounds):
                for name in (models if r % 2 == 0 else reversed(list(models))):
                    start = time.perf_counter()
                    models[name](ids)
                    times[name].append(time.perf_counter() - start)
        ratios = [h / p for h, p in zip(times["head"], times["plain"])]
        rows.append({"V": vocab, "plain_s": statistics.median(times["plain"]),
                     "head_s": statistics.median(times["head"]), "head_over_plain": statistics.median(ratios),
                     "ratio_range": (min(ratios), max(ratios))})
        del plain, head
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_forward", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocabs", type=int, nargs="+", default=[50257, 128256])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = run(args)
    shape = (f"H = {args.hidden}, {args.layers} layers, B × T = {args.batch} × {args.seq}, "
             f"{torch.get_num_threads()} threads")
    print(f"{shape}, {args.rounds} rounds\n| V | plain (s) | with the head (s) | head / plain (median) | range |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        lo, hi = row["ratio_range"]
        print(f"| {row['V']} | {row['plain_s']:.3f} | {row['head_s']:.3f} | {row['head_over_plain']:.3f} | "
              f"{lo:.3f}–{hi:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": shape, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
