"""Print a table of fused-loss timings and peak memory, as ratios to the three-GEMM floor.

Times: every round runs each case once (on a GPU: five steps back to back, the
steady state of a training loop), in one process; each case's ratio to the
three-GEMM floor is taken within a round and the median over rounds is reported. Memory: one step per
case in a fresh subprocess, so its peak is its own. Ratios compare cases measured
in this one run, never against stored absolute times.

    python -m benchmarks.report                 # issue shape on CPU: 4096x768x50257 fp32
    python -m benchmarks.report --small         # a quick shape
    python -m benchmarks.report --gpu           # the bf16 GPU shapes (needs CUDA; memory measured in-process)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

import torch

from . import memory
from .cases import CPU_DEFAULT, CPU_SMALL, GPU_SHAPES, Shape, cases_for, make_inputs


def measure_memory(shape: Shape, case: str) -> dict:
    """Run in a fresh process: one step of ``case``; its peak memory above inputs + gradients."""
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
        base = memory.rss_bytes()
        memory.reset_peak()
    fn(x)
    peak = torch.cuda.max_memory_allocated() if cuda else memory.peak_bytes()
    return {"case": case, "extra_gb": (peak - base - grad_bytes) / 1e9}


def _memory_in_process(shape: Shape, case: str) -> float:
    """CUDA: the caching allocator's peak is per process and resettable, so no fresh process is needed."""
    torch.cuda.empty_cache()
    try:
        return measure_memory(shape, case)["extra_gb"]
    except torch.OutOfMemoryError:
        return float("nan")
    finally:
        torch.cuda.empty_cache()


def _memory_in_subprocess(shape: Shape, case: str) -> float:
    cmd = [sys.executable, "-m", "benchmarks.report", "--child", case, "--shape", json.dumps(
        [shape.N, shape.H, shape.V, str(shape.dtype).removeprefix("torch."), shape.device])]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return float("nan")
    return json.loads(out.stdout.strip().splitlines()[-1])["extra_gb"]


def round_order(names: list[str], round_index: int) -> list[str]:
    """The cases' order in one round: a permutation drawn afresh per round (seeded by the round, so
    runs are repeatable), so no case always runs right after the same one. Rotating the order, as
    the H100 runs did, keeps every case's predecessor: NMST followed the floor in 8 rounds of 10,
    and its 5 slow rounds (0.053 s per step where ST and VA, with the same kernels, mostly took
    0.050-0.051 s) were among them."""
    return random.Random(round_index).sample(names, len(names))


def measure_times(shape: Shape, rounds: int) -> dict[str, list[float]]:
    """Every round runs each case once (on a GPU: the allocator's cache emptied, one untimed step,
    then 5 timed back-to-back steps), in a fresh order each round (:func:`round_order`), in this process, on
    the same inputs.

    Cases of one round run back to back, so dividing by that round's floor cancels
    the slow drifts of a shared machine (identical GEMM runs vary by ±15% here).
    """
    cases = cases_for(shape.device)
    # On a GPU a case runs several steps back to back, as in training, so the host enqueues
    # ahead and the time is the device's steady state, not one step's launch latency.
    steps_per_round = 5 if shape.device == "cuda" else 1
    tiny = make_inputs(Shape(64, 32, 512, shape.dtype, shape.device))
    for fn in cases.values():
        fn(tiny)
    x = make_inputs(shape)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):
        for name in round_order(list(cases), r):
            fn = cases[name]
            try:
                if shape.device == "cuda":
                    # The previous case (the naive ones hold 10-24 GB) leaves the caching allocator
                    # shaped for itself; a training job holds only its own blocks. So: give the
                    # cache back, then one untimed step, and time the allocator's steady state.
                    torch.cuda.empty_cache()
                    fn(x)
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(steps_per_round):
                    fn(x)
            except torch.OutOfMemoryError:  # the naive cases may not fit the card: report, go on
                x.hidden.grad = x.weight.grad = None
                torch.cuda.empty_cache()
                times[name].append(float("nan"))
                continue
            if shape.device == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / steps_per_round)
            print(f"  round {r + 1}/{rounds}: {name} {times[name][-1]:.3f}s", file=sys.stderr, flush=True)
    return times


def run_report(shape: Shape, rounds: int) -> list[dict]:
    times = measure_times(shape, rounds)
    floor = times[next(iter(times))]
    rows = []
    measure = _memory_in_process if shape.device == "cuda" else _memory_in_subprocess
    for name, ts in times.items():
        ratios = [t / f for t, f in zip(ts, floor)]
        rows.append({"case": name, "seconds": statistics.median(ts), "best": min(ts),
                     "ratio": statistics.median(ratios), "ratio_range": (min(ratios), max(ratios)),
                     "extra_gb": measure(shape, name)})
        print(f"  memory: {name}", file=sys.stderr, flush=True)
    return rows


def format_table(shape: Shape, rows: list[dict], rounds: int) -> str:
    lines = [
        f"shape N x H x V = {shape.label()}, forward+backward, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {rounds} rounds",
        "x floor = median over rounds of (case time / three-GEMM time of the same round); "
        "extra memory = peak above inputs and gradients (one step, fresh process)",
        "| case | median time (s) | best (s) | x floor (median) | x floor (range) | extra peak memory (GB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lo, hi = r["ratio_range"]
        lines.append(f"| {r['case']} | {r['seconds']:.3f} | {r['best']:.3f} | {r['ratio']:.3f} | "
                     f"{lo:.3f}–{hi:.3f} | {r['extra_gb']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="quick CPU shape 512x256x8192")
    parser.add_argument("--gpu", action="store_true", help="bf16 GPU shapes (needs CUDA)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds; each round times every case once, back to back (default 3 on CPU, 10 on GPU)")
    parser.add_argument("--gpu-shape", type=int, default=None,
                        help="with --gpu: only this index into benchmarks.cases.GPU_SHAPES")
    parser.add_argument("--json", help="also write the rows of every shape to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        N, H, V, dtype, device = json.loads(args.shape)
        print(json.dumps(measure_memory(Shape(N, H, V, getattr(torch, dtype), device), args.child)))
        return
    if args.gpu:
        if not torch.cuda.is_available():
            parser.error("--gpu needs a CUDA device")
        shapes = GPU_SHAPES if args.gpu_shape is None else (GPU_SHAPES[args.gpu_shape],)
    else:
        shapes = (CPU_SMALL,) if args.small else (CPU_DEFAULT,)
    rounds = args.rounds or (10 if args.gpu else 3)
    results = []
    for shape in shapes:
        rows = run_report(shape, rounds)
        results.append({"shape": shape.label(), "rows": rows})
        print(format_table(shape, rows, rounds), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": _device_name(), "results": results}, f, indent=1)


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
