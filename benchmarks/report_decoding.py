"""Per-step selection latency: fast NMST selection vs the sort-based torch implementation.

    python -m benchmarks.report_decoding            # B in {1, 32, 256} x V in {33278, 50257, 128256}
    python -m benchmarks.report_decoding --quick    # B = 256, V = 50257 only
    python -m benchmarks.report_decoding --gpu      # the grid on CUDA, with the one-read floor
    python -m benchmarks.report_decoding --gpu --flashinfer   # only the VA table against FlashInfer
    python -m benchmarks.report_decoding --gpu --flashinfer --build-only   # only build FlashInfer's samplers

Both paths are timed alternately in one process (median of ``--repeats``), and the
table gives their ratio: ratios, not absolute CPU times, are the claim. On a GPU
each path is timed by ``triton.testing.do_bench`` (median, L2 flushed between runs)
and also compared with the floor: one read of the B×V fp32 logits at the copy
bandwidth measured in the same run. ``--gpu --flashinfer`` compares the VA head with
FlashInfer's samplers instead (a run of its own: FlashInfer compiles its kernels on first use).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from nmst_fast.decoding.truncation import untruncated

from .cold_reads import cold_graph_ms
from .decoding_cases import BATCHES, STRATEGIES, VOCABS, fast, flashinfer_sampler, make_logits, sort_based


def _time(fn, logits, gen) -> float:
    t0 = time.perf_counter()
    fn(logits, gen)
    return time.perf_counter() - t0


def copy_bandwidth() -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    import triton.testing

    src = torch.empty(2**28, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def _device_step(k: Optional[int], p: Optional[float], device: str = "cuda"):
    """A strategy's whole device step — kernels only, no Python or host sync (timed as a CUDA graph).

    Greedy, sampling and top-k (then top-p): the one launch (no fill: its counters live in the
    step workspace) whose last split per row does the head math and draw
    (``nmst_fast/kernels/scan_select.py``). Top-p alone: the row draw's rejection rounds (the rare
    unresolved row takes the torch path).
    """
    from nmst_fast.kernels.row_draw import draw_rows
    from nmst_fast.kernels.scan_select import scan_select

    plain = untruncated(k, p)
    seed = torch.tensor([1234], device=device)
    head = dict(head="nmst", eps=1e-5, steps=100, state=None)

    def step(logits: torch.Tensor) -> None:
        eos = logits.shape[1] - 1
        if plain:
            draw = None if k == 1 else seed  # sampling draws in the scan; greedy does not
            scan_select(logits, eos_index=eos, temperature=1.0, seed=draw, **head)
        elif k is None:
            draw_rows(logits, eos_index=eos, temperature=1.0, top_p_threshold=p, seed=seed, **head)
        else:
            scan_select(logits, eos_index=eos, temperature=1.0, top_k=k, top_p_threshold=p, seed=seed, **head)

    return step


def _top_p_rounds(logits: torch.Tensor, k: Optional[int], p: Optional[float]) -> str:
    """Rejection rounds of top-p alone ("mean / max" over rows; rows that read the row again after
    the first pass); "—" for other strategies."""
    if k is not None or p is None or p >= 1.0:
        return "—"
    from nmst_fast.kernels.row_draw import draw_rows

    args = dict(head="nmst", eos_index=logits.shape[1] - 1, eps=1e-5, temperature=1.0, steps=100, state=None,
                top_p_threshold=p, seed=torch.tensor([1234], device=logits.device))
    _, rounds, passes = draw_rows(logits, **args)
    read = f"; {float(passes.double().mean()):.2f} read the row"  # the others the bounds settled
    return f"{float(rounds.double().mean()):.2f} / {int(rounds.max())}{read}"


def gpu_main(vocabs: tuple[int, ...] = VOCABS, device: str = "cuda") -> None:
    """The GPU table (``device``: tests run it on the CPU interpreter with the timers stubbed)."""
    bandwidth = copy_bandwidth()
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"per-step selection, NMST head, fp32 logits, {name}, torch {torch.__version__}; "
          f"do_bench medians; copy bandwidth {bandwidth / 1e12:.2f} TB/s (read+write); "
          "floor = B*V*4 bytes / that bandwidth; loop = ms per call of 50 back-to-back calls, one sync after; "
          "kernels = the strategy's whole device step as a CUDA graph, each "
          "step on a copy of the logits not in L2 (greedy, sampling, top-k: the one-launch "
          "scan + finish; top-p alone: a fill and the row-draw kernel)")
    print("| B | V | strategy | fast (ms) | sort-based (ms) | speed-up | fast, loop (ms) | kernels (ms) | floor (ms) "
          "| kernels / floor | top-p rounds (mean / max) |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator(device=device).manual_seed(0)
    for V in vocabs:
        for B in BATCHES:
            logits = make_logits(B, V, device=device)
            floor_ms = B * V * 4 / bandwidth * 1e3
            for strategy, (k, p) in STRATEGIES.items():
                _gpu_row(strategy, k, p, logits, gen, floor_ms)


def _gpu_row(name: str, k: Optional[int], p: Optional[float], logits: torch.Tensor, gen: torch.Generator,
             floor_ms: float) -> None:
    import triton.testing

    f, s, device_step = fast(k, p), sort_based(k, p), _device_step(k, p, device=logits.device)
    mf = triton.testing.do_bench(lambda: f(logits, gen), return_mode="median")
    ms = triton.testing.do_bench(lambda: s(logits, gen), return_mode="median")
    mloop = loop_ms(f, logits, gen)  # back to back, as a generation loop calls it
    mscan = cold_graph_ms(device_step, logits)  # each step on a copy of the logits not in L2
    B, V = logits.shape
    print(f"| {B} | {V} | {name} | {mf:.4f} | {ms:.4f} | {ms / mf:.2f}x | {mloop:.4f} | {mscan:.4f} | {floor_ms:.4f} | "
          f"{mscan / floor_ms:.2f} | {_top_p_rounds(logits, k, p)} |", flush=True)


def build_flashinfer(gen: torch.Generator) -> float:
    """Call each FlashInfer sampler the table times once (the first call JIT-builds it with nvcc,
    minutes on a fresh machine; later processes load the build from FlashInfer's cache). Seconds taken."""
    t0 = time.perf_counter()
    warm = make_logits(2, 1000, device="cuda")
    for k, p in STRATEGIES.values():
        if k != 1:
            flashinfer_sampler(k, p)(warm, gen)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def loop_ms(step: Callable[[torch.Tensor, torch.Generator], torch.Tensor], logits: torch.Tensor,
            gen: torch.Generator, calls: int = 50, repeats: int = 5) -> float:
    """ms per call of ``step`` called back to back, one device sync after the last (best of
    ``repeats``): what a generation loop sees. ``do_bench`` times one call between events; a step
    that does not sync then shows mostly its device time while its host work overlaps, one that
    syncs (ours: the flags) shows both — the loop puts both on the same footing."""
    step(logits, gen)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            step(logits, gen)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e3)
    return best


