"""Compile every Triton kernel for an NVIDIA GPU without a GPU (Triton's wheel ships ptxas).

CI machines have no GPU. The interpreter checks what the kernels compute; this checks that
they *compile* for a real target — lowering (fp64 exp/log, tl.topk, atomics, join/reshape),
register and shared-memory limits — for the launch variants the wrappers use on CUDA. The
wrappers run on small CPU tensors with every kernel replaced by a recorder, so argument
types come from the real call sites; block sizes are then set to the CUDA launch shapes
(the wrappers pick bigger blocks for the interpreter on CPU).

    python tools/compile_check.py             # sm_90 (H100/H200); exit status 1 on failure
    python tools/compile_check.py --arch 80   # another compute capability
    python tools/compile_check.py --resources # plus registers / spills per variant (ptxas -v)
    python tools/compile_check.py --ptx DIR   # also write each variant's PTX, without debug lines, to
                                              # DIR: `diff -r` two trees to see whether a change
                                              # alters the generated code
    python tools/compile_check.py --only "row draw V=512" --only split_lse  # the variants whose names
                                              # contain any of these (each must match one at least)

Must run without TRITON_INTERPRET (the kernels have to be JIT functions). A developer tool, not part
of the installed package: it imports ``nmst_fast`` (install the checkout first).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from nmst_fast.kernels import row_draw, row_scan, scale_cast, scan_select, split_softmax
from nmst_fast.kernels.host_math import cdiv, next_power_of_2, scan_width

H100_SMS = 132  # an H100's or H200's multiprocessors: split counts follow from it


@dataclass
class Launch:
    name: str
    kernel: object
    args: tuple
    kwargs: dict
    cuda_constexprs: dict = field(default_factory=dict)  # the CUDA launch shape's block sizes
    cuda_options: dict = field(default_factory=dict)  # and its num_warps, where it depends on them


class _Recorder:
    def __init__(self, sink: list):
        self.sink = sink

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.sink.append((args, kwargs))


@contextmanager
def _recording(module, kernel_name: str, sink: list):
    kernel = getattr(module, kernel_name)
    setattr(module, kernel_name, _Recorder(sink))
    try:
        yield kernel
    finally:
        setattr(module, kernel_name, kernel)


def _record(module, kernel_name: str, call, label: str, cuda_constexprs: dict,
            cuda_options: dict | None = None) -> Launch:
    sink: list = []
    with _recording(module, kernel_name, sink) as kernel:
        call()
    if len(sink) != 1:
        raise RuntimeError(f"{label}: expected one launch of {kernel_name}, saw {len(sink)}")
    args, kwargs = sink[0]
    return Launch(label, kernel, args, kwargs, cuda_constexprs, cuda_options or {})


def launches() -> list[Launch]:
    """The variants the CUDA paths launch (heads, greedy/sampling, candidates, dtypes)."""
    out = []
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(4, 1000, generator=gen)
    # The one-launch step (scan + each row's finish by its last split): every head, greedy and the
    # draw, at the GPU layout of 256 x 50257 (2 splits: BLOCK_S 2) and of B = 1 (64 splits).
    for head, seed, dtype, splits in (("va", None, torch.float32, 2), ("nmst", None, torch.float32, 2),
                                      ("st", None, torch.float32, 2), ("nmst", 7, torch.float32, 2),
                                      ("st", 7, torch.bfloat16, 2), ("nmst", 7, torch.float32, 64)):
        label = f"scan_select {head} {'draw' if seed else 'greedy'} {str(dtype)[6:]} splits={splits}"
        seed_tensor = None if seed is None else torch.tensor([seed])
        _, block_v, _ = row_scan.cuda_launch_shape(256, 50257, 0, H100_SMS)
        lane_tiles = scan_width(cdiv(cdiv(50257, splits), block_v)) if seed else 1
        out.append(_record(scan_select, "_scan_select_kernel", lambda: scan_select.scan_select(
            z.to(dtype), head=head, eos_index=5, eps=1e-5, temperature=0.7, steps=3,
            state=torch.zeros(4, dtype=torch.float64) if head == "st" else None, seed=seed_tensor),
            label, dict(BLOCK_B=1, BLOCK_V=block_v, LANE_TILES=lane_tiles, BLOCK_S=splits)))
    # Its top-k at the GPU layouts of 256 x 50257 (small K: 2 splits, large K: 1) and of B = 1 (small K:
    # 50 splits; larger K as many as the finish's keys allow), at both lane depths of the candidate scan
    # (K = 4 and 16: 2 values per lane, 32 to 128: 3; from 32 on the lanes' list by tl.topk), with bf16
    # loads at the ends.
    for head, top_k, top_p, batch, dtype in (
            ("nmst", 4, None, 256, torch.float32), ("st", 3, 0.5, 256, torch.float32), ("va", 4, 0.9, 1, torch.float32),
            ("nmst", 16, None, 256, torch.float32), ("nmst", 20, 0.9, 256, torch.float32),
            ("nmst", 50, None, 256, torch.float32), ("nmst", 100, 0.9, 256, torch.float32),
            ("nmst", 4, None, 256, torch.bfloat16), ("nmst", 100, None, 256, torch.bfloat16)):
        K = max(2, 1 << (top_k - 1).bit_length())
        _, block_v, splits = row_scan.cuda_launch_shape(batch, 50257, K, H100_SMS)
        block_s = next_power_of_2(splits)
        label = f"scan_select {head} top_k={top_k} top_p={top_p} {str(dtype)[6:]} splits={splits}"
        out.append(_record(scan_select, "_scan_select_kernel", lambda: scan_select.scan_select(
            z.to(dtype), head=head, eos_index=5, eps=1e-5, temperature=1.0, steps=3,
            state=torch.zeros(4, dtype=torch.float64) if head == "st" else None, seed=torch.tensor([3]),
            top_k=top_k, top_p_threshold=top_p),
            label, dict(BLOCK_B=1, BLOCK_V=block_v, BLOCK_S=block_s)))
    # Per-row steps and ST states (tensors where the calls above pass ints) for every head, greedy
    # and the draw; every head's top-k finish at the largest K (its widest tl.topk of splits x K keys).
    steps = torch.arange(4)
    state = torch.zeros(4, dtype=torch.float64)
    seed = torch.tensor([3])
    _, block_v, _ = row_scan.cuda_launch_shape(256, 50257, 0, H100_SMS)
    for head in ("va", "nmst", "st"):
        for draw in (None, seed):
            label = f"scan_select {head} {'greedy' if draw is None else 'draw'} steps tensor"
            lane_tiles = scan_width(cdiv(cdiv(50257, 2), block_v)) if draw is not None else 1
            out.append(_record(scan_select, "_scan_select_kernel", lambda: scan_select.scan_select(
                z, head=head, eos_index=5, eps=1e-5, temperature=0.7, steps=steps,
                state=state if head == "st" else None, seed=draw),
                label, dict(BLOCK_B=1, BLOCK_V=block_v, LANE_TILES=lane_tiles, BLOCK_S=2)))
        _, cand_block_v, splits = row_scan.cuda_launch_shape(1, 50257, 128, H100_SMS)
        out.append(_record(scan_select, "_scan_select_kernel", lambda: scan_select.scan_select(
            z, head=head, eos_index=5, eps=1e-5, temperature=1.0, steps=steps, state=state if head == "st" else None,
            seed=seed, top_k=100, top_p_threshold=0.9),
            f"scan_select {head} top_k=100 top_p=0.9 splits={splits}",
            dict(BLOCK_B=1, BLOCK_V=cand_block_v, BLOCK_S=next_power_of_2(splits))))
    out += _row_draw_launches(state, seed)
    out += _small_vocab_launches(seed)
    zb = z.to(torch.bfloat16)
    targets = torch.zeros(4, dtype=torch.long)
    stats = [torch.zeros(4) for _ in range(3)]
    for softcap in (None, 30.0):  # Gemma's logit cap is a constexpr variant of both row kernels
        cap = "" if softcap is None else " softcap"
        out.append(_record(split_softmax, "_split_lse_kernel",
                           lambda: split_softmax.split_lse(zb, targets, 5, softcap=softcap),
                           f"split_lse bf16{cap}", {}))
        out.append(_record(split_softmax, "_split_softmax_grad_kernel",
                           lambda: split_softmax.split_softmax_grad_(zb, targets, torch.zeros(4), *stats, 5,
                                                                     softcap=softcap),
                           f"split_softmax_grad bf16{cap}", {}))
        out.append(_record(split_softmax, "_split_statistics_kernel",
                           lambda: split_softmax.split_statistics(zb, torch.zeros(4, dtype=torch.float64), 5,
                                                                  softcap=softcap),
                           f"split_statistics bf16{cap}", {}))
    # fp32 accumulators to every parameter dtype; the loss's bf16 / fp16 dh to its own dtype.
    for src_dtype, dtype in [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                             (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                             (torch.float16, torch.float16)]:
        out.append(_record(scale_cast, "_scale_cast_kernel",
                           lambda: scale_cast.scale_cast(torch.zeros(4, 3, dtype=src_dtype),
                                                         torch.ones((), dtype=torch.float64), dtype),
                           f"scale_cast {str(src_dtype)[6:]} -> {str(dtype)[6:]}", {}))
    return out


def _row_draw_launches(state: torch.Tensor, seed: torch.Tensor) -> list[Launch]:
    """The row-draw kernel (top-p by rejection) for every head (fp32, and bf16 once), in both layouts,
    at the CUDA launch shape of a 128256-token vocabulary (the widest per-lane table) and of the
    benchmarks' 50257."""
    V = 128256
    z = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    out = []
    for head, dtype in [("va", torch.float32), ("nmst", torch.float32), ("st", torch.float32),
                        ("nmst", torch.bfloat16)]:
        label = f"{head} {str(dtype)[6:]}"
        for name, layout in row_draw.TOP_P_LAYOUTS.items():
            out.append(_record_row_draw(z.to(dtype), head=head, state=state if head == "st" else None,
                                        temperature=0.7, top_p=0.9, seed=seed, label=f"row draw {label} {name}",
                                        layout=layout))
    # The benchmarks' vocabulary: its 32-column lane tables lay out differently (the within-lane draw
    # of a round stays inside one warp).
    z50257 = torch.randn(4, 50257, generator=torch.Generator().manual_seed(1))
    for name, layout in row_draw.TOP_P_LAYOUTS.items():
        out.append(_record_row_draw(z50257, head="nmst", state=None, temperature=0.7, top_p=0.9, seed=seed,
                                    label=f"row draw nmst float32 V=50257 {name}", layout=layout))
    return out


