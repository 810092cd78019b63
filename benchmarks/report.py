"""Print a table of fused-loss timings and peak memory, as ratios to the three-GEMM floor, and as
TFLOP/s of the step's 6·N·H·V useful FLOPs and a share of the card's dense bf16 peak (GPU).

Times: every round runs each case once (on a GPU: five steps back to back, the
steady state of a training loop), in one process; each case's ratio to the
three-GEMM floor is taken within a round and the median over rounds is reported. Memory: one step per
case in a fresh subprocess, so its peak is its own. Ratios compare cases measured
in this one run, never against stored absolute times.

    python -m benchmarks.report                 # issue shape on CPU: 4096x768x50257 fp32
    python -m benchmarks.report --dtype bfloat16           # the same shape in bf16 (or float16)
    python -m benchmarks.report --large --dtype bfloat16   # 2048x2304x256000 (Gemma-2's width and vocabulary)
    python -m benchmarks.report --small         # a quick shape
    python -m benchmarks.report --gpu           # the bf16 GPU shapes (needs CUDA; memory measured in-process)

On a GPU the cases include the floor at V padded to a multiple of 64, bf16 dW accumulation, and
Liger-Kernel's and Cut Cross-Entropy's fused VA losses when they are installed
(``benchmarks/fetch_gpu_wheels.sh``); on CPU, Cut Cross-Entropy's torch.compile implementation, whose first
call at the measured shape (its compilation) runs before the rounds, untimed. The table's header names the CPU
and whether it has AMX and AVX-512-bf16 (bf16 GEMMs run several times faster with either).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import time
from typing import Optional

import torch

from . import memory
from .cases import CPU_DEFAULT, CPU_LARGE, CPU_SMALL, GPU_SHAPES, Shape, cases_for, make_inputs

# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, from NVIDIA's data sheets; the first name that
# is part of torch.cuda.get_device_name() wins, so the variants come before their family.
DENSE_BF16_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("H100", 989.4), ("H200", 989.4),
    ("GH200", 989.4), ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0),
)


def dense_bf16_peak(device_name: str) -> Optional[float]:
    """The card's dense bf16 peak in TFLOP/s, or None for a card (or CPU) not in the table."""
    return next((peak for name, peak in DENSE_BF16_PEAK_TFLOPS if name in device_name), None)


def useful_tflop(shape: Shape) -> float:
    """The step's useful work, 6·N·H·V FLOPs (three GEMMs at the unpadded V), in TFLOP."""
    return 6 * shape.N * shape.H * shape.V / 1e12


