"""Where the fused loss's time goes on a GPU, and how the tunable choices move it.

    python -m benchmarks.profile_loss            # the first GPU shape (8192x2304x256000 bf16)
    python -m benchmarks.profile_loss --shape 1  # the second one

Prints (1) the per-kernel CUDA time of one NMST training step next to the three
GEMMs, from torch.profiler; (2) the data checks' share of a step (wall time of
back-to-back steps with and without ``validate``); (3) step time and peak memory for chunk sizes and for
dW accumulated in fp32 vs the weight's dtype, each as a ratio to the three-GEMM
floor timed in the same run; (4) achieved bandwidth of the two split-softmax row
kernels over one chunk of logits for several tilings. Times in (3) and (4) are
medians of ``triton.testing.do_bench``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

import nmst_fast
from nmst_fast import fused as fused_driver
from nmst_fast.kernels import split_softmax

from .cases import GPU_SHAPES, Inputs, make_inputs, three_gemms


def _step(x: Inputs, chunk_size: int | None = None, validate: bool = True) -> None:
    x.hidden.grad = x.weight.grad = None
    loss = nmst_fast.linear_nmst_loss(x.hidden, x.weight, x.targets, eos_index=x.eos_index, head="nmst",
                                      steps=x.steps, impl="auto", chunk_size=chunk_size, validate=validate)
    loss.backward()


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=100, rep=600, return_mode="median")


def kernel_breakdown(x: Inputs) -> None:
    from torch.profiler import ProfilerActivity, profile

    for fn in (lambda: three_gemms(x), lambda: _step(x)):
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))


def variants(x: Inputs) -> None:
    """End-to-end step for chunk sizes and the dW accumulator dtype (row kernels at their defaults)."""
    N, V = x.hidden.shape[0], x.weight.shape[0]
    floor = _bench(lambda: three_gemms(x))
    print("| variant | ms | x floor | peak GB above inputs (incl. grads) |\n|---|---:|---:|---:|\n"
          f"| three GEMMs | {floor:.2f} | 1.000 | |")
    default_rows = fused_driver.default_chunk_rows(N, V, x.hidden.dtype, x.hidden.device)
    fp32_acc = fused_driver.dw_accumulator_dtype
    configs = [(rows, acc) for rows in sorted({default_rows, -(-N // 4), -(-N // 2)})
               for acc in ("fp32", "weight dtype")]
    try:
        for rows, acc in configs:
            fused_driver.dw_accumulator_dtype = fp32_acc if acc == "fp32" else (lambda dtype: dtype)
            x.hidden.grad = x.weight.grad = None
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            _step(x, rows)
            extra = (torch.cuda.max_memory_allocated() - base) / 1e9
            ms = _bench(lambda: _step(x, rows))
            mark = " (default)" if rows == default_rows and acc == "fp32" else ""
            print(f"| chunk {rows} rows, {acc} dW{mark} | {ms:.2f} | {ms / floor:.3f} | {extra:.2f} |", flush=True)
    finally:
        fused_driver.dw_accumulator_dtype = fp32_acc


def _synchronize(x: Inputs) -> None:
    if x.hidden.is_cuda:
        torch.cuda.synchronize()


def _wall_ms(x: Inputs, fn, steps: int = 5, rounds: int = 7) -> float:
    """Median wall time per step of ``steps`` back-to-back steps (as in training and in
    ``benchmarks.report --gpu``): unlike do_bench, host stalls between steps count."""
    fn()
    _synchronize(x)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        _synchronize(x)
        times.append((time.perf_counter() - t0) / steps * 1e3)
    return statistics.median(times)


def validation_cost(x: Inputs, rounds: int = 7) -> dict[str, float]:
    """What the data checks cost a training step: their reads plus the host sync, which lets
    the GPU drain before the step's GEMMs are queued. Floor, default step, and the step with
    ``validate=False``, timed back to back in one run."""
    times = {"three GEMMs": _wall_ms(x, lambda: three_gemms(x), rounds=rounds),
             "nmst, validate=True (default)": _wall_ms(x, lambda: _step(x), rounds=rounds),
             "nmst, validate=False": _wall_ms(x, lambda: _step(x, validate=False), rounds=rounds)}
    floor = times["three GEMMs"]
    print("wall time per step, 5 steps back to back, median of rounds\n| case | ms | x floor |\n|---|---:|---:|")
    for name, ms in times.items():
        print(f"| {name} | {ms:.2f} | {ms / floor:.3f} |", flush=True)
    return times


def row_kernels(x: Inputs, rows: int) -> None:
    V = x.weight.shape[0]
    z = torch.randn(rows, V, device="cuda").to(x.hidden.dtype)
    targets = torch.randint(0, V, (rows,), device="cuda")
    stats = [torch.randn(rows, device="cuda") for _ in range(3)]
    nbytes = z.numel() * z.element_size()
    print(f"row kernels over a ({rows}, {V}) {z.dtype} chunk; GB/s counts bytes read + written")
    print("| BLOCK_V | warps | split_lse ms | GB/s | grad ms | GB/s |\n|---:|---:|---:|---:|---:|---:|")
    original = dict(split_softmax.LAUNCH)
    try:
        for block_v, warps in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16)):
            split_softmax.LAUNCH.update(lse=(block_v, warps), grad=(block_v, warps))
            lse = split_softmax.split_lse(z, targets, 0)[0].float()  # the grad kernel reads it in fp32
            t_lse = _bench(lambda: split_softmax.split_lse(z, targets, 0))
            t_grad = _bench(lambda: split_softmax.split_softmax_grad_(z, targets, lse, *stats, 0))
            print(f"| {block_v} | {warps} | {t_lse:.3f} | {nbytes / t_lse / 1e6:.0f} | {t_grad:.3f} | "
                  f"{2 * nbytes / t_grad / 1e6:.0f} |", flush=True)
    finally:
        split_softmax.LAUNCH.update(original)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, default=0, help="index into benchmarks.cases.GPU_SHAPES")
    parser.add_argument("--skip", default="",
                        help="comma-separated parts to skip: breakdown,validation,variants,kernels")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    shape = GPU_SHAPES[args.shape]
    x = make_inputs(shape)
    print(f"{shape.label()} on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    skip = set(args.skip.split(","))
    if "breakdown" not in skip:
        kernel_breakdown(x)
    if "validation" not in skip:
        validation_cost(x)
    if "variants" not in skip:
        variants(x)
    if "kernels" not in skip:
        rows = fused_driver.default_chunk_rows(shape.N, shape.V, shape.dtype, torch.device("cuda"))
        row_kernels(x, rows)


if __name__ == "__main__":
    main()
