"""Time a decoding step as it reads logits from memory, not from a warm L2.

``triton.testing.do_bench_cudagraph`` replays one captured step after another on the same
tensor and flushes nothing, so a batch of logits that fits the GPU's L2 (50 MB on an H100:
256 × 33278 fp32 is 34 MB) is partly served from L2 on every replay after the first, and the
step looks faster than one read from memory can be — the "one read" floor the reports divide by
would no longer bound it. Here each call of the timed function reads the next of several copies
of the logits, enough copies that the ones read since a copy's last use overflow L2 several times
over: every read comes from memory, as the floor assumes. (The loss report's ``do_bench`` flushes
L2 itself; these are the graph timings of the decoding reports.)
"""

from __future__ import annotations

import math
from typing import Callable

import torch

# Copies read between two uses of one copy, in multiples of L2: LRU-like replacement keeps none
# of a copy after twice L2 has streamed through; four leaves margin for the caches' partitioning.
L2_MULTIPLE = 4
MAX_COPIES = 256  # small inputs (B = 1) would need thousands; those steps are latency-bound anyway
MAX_BYTES = 2 << 30  # the copies' memory cap


def l2_bytes(device: torch.device) -> int:
    """The device's L2 size (bytes); 0 on a CPU, where one copy serves."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.get_device_properties(device).L2_cache_size)


def copies_needed(input_bytes: int, cache_bytes: int) -> int:
    """How many copies of an input of ``input_bytes`` keep every read cold with an L2 of ``cache_bytes``."""
    if cache_bytes <= 0 or input_bytes <= 0:
        return 1
    wanted = math.ceil(L2_MULTIPLE * cache_bytes / input_bytes) + 1
    return max(1, min(wanted, MAX_COPIES, MAX_BYTES // input_bytes))


def rotating(step: Callable[[torch.Tensor], None], logits: torch.Tensor,
             cache_bytes: int | None = None) -> Callable[[], None]:
    """A zero-argument function that runs ``step`` on the next copy of ``logits`` at each call,
    cycling over :func:`copies_needed` copies (``logits`` itself first). ``cache_bytes``: the L2
    size to defeat (default: the logits' device's)."""
    cache = l2_bytes(logits.device) if cache_bytes is None else cache_bytes
    n = copies_needed(logits.numel() * logits.element_size(), cache)
    inputs = [logits] + [logits.clone() for _ in range(n - 1)]
    calls = 0

    def run() -> None:
        nonlocal calls
        step(inputs[calls % n])
        calls += 1

    run.copies = n  # for reports and tests
    return run


def cold_graph_ms(step: Callable[[torch.Tensor], None], logits: torch.Tensor) -> float:
    """Median ms of ``step(logits)`` as a CUDA graph of back-to-back steps, each on a copy not in L2."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(rotating(step, logits), return_mode="median")