def _small_vocab_launches(seed: torch.Tensor) -> list[Launch]:
    """The row draw at vocabularies of one to two tiles (V divisible by 16, so the loads are
    vectorized): Triton 3.6's scan lowering failed there on an H100 until the per-tile table was
    padded (``host_math.scan_width``)."""
    out = []
    for V in (512, 1024, 4096):
        z = torch.randn(64, V, generator=torch.Generator().manual_seed(2))
        for dtype in (torch.float32, torch.bfloat16):
            out.append(_record_row_draw(z.to(dtype), head="nmst", state=None, temperature=1.0, top_p=0.9, seed=seed,
                                        label=f"row draw V={V} {str(dtype)[6:]}"))
    # The one-launch step with one split (a small vocabulary, or a batch of over 4 rows per SM): a
    # one-column split table in the finish's inverse CDF (``step_common.crossing_with``'s cumsum).
    for V, seed_or_none in ((400, seed), (2048, seed), (2048, None)):
        z = torch.randn(5, V, generator=torch.Generator().manual_seed(4))
        _, block_v, splits = row_scan.cuda_launch_shape(600, V, 0, H100_SMS)
        out.append(_record(scan_select, "_scan_select_kernel", lambda: scan_select.scan_select(
            z, head="nmst", eos_index=3, eps=0.05, temperature=1.0, steps=torch.arange(5), state=None,
            seed=seed_or_none), f"scan_select V={V} splits={splits} {'draw' if seed_or_none is not None else 'greedy'}",
            dict(BLOCK_B=1, BLOCK_V=block_v, BLOCK_S=splits,
                 LANE_TILES=scan_width(cdiv(V, block_v)) if seed_or_none is not None else 1)))
    return out


