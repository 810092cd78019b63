"""Print a table of fused-loss timings and peak memory, as ratios to the three-GEMM floor.

Each measurement is one step in a fresh subprocess (so peak memory is its own)
on identical inputs; rounds interleave the cases and the best round counts. Ratios compare cases measured
in this one run, never against stored absolute times.

    python -m benchmarks.report                 # issue shape on CPU: 4096x768x50257 fp32
    python -m benchmarks.report --small         # a quick shape
    python -m benchmarks.report --gpu           # the bf16 GPU shapes (needs CUDA)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from .cases import CPU_DEFAULT, CPU_SMALL, GPU_SHAPES, Shape, cases_for, make_inputs


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_one(shape: Shape, case: str) -> dict:
    """Run in a fresh process: time one step of ``case`` and its peak memory above inputs + gradients."""
    torch.manual_seed(0)
    fn = cases_for(shape.device)[case]
    # Warm up on a tiny shape first: lazy imports and one-time set-up would otherwise
    # show up as "extra memory" of the measured step.
    fn(make_inputs(Shape(64, 32, 512, shape.dtype, shape.device)))
    x = make_inputs(shape)
    grad_bytes = sum(t.numel() * t.element_size() for t in (x.hidden, x.weight))
    cuda = shape.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_bytes()
    t0 = time.perf_counter()
    fn(x)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else _peak_rss_bytes()
    return {"case": case, "seconds": seconds, "extra_gb": (peak - base - grad_bytes) / 1e9}


def _child(shape: Shape, case: str) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.report", "--child", case, "--shape", json.dumps(
        [shape.N, shape.H, shape.V, str(shape.dtype).removeprefix("torch."), shape.device])]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return {"case": case, "error": out.stderr.strip().splitlines()[-1] if out.stderr else "failed"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_report(shape: Shape, rounds: int) -> list[dict]:
    """Each round runs every case once, in turn, each in a fresh process.

    Interleaving rounds (rather than timing one case many times in a row) spreads
    machine-wide slowdowns over all cases alike; the best round is reported as
    the time and the worst round as the memory.
    """
    results: dict[str, list[dict]] = {case: [] for case in cases_for(shape.device)}
    for r in range(rounds):
        for case in results:
            results[case].append(_child(shape, case))
            print(f"  round {r + 1}/{rounds}: {case}", file=sys.stderr, flush=True)
    rows = []
    for case, runs in results.items():
        ok = [run for run in runs if "error" not in run]
        if not ok:
            rows.append(runs[-1])
            continue
        rows.append({"case": case, "seconds": min(run["seconds"] for run in ok),
                     "extra_gb": max(run["extra_gb"] for run in ok), "rounds": len(ok)})
    return rows


def format_table(shape: Shape, rows: list[dict]) -> str:
    floor = next(r["seconds"] for r in rows if r["case"].startswith("three GEMMs"))
    lines = [f"shape N x H x V = {shape.label()}, fwd+bwd, torch {torch.__version__}, threads {torch.get_num_threads()}",
             f"best of {rows[0].get('rounds', '?')} interleaved rounds; extra memory = peak above inputs and gradients",
             "| case | time (s) | x floor | extra peak memory (GB) |", "|---|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error']} | | |")
        else:
            lines.append(f"| {r['case']} | {r['seconds']:.3f} | {r['seconds'] / floor:.3f} | {r['extra_gb']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="quick CPU shape 512x256x8192")
    parser.add_argument("--gpu", action="store_true", help="bf16 GPU shapes (needs CUDA)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best time is reported")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        N, H, V, dtype, device = json.loads(args.shape)
        print(json.dumps(measure_one(Shape(N, H, V, getattr(torch, dtype), device), args.child)))
        return
    if args.gpu:
        if not torch.cuda.is_available():
            parser.error("--gpu needs a CUDA device")
        shapes = GPU_SHAPES
    else:
        shapes = (CPU_SMALL,) if args.small else (CPU_DEFAULT,)
    for shape in shapes:
        print(format_table(shape, run_report(shape, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