def flashinfer_table(gen: torch.Generator) -> None:
    """The VA head (plain softmax) against FlashInfer's samplers, when flashinfer is installed."""
    import triton.testing

    if flashinfer_sampler(None, None) is None:
        print("\n(flashinfer is not installed: no VA comparison)")
        return
    # The first call of each FlashInfer sampler JIT-compiles it: keep that out of the timings.
    print(f"\n(FlashInfer's samplers loaded/compiled in {build_flashinfer(gen):.1f} s)")
    print("\nVA head (plain softmax) vs FlashInfer: do_bench medians (L2 flushed, one call between events), "
          "and ms per call in a loop of 50 calls with one sync at the end (best of 5)")
    print("| B | V | strategy | fast VA (ms) | FlashInfer (ms) | FlashInfer / fast | fast VA, loop (ms) | "
          "FlashInfer, loop (ms) | FlashInfer / fast, loop |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for V in VOCABS:
        for B in BATCHES:
            logits = make_logits(B, V, device="cuda")
            for name, (k, p) in STRATEGIES.items():
                if k == 1:
                    continue  # greedy is an argmax: nothing to compare
                ours, theirs = fast(k, p, head="va"), flashinfer_sampler(k, p)
                mo = triton.testing.do_bench(lambda: ours(logits, gen), return_mode="median")
                mt = triton.testing.do_bench(lambda: theirs(logits, gen), return_mode="median")
                lo, lt = loop_ms(ours, logits, gen), loop_ms(theirs, logits, gen)
                print(f"| {B} | {V} | {name} | {mo:.4f} | {mt:.4f} | {mt / mo:.2f} | {lo:.4f} | {lt:.4f} | "
                      f"{lt / lo:.2f} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only B=256, V=50257")
    parser.add_argument("--gpu", action="store_true", help="the grid on CUDA, against the one-read floor")
    parser.add_argument("--flashinfer", action="store_true", help="with --gpu: only the VA table against FlashInfer")
    parser.add_argument("--build-only", action="store_true",
                        help="with --flashinfer: only build FlashInfer's samplers (gpu_check runs it beside the tests)")
    parser.add_argument("--vocabs", type=lambda text: tuple(int(v) for v in text.split(",")), default=VOCABS,
                        help=f"with --gpu: comma-separated V of the grid (default: {','.join(map(str, VOCABS))})")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, help="the CPU grid: also write the table here")
    args = parser.parse_args(argv)
    if args.build_only and not args.flashinfer:
        parser.error("--build-only goes with --flashinfer")
    if args.flashinfer and not args.gpu:
        parser.error("--flashinfer needs --gpu (FlashInfer runs on CUDA only)")
    if args.gpu:
        if not torch.cuda.is_available():
            parser.error("--gpu needs a CUDA device")
        if args.flashinfer and args.build_only:
            if flashinfer_sampler(None, None) is None:
                parser.error("--build-only: flashinfer is not installed")
            seconds = build_flashinfer(torch.Generator(device="cuda").manual_seed(0))
            print(f"FlashInfer's samplers built in {seconds:.1f} s")
        elif args.flashinfer:
            flashinfer_table(torch.Generator(device="cuda").manual_seed(0))
        else:
            gpu_main(args.vocabs)
        return
    grid = [(256, 50257)] if args.quick else [(B, V) for V in VOCABS for B in BATCHES]
    print(f"per-step selection, NMST head, fp32 logits, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"median of {args.repeats} alternating runs")
    print("| B | V | strategy | fast (ms) | sort-based (ms) | speed-up |")
    print("|---:|---:|---|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    rows = []
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
            rows.append(dict(B=B, V=V, strategy=name, fast_ms=mf * 1e3, sort_based_ms=ms * 1e3, speedup=ms / mf))
    if args.json is not None:
        args.json.write_text(json.dumps(dict(torch=torch.__version__, threads=torch.get_num_threads(),
                                             repeats=args.repeats, rows=rows), indent=1))


if __name__ == "__main__":
    main()