def _record_row_draw(z: torch.Tensor, *, head: str, state, temperature: float, top_p: float, seed: torch.Tensor,
                     label: str, layout: Optional[dict] = None) -> Launch:
    """One row-draw launch on ``z`` at the CUDA launch shape of its vocabulary (eos at column 5, t = 3);
    ``layout``: one of ``row_draw.TOP_P_LAYOUTS`` (default: the wide one)."""
    return _record(row_draw, "_row_draw_kernel", lambda: row_draw.draw_rows(
        z, head=head, eos_index=5, eps=1e-5, temperature=temperature, steps=3, state=state,
        top_p_threshold=top_p, seed=seed), label,
        *_blocks_and_options(row_draw.cuda_launch(z.shape[1], **(layout or {}))))


_COMPILE_OPTIONS = ("num_warps", "maxnreg")


def _blocks_and_options(shape: dict) -> tuple[dict, dict]:
    """A launch dict split into its constexpr block sizes and its compile options (num_warps, maxnreg)."""
    return ({key: value for key, value in shape.items() if key not in _COMPILE_OPTIONS},
            {key: value for key, value in shape.items() if key in _COMPILE_OPTIONS})


def compile_launch(launch: Launch, arch: int):
    """Compile one launch for ``sm_<arch>``; returns (the compiled kernel, seconds taken).

    Arguments are specialized by the JIT's own binder, as a launch on the GPU would: integers
    divisible by 16 and 16-byte-aligned pointers get ``tt.divisibility``, integers equal to 1
    become constants. Those hints change layouts and lowering (a first GPU run failed in
    TritonGPUCoalesce and the scan lowering only under them), so a check without them passes
    kernels the GPU cannot compile.
    """
    kernel = launch.kernel
    kwargs = dict(launch.kwargs) | launch.cuda_constexprs | launch.cuda_options
    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    t0 = time.perf_counter()
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                              target=GPUTarget("cuda", arch, 32), options=options.__dict__)
    return compiled, time.perf_counter() - t0