def measure_memory(shape: Shape, case: str) -> dict:
    """Run in a fresh process: one step of ``case``; its peak memory above inputs + gradients."""
    fn = cases_for(shape.device)[case]
    # Warm up on a tiny shape first: lazy imports and one-time set-up would otherwise
    # show up as "extra memory" of the measured step.
    fn(make_inputs(Shape(64, 32, 512, shape.dtype, shape.device)))
    x = make_inputs(shape)
    if getattr(fn, "compiles", False):
        fn(x)  # its compilation at this shape: not the step's own memory
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
    except Exception as err:  # out of memory, or a case that does not run here: NaN, as in the times
        print(f"  memory of {case}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
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


def measure_times(shape: Shape, rounds: int, skip: tuple[str, ...] = ()) -> dict[str, list[float]]:
    """Every round runs each case once (on a GPU: the allocator's cache emptied, one untimed step,
    then 5 timed back-to-back steps), in a fresh order each round (:func:`round_order`), in this process, on
    the same inputs.

    Cases of one round run back to back, so dividing by that round's floor cancels
    the slow drifts of a shared machine (identical GEMM runs vary by ±15% here). A case whose
    warm-up step fails (a baseline this card or its wheel does not run) gets NaN times, and the
    others run on: one GPU call yields the whole table.
    """
    cases = {name: fn for i, (name, fn) in enumerate(cases_for(shape.device).items())
             if i == 0 or not any(part in name for part in skip)}  # the floor (first) always runs
    # On a GPU a case runs several steps back to back, as in training, so the host enqueues
    # ahead and the time is the device's steady state, not one step's launch latency.
    steps_per_round = 5 if shape.device == "cuda" else 1
    tiny = make_inputs(Shape(64, 32, 512, shape.dtype, shape.device))
    times: dict[str, list[float]] = {name: [] for name in cases}
    for name, fn in list(cases.items()):
        try:
            fn(tiny)
        except Exception as err:  # a case that cannot run here (a baseline on this card) leaves NaN, not a crash
            print(f"  {name} does not run: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            times[name] = [float("nan")] * rounds
            del cases[name]
    x = make_inputs(shape)
    for name, fn in cases.items():
        if getattr(fn, "compiles", False):  # the first call at this shape compiles: untimed, reported
            t0 = time.perf_counter()
            fn(x)
            print(f"  {name}: first call (compilation) {time.perf_counter() - t0:.1f}s, not timed", file=sys.stderr,
                  flush=True)
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


def summarize(shape: Shape, times: dict[str, list[float]], extra_gb: dict[str, float],
              peak_tflops: Optional[float]) -> list[dict]:
    """One row per case: median and best step time, the median and range over rounds of its ratio
    to the same round's floor (the first case), TFLOP/s of the useful work at the median time, its
    share of ``peak_tflops`` (None: unknown card), and the extra memory."""
    floor = times[next(iter(times))]
    rows = []
    for name, ts in times.items():
        ratios = [t / f for t, f in zip(ts, floor)]
        seconds = statistics.median(ts)
        tflops = useful_tflop(shape) / seconds
        rows.append({"case": name, "seconds": seconds, "best": min(ts), "ratio": statistics.median(ratios),
                     "ratio_range": (min(ratios), max(ratios)), "tflops": tflops,
                     "peak_share": None if peak_tflops is None else tflops / peak_tflops,
                     "extra_gb": extra_gb[name]})
    return rows


def run_report(shape: Shape, rounds: int, peak_tflops: Optional[float], skip: tuple[str, ...] = ()) -> list[dict]:
    """Times and extra memory of every case whose name holds none of ``skip``'s strings (the floor always runs)."""
    times = measure_times(shape, rounds, skip)
    measure = _memory_in_process if shape.device == "cuda" else _memory_in_subprocess
    extra_gb = {}
    for name, ts in times.items():
        # A case that did not run (every time NaN) is not run again for its memory: NaN there too.
        extra_gb[name] = measure(shape, name) if any(t == t for t in ts) else float("nan")
        print(f"  memory: {name}", file=sys.stderr, flush=True)
    return summarize(shape, times, extra_gb, peak_tflops)


def format_table(shape: Shape, rows: list[dict], rounds: int, device_name: str,
                 peak_tflops: Optional[float]) -> str:
    peak = f"dense bf16 peak {peak_tflops:g} TFLOP/s" if peak_tflops is not None else "peak unknown: --peak-tflops"
    lines = [
        f"shape N x H x V = {shape.label()}, forward+backward, {device_name}, {peak}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {rounds} rounds; {_baseline_versions()}",
        "x floor = median over rounds of (case time / three-GEMM time of the same round); TFLOP/s = "
        f"6·N·H·V = {useful_tflop(shape):.3g} TFLOP over the median time; extra memory = peak above inputs "
        "and gradients (one step, fresh process on CPU)",
        "| case | median time (s) | best (s) | x floor (median) | x floor (range) | TFLOP/s | % of peak "
        "| extra peak memory (GB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lo, hi = r["ratio_range"]
        share = "—" if r["peak_share"] is None else f"{100 * r['peak_share']:.1f}"
        lines.append(f"| {r['case']} | {r['seconds']:.3f} | {r['best']:.3f} | {r['ratio']:.3f} | "
                     f"{lo:.3f}–{hi:.3f} | {r['tflops']:.4g} | {share} | {r['extra_gb']:.3f} |")
    return "\n".join(lines)


def _baseline_versions() -> str:
    """The versions of the installed baselines (Liger-Kernel, Cut Cross-Entropy)."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for dist in ("liger-kernel", "cut-cross-entropy"):
        try:
            found.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            found.append(f"{dist} not installed")
    return ", ".join(found)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="quick CPU shape 512x256x8192")
    parser.add_argument("--large", action="store_true", help="CPU shape 2048x2304x256000 (Gemma-2's H and V)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="the CPU shapes' dtype (default float32; --gpu runs bf16)")
    parser.add_argument("--gpu", action="store_true", help="bf16 GPU shapes (needs CUDA)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds; each round times every case once, back to back (default 3 on CPU, 10 on GPU)")
    parser.add_argument("--gpu-shape", type=int, default=None,
                        help="with --gpu: only this index into benchmarks.cases.GPU_SHAPES")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the card's dense bf16 peak in TFLOP/s (default: from the card's name, if known)")
    parser.add_argument("--json", help="also write the rows of every shape to this file")
    parser.add_argument("--skip", nargs="+", default=[], metavar="TEXT",
                        help="leave out the cases whose name holds any of these (e.g. 'F.linear_cross_entropy', "
                             "which takes about 300 s a step at --large on 2 cores); the floor always runs")
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
        shape = CPU_SMALL if args.small else CPU_LARGE if args.large else CPU_DEFAULT
        shapes = (dataclasses.replace(shape, dtype=getattr(torch, args.dtype)),)
    rounds = args.rounds or (10 if args.gpu else 3)
    device_name = _device_name()
    peak = args.peak_tflops if args.peak_tflops is not None else dense_bf16_peak(device_name)
    results = []
    for shape in shapes:
        rows = run_report(shape, rounds, peak, tuple(args.skip))
        results.append({"shape": shape.label(), "rows": rows})
        print(format_table(shape, rows, rounds, device_name, peak), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": device_name, "peak_tflops": peak,
                       "baselines": _baseline_versions(), "results": results}, f, indent=1)


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_description()


def cpu_description(cpuinfo: str | None = None) -> str:
    """The CPU's model name and its bf16 matrix units, from /proc/cpuinfo: e.g. "AMD EPYC (AVX-512, avx512_bf16,
    no AMX)" or "Intel(R) Xeon(R) Platinum 8481C (AVX-512, avx512_bf16, AMX)"."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return "cpu"
    fields = dict(line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    isa = ["AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2",
           "avx512_bf16" if "avx512_bf16" in flags else "no avx512_bf16",
           "AMX" if {"amx_bf16", "amx_tile"} <= flags else "no AMX"]
    return f"{fields.get('model name', 'cpu')} ({', '.join(isa)})"


if __name__ == "__main__":
    main()
