"""Per-step selection latency: fast NMST selection vs the sort-based torch implementation.

    python -m benchmarks.report_decoding            # B in {1, 32, 256} x V in {33278, 50257, 128256}
    python -m benchmarks.report_decoding --quick    # B = 256, V = 50257 only

Both paths are timed alternately in one process (median of ``--repeats``), and the
table gives their ratio: ratios, not absolute CPU times, are the claim.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from .decoding_cases import BATCHES, STRATEGIES, VOCABS, fast, make_logits, sort_based


def _time(fn, logits, gen) -> float:
    t0 = time.perf_counter()
    fn(logits, gen)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only B=256, V=50257")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    grid = [(256, 50257)] if args.quick else [(B, V) for V in VOCABS for B in BATCHES]
    print(f"per-step selection, NMST head, fp32 logits, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"median of {args.repeats} alternating runs")
    print("| B | V | strategy | fast (ms) | sort-based (ms) | speed-up |")
    print("|---:|---:|---|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for B, V in grid:
        logits = make_logits(B, V)
        for name, (k, p) in STRATEGIES.items():
            f, s = fast(k, p), sort_based(k, p)
            f(logits, gen), s(logits, gen)  # warm-up
            tf, ts = [], []
            for _ in range(args.repeats):
                tf.append(_time(f, logits, gen))
                ts.append(_time(s, logits, gen))
            mf, ms = statistics.median(tf), statistics.median(ts)
            print(f"| {B} | {V} | {name} | {mf * 1e3:.2f} | {ms * 1e3:.2f} | {ms / mf:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