def resources(compiled, arch: int) -> str:
    """Registers, spills and the register-limited resident warps per SM, from ``ptxas -v``.

    A static signal, not a timing: it shows which kernels can keep enough warps in flight.
    """
    from triton.backends.nvidia.compiler import get_ptxas  # Triton's choice of its bundled ptxas

    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        suffix = "a" if arch >= 90 else ""
        report = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}{suffix}", str(ptx),
                                 "-o", str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    if regs is None:
        return f"ptxas said: {report.strip()[:200]}"
    warps = compiled.metadata.num_warps
    per_program = int(regs.group(1)) * 32 * warps
    resident = min(65536 // per_program, 2048 // (32 * warps)) * warps if per_program else 0
    return (f"{warps} warps, {regs.group(1)} registers, {spills.group(1) if spills else '?'} B spilled, "
            f"{resident} warps/SM by registers")


def code_only(ptx: str) -> str:
    """PTX without its debug lines (source locations, their labels, the file table, DWARF sections),
    which move with every edit of the Python source even where the generated code does not change."""
    kept = []
    for line in ptx.splitlines():
        stripped = line.strip()
        if stripped.startswith(".section") and ".debug" in stripped:
            break  # the DWARF sections close the file
        if not stripped.startswith((".loc", ".file")) and not re.fullmatch(r"\$L__tmp\d+:", stripped):
            kept.append(line)  # (``$L__tmp`` labels only anchor the line table)
    return "\n".join(kept) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    parser.add_argument("--resources", action="store_true", help="also print registers / spills (ptxas -v)")
    parser.add_argument("--only", action="append", default=[],
                        help="compile only the variants whose name contains this (repeatable: any of them)")
    parser.add_argument("--ptx", type=Path, help="write each variant's PTX to this directory")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: compiling needs JIT kernels, not interpreted ones")
    print(f"Triton {triton.__version__} ({Path(triton.__file__).parent})", flush=True)
    variants = [launch for launch in launches() if not args.only or any(part in launch.name for part in args.only)]
    unmatched = [part for part in args.only if not any(part in launch.name for launch in variants)]
    if unmatched or not variants:  # a filter that selects nothing must not pass as "0 failed"
        parser.error(f"no launch variant's name contains {unmatched or args.only}")
    failures = 0
    for launch in variants:
        try:
            compiled, seconds = compile_launch(launch, args.arch)
            extra = f"; {resources(compiled, args.arch)}" if args.resources else ""
            if args.ptx is not None:
                args.ptx.mkdir(parents=True, exist_ok=True)
                name = re.sub(r"[^A-Za-z0-9=.]+", "_", launch.name)
                (args.ptx / f"{name}.ptx").write_text(code_only(compiled.asm["ptx"]))
            print(f"ok   {launch.name} ({seconds:.1f} s{extra})", flush=True)
        except Exception as err:  # report every failing variant, not only the first
            failures += 1
            # Triton's CompilationError holds the offending source lines and the cause: show them.
            detail = "\n       ".join(str(err).splitlines()[:20])
            print(f"FAIL {launch.name}: {type(err).__name__}: {detail}", flush=True)
    print(f"{failures} of the variants failed to compile for sm_{args.arch}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
