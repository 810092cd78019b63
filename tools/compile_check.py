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

from nmst_fast.kernels import nucleus, row_draw, row_scan, row_select, scale_cast, scan_select, split_softmax
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
    # Every lane depth of the candidate scans in fp32 (K = 4: 2 values per lane, 16 and 32: 3, 64 and
    # 128: 4; from 32 on the list by tl.topk); bf16 loads at the ends.
    variants = [(dtype, seed, K) for dtype in (torch.float32, torch.bfloat16)
                for seed, K in ((None, 0), (7, 0), (None, 4), (None, 128))]
    variants += [(torch.float32, None, K) for K in (16, 32, 64)]
    for dtype, seed, K in variants:
        label = f"row_scan {str(dtype)[6:]} {'draw' if seed else 'no draw'} K={K}"
        # The shape of a GPU launch at 256 x 50257 (the CPU call sees V = 1000): tile width, and
        # a lane's columns per split for the draw.
        _, block_v, splits = row_scan.cuda_launch_shape(256, 50257, K, H100_SMS)
        lane_tiles = scan_width(cdiv(cdiv(50257, splits), block_v)) if seed else 1
        out.append(_record(row_scan, "_row_scan_kernel",
                           lambda: row_scan.scan_partials(z.to(dtype), eos_index=5, seed=seed, candidates=K),
                           label, dict(BLOCK_B=1, BLOCK_V=block_v, LANE_TILES=lane_tiles)))
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
    # Its top-k finish at the GPU layouts of 256 x 50257 (small K: 2 splits, large K: 1) and of B = 1
    # (small K: 50 splits; larger K take the two-launch path there), up to the largest K its finish holds.
    for head, top_k, top_p, batch in (("nmst", 4, None, 256), ("st", 3, 0.5, 256), ("va", 4, 0.9, 1),
                                      ("nmst", 50, None, 256), ("nmst", 100, 0.9, 256)):
        K = max(2, 1 << (top_k - 1).bit_length())
        _, block_v, splits = row_scan.cuda_launch_shape(batch, 50257, K, H100_SMS)
        block_s = next_power_of_2(splits)
        label = f"scan_select {head} top_k={top_k} top_p={top_p} splits={splits}"
        out.append(_record(scan_select, "_scan_select_kernel", lambda: scan_select.scan_select(
            z, head=head, eos_index=5, eps=1e-5, temperature=1.0, steps=3,
            state=torch.zeros(4, dtype=torch.float64) if head == "st" else None, seed=torch.tensor([3]),
            top_k=top_k, top_p_threshold=top_p),
            label, dict(BLOCK_B=1, BLOCK_V=block_v, BLOCK_S=block_s), dict(num_warps=row_scan._num_warps(K))))
    scan = _fake_scan(z, 0)
    steps = torch.arange(4)
    state = torch.zeros(4, dtype=torch.float64)
    seed = torch.tensor([3])
    variants = [(head, greedy, per_row, torch.float32) for head in ("va", "nmst", "st") for greedy in (True, False)
                for per_row in (False, True)] + [("nmst", False, False, torch.bfloat16)]
    for head, greedy, per_row, dtype in variants:
        label = (f"select {head} {'greedy' if greedy else 'sampling'} steps {'tensor' if per_row else 'int'} "
                 f"{str(dtype)[6:]}")
        out.append(_record(row_select, "_select_kernel", lambda: row_select.select_from_scan(
            z.to(dtype), scan, head=head, eos_index=5, eps=1e-5, temperature=0.7, steps=steps if per_row else 3,
            state=state if head == "st" else None, seed=None if greedy else seed),
            label, dict(BLOCK_B=row_select.cuda_block_rows(4, select_candidates=False), BLOCK_S=4)))
    # More rows than one program takes: a fill of the flags first, then atomics (the rest store them).
    many = out[-1]
    out.append(Launch(many.name + " several programs", many.kernel, many.args, many.kwargs,
                      many.cuda_constexprs | {"STORE_FLAGS": False}))
    # Every head x truncation at a small K; the large-K shapes (the most registers, the widest
    # tl.topk: 64 splits x 128 candidates for one long row) once per head or once.
    candidate_variants = (
        [(4, 4, head, trunc) for head in ("va", "nmst", "st") for trunc in ((4, None), (3, 0.5))]
        + [(128, 4, head, (3, 0.5)) for head in ("va", "nmst", "st")] + [(128, 64, "st", (100, 0.9))])
    for K, block_s, head, (top_k, top_p) in candidate_variants:
        cand_scan = _fake_scan(z, K)
        label = f"select candidates {head} K={K} splits<={block_s} top_k={top_k} top_p={top_p}"
        block_b = row_select.cuda_block_rows(block_s * K, select_candidates=True)
        out.append(_record(row_select, "_select_candidates_kernel", lambda: row_select.select_candidates_from_scan(
            z, cand_scan, head=head, eos_index=5, eps=1e-5, steps=3, state=state if head == "st" else None,
            top_k=top_k, top_p_threshold=top_p, seed=seed),
            label, dict(BLOCK_S=block_s, BLOCK_B=block_b),
            dict(num_warps=row_select.candidate_num_warps(block_b, block_s, K))))
    out += _nucleus_launches(state, seed)
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
    # fp32 accumulators to every parameter dtype; the loss's bf16 / fp16 dh to its own dtype.
    for src_dtype, dtype in [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                             (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                             (torch.float16, torch.float16)]:
        out.append(_record(scale_cast, "_scale_cast_kernel",
                           lambda: scale_cast.scale_cast(torch.zeros(4, 3, dtype=src_dtype),
                                                         torch.ones((), dtype=torch.float64), dtype),
                           f"scale_cast {str(src_dtype)[6:]} -> {str(dtype)[6:]}", {}))
    return out


def _nucleus_launches(state: torch.Tensor, seed: torch.Tensor) -> list[Launch]:
    """The row-draw kernel (top-p by rejection; plain sampling), the nucleus cut and its draw kernel,
    for every head (fp32, and bf16 once), at the CUDA launch shape of a 128256-token vocabulary
    (the widest per-tile table)."""
    V = 128256
    z = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    cut_shape = nucleus.cuda_launch(V)
    draw_shape = nucleus.draw_launch(4, V, cut_shape["BLOCK_V"], cuda=True)
    out = []
    for head, dtype in [("va", torch.float32), ("nmst", torch.float32), ("st", torch.float32),
                        ("nmst", torch.bfloat16)]:
        cut_sink: list = []
        draw_sink: list = []
        with _recording(nucleus, "_nucleus_cut_kernel", cut_sink) as cut_kernel, \
                _recording(nucleus, "_nucleus_draw_kernel", draw_sink) as draw_kernel:
            nucleus.nucleus_select(z.to(dtype), head=head, eos_index=5, eps=1e-5, temperature=0.7, steps=3,
                                   state=state if head == "st" else None, top_p_threshold=0.9, seed=seed)
        label = f"{head} {str(dtype)[6:]}"
        out.append(Launch(f"nucleus cut {label}", cut_kernel, *cut_sink[0], *_blocks_and_options(cut_shape)))
        draw_blocks, draw_options = _blocks_and_options(draw_shape | {"BLOCK_V": cut_shape["BLOCK_V"]})
        out.append(Launch(f"nucleus draw {label}", draw_kernel, *draw_sink[0], draw_blocks, draw_options))
        for mode, top_p in (("top-p", 0.9), ("sampling", None)):
            out.append(_record_row_draw(z.to(dtype), head=head, state=state if head == "st" else None,
                                        temperature=0.7, top_p=top_p, seed=seed, label=f"row draw {mode} {label}"))
        # Top-p over more rows than SMs: two compact programs per SM, capped at 128 registers.
        out.append(_record_row_draw(z.to(dtype), head=head, state=state if head == "st" else None, temperature=0.7,
                                    top_p=0.9, seed=seed, label=f"row draw top-p {label} compact",
                                    layout=row_draw.COMPACT_TOP_P))
    for candidates in (2, 4):  # top-p's rounds with several candidates (profile_decoding's round-candidates)
        for name, layout in row_draw.TOP_P_LAYOUTS.items():
            out.append(_record_row_draw(z, head="nmst", state=None, temperature=0.7, top_p=0.4, seed=seed,
                                        label=f"row draw top-p {candidates} candidates per round {name}",
                                        round_candidates=candidates, layout=layout))
    # The benchmarks' vocabulary: its 32-column lane tables lay out differently (the within-lane draw
    # of a round stays inside one warp), so ``--loops`` shows the rounds the H100 tables time.
    z50257 = torch.randn(4, 50257, generator=torch.Generator().manual_seed(1))
    for name, layout in row_draw.TOP_P_LAYOUTS.items():
        out.append(_record_row_draw(z50257, head="nmst", state=None, temperature=0.7, top_p=0.9, seed=seed,
                                    label=f"row draw top-p nmst float32 V=50257 {name}", layout=layout))
    return out


def _small_vocab_launches(seed: torch.Tensor) -> list[Launch]:
    """The row draw and the nucleus draw at vocabularies of one to two tiles (V divisible by 16, so
    the loads are vectorized): Triton 3.6's scan lowering failed there on an H100 until the per-tile
    table was padded (``host_math.scan_width``)."""
    out = []
    for V in (512, 1024, 4096):
        z = torch.randn(64, V, generator=torch.Generator().manual_seed(2))
        for dtype, top_p in ((torch.float32, 0.9), (torch.bfloat16, None)):
            out.append(_record_row_draw(z.to(dtype), head="nmst", state=None, temperature=1.0, top_p=top_p, seed=seed,
                                        label=f"row draw V={V} {str(dtype)[6:]} top_p={top_p}"))
        cut_shape = nucleus.cuda_launch(V)
        sink: list = []
        with (_recording(nucleus, "_nucleus_cut_kernel", []),
              _recording(nucleus, "_nucleus_draw_kernel", sink) as kernel):
            nucleus.nucleus_select(z, head="va", eos_index=5, eps=1e-5, temperature=1.0, steps=3, state=None,
                                   top_p_threshold=0.9, seed=seed)
        shape = nucleus.draw_launch(64, V, cut_shape["BLOCK_V"], cuda=True) | {"BLOCK_V": cut_shape["BLOCK_V"]}
        out.append(Launch(f"nucleus draw V={V} B=64", kernel, *sink[0], *_blocks_and_options(shape)))
    # The one-launch step with one split (a small vocabulary, or a batch of over 4 rows per SM): a
    # one-column split table in the finish's inverse CDF (``first_crossing``'s cumsum).
    for V, seed_or_none in ((400, seed), (2048, seed), (2048, None)):
        z = torch.randn(5, V, generator=torch.Generator().manual_seed(4))
        _, block_v, splits = row_scan.cuda_launch_shape(600, V, 0, H100_SMS)
        out.append(_record(scan_select, "_scan_select_kernel", lambda: scan_select.scan_select(
            z, head="nmst", eos_index=3, eps=0.05, temperature=1.0, steps=torch.arange(5), state=None,
            seed=seed_or_none), f"scan_select V={V} splits={splits} {'draw' if seed_or_none is not None else 'greedy'}",
            dict(BLOCK_B=1, BLOCK_V=block_v, BLOCK_S=splits,
                 LANE_TILES=scan_width(cdiv(V, block_v)) if seed_or_none is not None else 1)))
    return out


def _record_row_draw(z: torch.Tensor, *, head: str, state, temperature: float, top_p, seed: torch.Tensor,
                     label: str, round_candidates: Optional[int] = None, layout: Optional[dict] = None) -> Launch:
    """One row-draw launch on ``z`` at the CUDA launch shape of its vocabulary (eos at column 5, t = 3);
    ``layout``: top-p's (``row_draw.top_p_layout``), else the default's (the wide one for top-p)."""
    return _record(row_draw, "_row_draw_kernel", lambda: row_draw.draw_rows(
        z, head=head, eos_index=5, eps=1e-5, temperature=temperature, steps=3, state=state,
        top_p_threshold=top_p, seed=seed, round_candidates=round_candidates), label,
        *_blocks_and_options(row_draw.cuda_launch(z.shape[1], top_p=top_p is not None, **(layout or {}))))


_COMPILE_OPTIONS = ("num_warps", "maxnreg")


def _blocks_and_options(shape: dict) -> tuple[dict, dict]:
    """A launch dict split into its constexpr block sizes and its compile options (num_warps, maxnreg)."""
    return ({key: value for key, value in shape.items() if key not in _COMPILE_OPTIONS},
            {key: value for key, value in shape.items() if key in _COMPILE_OPTIONS})


def _fake_scan(z: torch.Tensor, K: int) -> row_scan.ScanPartials:
    """Partials of a scan's shapes and dtypes (two splits, K candidates (0: none), a draw per split), without
    running it."""
    return row_scan.ScanPartials(row_scan.empty_partials(z.shape[0], 2, K, z.device, draws=True), z.shape[1], K)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    parser.add_argument("--resources", action="store_true", help="also print registers / spills (ptxas -v)")
    parser.add_argument("--only", default="", help="compile only the variants whose name contains this")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: compiling needs JIT kernels, not interpreted ones")
    failures = 0
    for launch in launches():
        if args.only not in launch.name:
            continue
        try:
            compiled, seconds = compile_launch(launch, args.arch)
            extra = f"; {resources(compiled, args.arch)}" if args.resources else ""
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
