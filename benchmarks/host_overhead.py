"""Host time of one fused decoding step: everything but the kernels.

    python -m benchmarks.host_overhead        # B in {1, 256}, V = 50257, every strategy

Small batches on a GPU pay the wrapper's Python per step — argument checks, launch arithmetic,
output allocations, the launch calls and any read of the flags — and the H100 run measured that
share at ~0.05–0.1 ms of 0.1–0.5 ms steps. This times a cached ``DecodingStep`` (what ``generate``
calls: set up once, flags left on the device; target ≤ 25 µs at B = 1) and ``sample(impl="triton")``
(set up and flags read per call) with every decoding kernel replaced by a no-op, so what remains is
the wrapper alone (on CPU tensors the fused
path is enabled as in Triton's interpreter mode; on a CUDA machine, CUDA tensors). Times are
the minimum over repeats of short batches of calls: the wrapper's cost, not the machine's noise.
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch

from .decoding_cases import STRATEGIES, make_logits

# (module, kernel) pairs the fused decoding paths launch.
_KERNELS = (("row_draw", "_row_draw_kernel"), ("scan_select", "_scan_select_kernel"))


class _NoLaunch:
    """Stands in for a JIT kernel: ``kernel[grid](*args)`` does nothing (the flags keep their "no row")."""

    def __getitem__(self, grid) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def device() -> str:
    """Where the timed step's logits live: the GPU when there is one."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@contextmanager
def kernels_stubbed() -> Iterator[None]:
    """Every decoding kernel a no-op (restored on exit). On a machine without CUDA, the fused
    path is enabled as in interpreter mode (``fused_available`` reads the variable per call); with
    CUDA the variable is left alone, since Triton reads it when a kernel module is first imported
    and later GPU work in the same process must get compiled kernels."""
    import importlib

    saved_env = os.environ.get("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    modules = {name: importlib.import_module(f"nmst_fast.kernels.{name}") for name, _ in _KERNELS}
    saved = [(modules[name], kernel, getattr(modules[name], kernel)) for name, kernel in _KERNELS]
    try:
        for module, kernel, _ in saved:
            setattr(module, kernel, _NoLaunch())
        yield
    finally:
        for module, kernel, original in saved:
            setattr(module, kernel, original)
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)  # with CUDA it was never set
        else:
            os.environ["TRITON_INTERPRET"] = saved_env


def dispatch_step(top_k: Optional[int], top_p: Optional[float], logits: torch.Tensor,
                  gen: torch.Generator) -> Callable[[], torch.Tensor]:
    """One fused decoding step as a one-off call (``sample``: the step set up, its flags read), NMST
    head, t = 100, for timing inside :func:`kernels_stubbed`."""
    from nmst_fast.decoding import sample

    return lambda: sample(logits, head="nmst", eos_index=logits.shape[1] - 1, eps=1e-5, steps=100, top_k=top_k,
                          top_p=top_p, impl="triton", generator=gen)[0]


def cached_step(top_k: Optional[int], top_p: Optional[float], logits: torch.Tensor,
                gen: torch.Generator) -> Callable[[], torch.Tensor]:
    """One call of a :class:`nmst_fast.decoding.DecodingStep` built beforehand, as a decoding loop
    makes it (its flags left on the device), NMST head, t = 100."""
    from nmst_fast.decoding import DecodingStep

    step = DecodingStep(head="nmst", eos_index=logits.shape[1] - 1, vocab_size=logits.shape[1],
                        device=logits.device, eps=1e-5, top_k=top_k, top_p=top_p, impl="triton")

    def call() -> torch.Tensor:
        out = step(logits, steps=100, generator=gen, defer_checks=True)
        return out.tokens

    return call


def host_us(step: Callable[[], object], calls: int = 30, repeats: int = 30) -> float:
    """Minimum over ``repeats`` of the mean time of ``calls`` calls, in µs."""
    for _ in range(calls):
        step()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    args = parser.parse_args(argv)
    gen = torch.Generator(device=device()).manual_seed(0)
    print(f"host time per fused decoding step, kernels stubbed, {device()}, V = {args.vocab}, "
          f"torch {torch.__version__}")
    print("| B | strategy | cached step µs | `sample` µs |\n|---:|---|---:|---:|")
    with kernels_stubbed():
        for B in args.batches:
            logits = make_logits(B, args.vocab, device=device())
            for name, (k, p) in STRATEGIES.items():
                print(f"| {B} | {name} | {host_us(cached_step(k, p, logits, gen)):.1f} | "
                      f"{host_us(dispatch_step(k, p, logits, gen)):.1f} |", flush=True)


if __name__ == "__main__":
    main()
