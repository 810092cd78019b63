"""Launch-shape sweeps and part timings of the decoding kernels on a GPU.

    python -m benchmarks.profile_decoding            # B = 256, V in {50257, 128256}
    python -m benchmarks.profile_decoding --quick    # V = 50257 only
    python -m benchmarks.profile_decoding --tables read-floor,scan   # chosen tables, in that order

Tables: "row-draw" sweeps the row draw (top-p's kernel) over tile width, warps and PREFETCH (the next tile's
load issued before this tile's folds); "top-p-layout" it in the wide and compact layouts
(``row_draw.TOP_P_LAYOUTS``) at p = 0.4 and 0.9, with mean rounds and passes per row; "scan" the split-V scan
with its finish (the greedy and sampling step, ``nmst_fast/kernels/scan_select.py``) over splits per row and
tile width at B = 256, "scan-b32" at B = 32; "top-k-scan" the one-launch top-k 4 and 50 steps over tile
width and splits; "read-floor" the greedy and sampling steps against a bare read in the same layout and
torch's row max. Each row gives the device time
(``triton.testing.do_bench_cudagraph`` median, each step on a copy of the logits not in L2:
``benchmarks.cold_reads``), the achieved read rate or the ratio to the one-read floor at the copy bandwidth
measured in the same run; * marks the current default. Pick the next defaults from the tables.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import triton
import triton.language as tl

from nmst_fast.kernels.row_draw import TOP_P_LAYOUTS, cuda_launch, default_launch, draw_rows
from nmst_fast.kernels.row_scan import launch_plan, split_layout

from .cold_reads import cold_graph_ms
from .decoding_cases import make_logits

# A timer takes a step of the logits and the logits: ``cold_reads.cold_graph_ms`` on a GPU.
Timer = Callable[[Callable[[torch.Tensor], None], torch.Tensor], float]

BLOCK_VS = (2048, 4096)
WARPS = (4, 8, 16)
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)  # per row, for the greedy scan at B = 256


@dataclass
class Variant:
    block_v: int
    num_warps: int
    prefetch: bool
    maxnreg: Optional[int] = None  # a register cap per thread (so that more programs reside per SM)

    def launch(self, V: int) -> dict:
        return cuda_launch(V, block_v=self.block_v, num_warps=self.num_warps, prefetch=self.prefetch,
                           maxnreg=self.maxnreg)


def variants() -> list[Variant]:
    """The default shape without PREFETCH (the kernel the H100 timed), then every tile width x
    warps with it, then top-p's compact layout (``row_draw.TOP_P_LAYOUTS``): each is a compile
    (~2 s), so the sweep fits one gpu_check step."""
    return ([Variant(2048, 8, False)] + [Variant(b, w, True) for b, w in itertools.product(BLOCK_VS, WARPS)]
            + [Variant(prefetch=True, **TOP_P_LAYOUTS["compact"])])


def sweep(logits: torch.Tensor, top_p: float, candidates: Iterable[Variant],
          timer: Timer) -> list[tuple[Variant, float]]:
    """(variant, ms) for one draw_rows call per variant on ``logits`` (NMST head, t = 100)."""
    seed = torch.tensor([1234], device=logits.device)
    rows = []
    for variant in candidates:
        def step(z: torch.Tensor, variant=variant) -> None:
            draw_rows(z, head="nmst", eos_index=z.shape[1] - 1, eps=1e-5, temperature=1.0, steps=100,
                      state=None, seed=seed, top_p_threshold=top_p, launch=variant.launch(z.shape[1]))

        step(logits)  # compile outside the timing
        rows.append((variant, timer(step, logits)))
    return rows


def top_p_layout_sweep(logits: torch.Tensor, timer: Timer) -> list[tuple[float, str, float, float, float]]:
    """(top_p, layout's name in ``row_draw.TOP_P_LAYOUTS``, ms, mean rounds, mean passes per row) of
    the row draw's top-p in each layout (NMST head, t = 100)."""
    rows = []
    for top_p, (name, layout) in itertools.product((0.4, 0.9), TOP_P_LAYOUTS.items()):
        args = dict(head="nmst", eos_index=logits.shape[1] - 1, eps=1e-5, temperature=1.0, steps=100, state=None,
                    top_p_threshold=top_p, seed=torch.tensor([1234], device=logits.device),
                    launch=cuda_launch(logits.shape[1], **layout))

        def step(z: torch.Tensor, args=args) -> None:
            draw_rows(z, **args)

        _, rounds, passes = draw_rows(logits, **args)
        rows.append((top_p, name, timer(step, logits), float(rounds.double().mean()), float(passes.double().mean())))
    return rows


def scan_sweep(logits: torch.Tensor, launches: Iterable[tuple[int, int]], timer: Timer, *, draw: bool = False,
               top_k: Optional[int] = None) -> list[tuple[tuple[int, int], float]]:
    """((BLOCK_V, splits), ms) of the greedy (``draw`` False), sampling, or top-k (``top_k``) device step
    (the one-launch scan whose last split per row merges and does the head math) per launch, NMST
    head, t = 100."""
    from nmst_fast.kernels.scan_select import scan_select

    seed = torch.tensor([1234], device=logits.device) if draw or top_k else None
    rows = []
    for launch in launches:
        def step(z: torch.Tensor, launch=launch) -> None:
            scan_select(z, head="nmst", eos_index=z.shape[1] - 1, eps=1e-5, temperature=1.0, steps=100, state=None,
                        seed=seed, launch=launch, top_k=top_k)

        step(logits)
        rows.append((launch, timer(step, logits)))
    return rows


def default_scan_launch(logits: torch.Tensor, top_k: int) -> tuple[int, int]:
    """(BLOCK_V, splits) the one-launch step takes by default for these logits (``top_k``: 0 for greedy
    and sampling)."""
    (_, splits), _, _, meta = launch_plan(*logits.shape, top_k, None, False,
                                          logits.device.index if logits.is_cuda else -1)
    return meta["BLOCK_V"], splits


@triton.jit
def _read_kernel(z_ptr, z_row_stride, V, split_width, out_ptr, BLOCK_V: tl.constexpr):
    """The least a split-V scan can do: sum its slice of one row (unmasked whole tiles, a masked last
    one) and store one number. A practical one-launch floor for the decoding steps."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    lo = split * split_width
    hi = tl.minimum(lo + split_width, V)
    base = z_ptr + row.to(tl.int64) * z_row_stride + tl.arange(0, BLOCK_V)
    acc = tl.zeros((BLOCK_V,), tl.float32)
    whole_end = lo + (hi - lo) // BLOCK_V * BLOCK_V
    for start in range(lo, whole_end, BLOCK_V):
        acc += tl.load(base + start)
    acc += tl.load(base + whole_end, mask=whole_end + tl.arange(0, BLOCK_V) < hi, other=0.0)
    tl.store(out_ptr + row * tl.num_programs(1) + split, tl.sum(acc, axis=0))


def bare_read(z: torch.Tensor, block_v: int, splits: int) -> torch.Tensor:
    """(B, splits) fp32 sums of the row slices: ``_read_kernel`` over ``splits`` slices of whole tiles."""
    B, V = z.shape
    split_width, splits = split_layout(V, block_v, splits)
    out = torch.empty(B, splits, device=z.device)
    _read_kernel[(B, splits)](z, z.stride(0), V, split_width, out, BLOCK_V=block_v, num_warps=4)
    return out


def read_floor_parts(logits: torch.Tensor, timer: Timer) -> list[tuple[str, float]]:
    """(part, ms) at the greedy scan's default launch: a bare read in that layout, torch's row max,
    the greedy step (``scan_select``) and plain sampling by the one-launch drawing scan. The bare
    read is what one launch costs at best."""
    from nmst_fast.kernels.scan_select import scan_select

    B, V = logits.shape
    eos = V - 1
    block_v, splits = default_scan_launch(logits, 0)
    seed = torch.tensor([1234], device=logits.device)
    head = dict(head="nmst", eos_index=eos, eps=1e-5, temperature=1.0, steps=100, state=None)

    def read(z: torch.Tensor) -> None:
        bare_read(z, block_v, splits)

    def row_max(z: torch.Tensor) -> None:
        torch.amax(z, dim=1)

    def greedy_one_launch(z: torch.Tensor) -> None:
        scan_select(z, seed=None, **head)

    def sampling_one_launch(z: torch.Tensor) -> None:
        scan_select(z, seed=seed, **head)

    rows = []
    for name, fn in ((f"bare read ({block_v} x {splits} splits)", read), ("torch.amax(dim=1)", row_max),
                     ("greedy, one launch (scan_select)", greedy_one_launch),
                     ("sampling, one launch (drawing scan_select)", sampling_one_launch)):
        fn(logits)
        rows.append((name, timer(fn, logits)))
    return rows


TABLES = ("row-draw", "top-p-layout", "scan", "top-k-scan", "scan-b32",
          "read-floor")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="V = 50257 only")
    parser.add_argument("--tables", default=",".join(TABLES),
                        help=f"comma-separated tables to run, in this order (default: all): {','.join(TABLES)}")
    args = parser.parse_args(argv)
    tables = args.tables.split(",")
    unknown = sorted(set(tables) - set(TABLES))
    if unknown:
        parser.error(f"--tables: unknown {unknown}; choose from {','.join(TABLES)}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the interpreter's times say nothing about a GPU)")

    from .report_decoding import copy_bandwidth

    bandwidth = copy_bandwidth()
    timer = cold_graph_ms
    vocabs = (50257,) if args.quick else (50257, 128256)
    print(f"decoding launch sweeps, NMST head, fp32 logits, {torch.cuda.get_device_name()}; copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s (read+write); floor = one read at that rate; * = default")
    for table in tables:
        _TABLE_RUNNERS[table](vocabs, bandwidth, timer, args.quick)


def _case(B: int, V: int, bandwidth: float) -> tuple[torch.Tensor, float]:
    """A table's (B, V) fp32 logits on the GPU and their one-read floor (ms) at ``bandwidth``."""
    logits = make_logits(B, V, device="cuda")
    return logits, logits.numel() * 4 / bandwidth * 1e3


def _row_draw_table(vocabs, bandwidth, timer, quick) -> None:
    print("\nrow draw (top-p) launch sweep, B = 256")
    print("| V | mode | BLOCK_V | warps | prefetch | ms | read TB/s | x floor |\n"
          "|---:|---|---:|---:|---|---:|---:|---:|")
    for V in vocabs:
        logits, floor_ms = _case(256, V, bandwidth)
        for mode, top_p in (("top-p 0.4", 0.4), ("top-p 0.9", 0.9)):
            default = default_launch(logits)
            for variant, ms in sweep(logits, top_p, variants(), timer):
                launch = variant.launch(V)
                mark = "*" if launch == default else ""
                print(f"| {V} | {mode} | {launch['BLOCK_V']}{mark} | {variant.num_warps} | {variant.prefetch} | "
                      f"{ms:.4f} | {logits.numel() * 4 / (ms * 1e-3) / 1e12:.2f} | {ms / floor_ms:.2f} |", flush=True)


def _top_p_layout_table(vocabs, bandwidth, timer, quick) -> None:
    # Not yet timed on a GPU: the compact layout runs a batch of 256 rows in one
    # wave of two programs per SM where the wide one took two waves of one.
    print("\nrow draw's top-p, wide (2048 columns, 16 warps) and compact (1024, 8 warps, 128 registers) "
          "programs, B = 256 (default: compact above one row per SM)")
    print("| V | top-p | layout | ms | x floor | mean rounds | passes per row |\n|---:|---:|---|---:|---:|---:|---:|")
    for V in vocabs:
        logits, floor_ms = _case(256, V, bandwidth)
        default = default_launch(logits)
        for top_p, name, ms, mean_rounds, passes in top_p_layout_sweep(logits, timer):
            mark = "*" if cuda_launch(V, **TOP_P_LAYOUTS[name]) == default else ""
            print(f"| {V} | {top_p} | {name}{mark} | {ms:.4f} | {ms / floor_ms:.2f} | {mean_rounds:.2f} | "
                  f"{passes:.2f} |", flush=True)


def _scan_table(vocabs, bandwidth, timer, quick) -> None:
    print("\nsplit-V scan with its finish (one launch), B = 256")
    print("| V | mode | BLOCK_V | splits | programs | ms | read TB/s | x floor |\n"
          "|---:|---|---:|---:|---:|---:|---:|---:|")
    for V, draw in [(V, False) for V in vocabs] + [(50257, True)]:
        logits, floor_ms = _case(256, V, bandwidth)
        default_block_v, default_splits = default_scan_launch(logits, 0)
        launches = [(block_v, splits) for block_v in (1024, 2048, 4096) for splits in SPLITS
                    if splits * block_v < 2 * V]
        for (block_v, splits), ms in scan_sweep(logits, launches, timer, draw=draw):
            mark = "*" if (block_v, splits) == (default_block_v, default_splits) else ""
            print(f"| {V} | {'sampling' if draw else 'greedy'} | {block_v} | {splits}{mark} | {256 * splits} | "
                  f"{ms:.4f} | {logits.numel() * 4 / (ms * 1e-3) / 1e12:.2f} | {ms / floor_ms:.2f} |", flush=True)


def _top_k_scan_table(vocabs, bandwidth, timer, quick) -> None:
    # The candidate scans' layout (1024-column tiles; one wave of ⌊4·SMs / B⌋ splits for K <= 16 and
    # ⌊3·SMs / B⌋ above, from ptxas's register counts) is untimed: top-k 4's lanes now keep a runner-up
    # each, and top-k 50's a list by one tl.topk per program where it took one per tile.
    print("\none-launch top-k step over the candidate scan's layout, B = 256")
    print("| V | top-k | BLOCK_V | splits | programs | ms | x floor |\n|---:|---:|---:|---:|---:|---:|---:|")
    for V in vocabs:
        logits, floor_ms = _case(256, V, bandwidth)
        for top_k in (4, 50):
            default_block_v, default_splits = default_scan_launch(logits, top_k)
            launches = sorted({(block_v, splits) for block_v in (1024, 2048) for splits in (1, 2, 3, 4, 6)}
                              | {(default_block_v, default_splits)})
            for (block_v, splits), ms in scan_sweep(logits, launches, timer, top_k=top_k):
                mark = "*" if (block_v, splits) == (default_block_v, default_splits) else ""
                print(f"| {V} | {top_k} | {block_v} | {splits}{mark} | {256 * splits} | {ms:.4f} | "
                      f"{ms / floor_ms:.2f} |", flush=True)


def _scan_b32_table(vocabs, bandwidth, timer, quick) -> None:
    # The layout rule (``row_scan.cuda_launch_shape``) is meant for every batch size, so the sweep
    # checks it away from B = 256 too (the H200 check of 2026-11-27 chose it from B = 1-256).
    print("\nsplit-V scan with its finish (one launch) at B = 32, V = 128256")
    print("| mode | BLOCK_V | splits | programs | ms | x floor |\n|---|---:|---:|---:|---:|---:|")
    logits, floor_ms = _case(32, 128256, bandwidth)
    default_block_v, default_splits = default_scan_launch(logits, 0)
    launches = sorted({(block_v, splits) for block_v in (1024, 2048) for splits in (4, 8, 16, 32)}
                      | {(default_block_v, default_splits)})
    for draw in (False, True):
        for (block_v, splits), ms in scan_sweep(logits, launches, timer, draw=draw):
            mark = "*" if (block_v, splits) == (default_block_v, default_splits) else ""
            print(f"| {'sampling' if draw else 'greedy'} | {block_v} | {splits}{mark} | {32 * splits} | {ms:.4f} | "
                  f"{ms / floor_ms:.2f} |", flush=True)


def _read_floor_table(vocabs, bandwidth, timer, quick) -> None:
    print("\nthe greedy and sampling steps against a bare read in their layout (default launch)")
    print("| B | V | part | ms | x floor |\n|---:|---:|---|---:|---:|")
    for B, V in ((256, 50257), (32, 50257)) if quick else ((256, 50257), (256, 128256), (32, 50257)):
        logits, floor_ms = _case(B, V, bandwidth)
        for part, ms in read_floor_parts(logits, timer):
            print(f"| {B} | {V} | {part} | {ms:.4f} | {ms / floor_ms:.2f} |", flush=True)


_TABLE_RUNNERS = {"row-draw": _row_draw_table, "top-p-layout": _top_p_layout_table, "scan": _scan_table,
                  "top-k-scan": _top_k_scan_table, "scan-b32": _scan_b32_table,
                  "read-floor": _read_floor_table}


if __name__ == "__main__":
    main()
