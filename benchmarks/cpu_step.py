"""One decoding step on the CPU against the few lines of plain torch a user would write.

    python -m benchmarks.cpu_step                 # B in {1, 8}, V in {50257, 128256}, one thread
    python -m benchmarks.cpu_step --json out.json
    python -m benchmarks.cpu_step --repeats 3     # medians over three whole runs
    python -m benchmarks.cpu_step --eos-inside    # eos 255 columns before the end (Llama 3's 128001)

The plain version (:func:`plain_step`): the NMST log-probabilities over the vocabulary in the logits'
dtype, then ``argmax``, ``topk`` + ``multinomial``, a sort + cumulative sum + ``multinomial`` for
top-p, or ``multinomial`` over the whole row. Ours: a :class:`nmst_fast.decoding.DecodingStep` built
once, called as a decoding loop calls it (exact ties, float64 head math and the exact nucleus, which
the plain version does not give). Times are medians of interleaved calls (µs) on ``--threads``
threads (default 1: on a small shared VM two threads made both sides' medians jump by up to 2×
between runs); the ratio is ours / plain (≤ 1: no slower).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import Callable, Optional

import torch

from nmst_fast.decoding import DecodingStep

from .decoding_cases import make_logits

EPS, STEP = 1e-5, 100
INSIDE = 255  # --eos-inside: eos this many columns before the last (Llama 3: 128001 of 128256)
STRATEGIES = {"greedy": (1, None), "top-k 50": (50, None), "top-p 0.9": (None, 0.9), "sampling": (None, None)}


def plain_step(top_k: Optional[int], top_p: Optional[float],
               eos_inside: bool = False) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    """The NMST step as a user would write it in torch (t = STEP): eos last (the other columns are a
    slice) or inside the vocabulary (its column masked for the softmax, then overwritten)."""

    def step(logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        eos = logits.shape[1] - 1 - (INSIDE if eos_inside else 0)
        log_survival = torch.nn.functional.logsigmoid(-logits[:, eos]) + STEP * math.log1p(-EPS)
        if eos_inside:
            masked = logits.index_fill(1, torch.tensor([eos]), float("-inf"))
            log_p = torch.log_softmax(masked, dim=1) + log_survival[:, None]
            log_p[:, eos] = torch.log(-torch.expm1(log_survival))
        else:
            log_p = torch.log_softmax(logits[:, :eos], dim=1) + log_survival[:, None]
            log_p = torch.cat([log_p, torch.log(-torch.expm1(log_survival))[:, None]], dim=1)
        if top_k == 1:
            return torch.argmax(log_p, dim=1)
        if top_k is not None:
            values, tokens = torch.topk(log_p, top_k, dim=1)
            return tokens.gather(1, torch.multinomial(torch.softmax(values, dim=1), 1, generator=gen)).squeeze(1)
        probs = log_p.exp()
        if top_p is None:
            return torch.multinomial(probs, 1, generator=gen).squeeze(1)
        ranked, order = torch.sort(probs, dim=1, descending=True)
        ranked[(torch.cumsum(ranked, dim=1) - ranked) >= top_p] = 0.0
        return order.gather(1, torch.multinomial(ranked, 1, generator=gen)).squeeze(1)

    return step


def our_step(top_k: Optional[int], top_p: Optional[float], V: int,
             eos_inside: bool = False) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    """A DecodingStep built once, called with its checks deferred, as ``generate`` calls it."""
    step = DecodingStep(head="nmst", eos_index=V - 1 - (INSIDE if eos_inside else 0), vocab_size=V, eps=EPS,
                        top_k=top_k, top_p=top_p)
    return lambda logits, gen: step(logits, steps=STEP, generator=gen, defer_checks=True).tokens


def median_us(steps: dict[str, Callable[[], object]], calls: int) -> dict[str, float]:
    """Median µs per call of each step, the steps' calls interleaved (so drift hits them alike)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(3):  # warm-up
        for fn in steps.values():
            fn()
    for _ in range(calls):
        for name, fn in steps.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e6 for name, values in times.items()}


def run(batches: tuple[int, ...] = (1, 8), vocabs: tuple[int, ...] = (50257, 128256),
        calls: int = 40, eos_inside: bool = False) -> list[dict]:
    """One row per (B, V, strategy): µs of ours and of the plain version, and the ratio."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for V in vocabs:
        for B in batches:
            logits = make_logits(B, V)
            for name, (k, p) in STRATEGIES.items():
                ours, plain = our_step(k, p, V, eos_inside), plain_step(k, p, eos_inside)
                timed = median_us({"ours": lambda: ours(logits, gen), "plain": lambda: plain(logits, gen)}, calls)
                rows.append(dict(batch=B, vocab=V, strategy=name, ours_us=timed["ours"], plain_us=timed["plain"],
                                 ratio=timed["ours"] / timed["plain"]))
    return rows


def combine(runs: list[list[dict]]) -> list[dict]:
    """One row per case from several runs of :func:`run`: the median µs of each side over the runs,
    their ratio, and the lowest and highest ratio of a single run."""
    rows = []
    for case in zip(*runs):
        ours, plain = (statistics.median(r[key] for r in case) for key in ("ours_us", "plain_us"))
        ratios = [r["ratio"] for r in case]
        rows.append(dict(case[0], ours_us=ours, plain_us=plain, ratio=ours / plain, ratio_min=min(ratios),
                         ratio_max=max(ratios), repeats=len(case)))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[50257, 128256])
    parser.add_argument("--calls", type=int, default=40, help="interleaved calls per case (median)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="whole runs; a row's times are the medians over them, with the ratio's range")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for both sides")
    parser.add_argument("--eos-inside", action="store_true",
                        help=f"eos {INSIDE} columns before the last (default: the last column)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        rows = combine([run(tuple(args.batches), tuple(args.vocabs), args.calls, args.eos_inside)
                        for _ in range(args.repeats)])
    finally:
        torch.set_num_threads(threads)
    print(f"one NMST decoding step on the CPU, torch {torch.__version__}, {args.threads} thread(s); "
          "µs, medians of interleaved calls")
    print("| B | V | strategy | ours | plain torch | ours / plain | range over repeats |\n"
          "|---:|---:|---|---:|---:|---:|---|")
    for row in rows:
        print(f"| {row['batch']} | {row['vocab']} | {row['strategy']} | {row['ours_us']:.0f} | {row['plain_us']:.0f} | "
              f"{row['ratio']:.2f} | {row['ratio_min']:.2f}–{row['ratio_max']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
