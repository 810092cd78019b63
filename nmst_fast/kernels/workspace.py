"""Scratch memory that a one-launch decoding step keeps from one step to the next.

Each step of ``scan_select.py`` needs per-row arrival counters that start at zero and per-split
partials that live only inside the launch; allocating and filling them per step cost ≈ 5 µs of a
≈ 17 µs greedy step at 256 × 50257 (H100). So they are kept per (device, stream; thread on CPU) and
layout: ``sync``, int32 and **zero at rest** (the kernel resets every slot it touched, so the next
launch on the stream needs no fill), and the partials, uninitialized. A launch captured in a CUDA
graph keeps its buffers until the stream has seen more than _MAX_LAYOUTS layouts or :func:`release`.
"""

from __future__ import annotations

import threading

import torch

# Layouts kept per stream before the cache starts over (one per batch size a loop sees).
_MAX_LAYOUTS = 64
_BUFFERS: dict[tuple, dict[tuple, tuple[torch.Tensor, ...]]] = {}


def stream_key(device: torch.device) -> tuple:
    """Whose buffers a launch on ``device`` uses: its CUDA stream's, or (CPU) its thread's."""
    if device.type == "cuda":
        return ("cuda", device.index, torch.cuda.current_stream(device).cuda_stream)
    return (device.type, device.index, threading.get_ident())


def step_buffers(device: torch.device, sync_slots: int,
                 scratch: tuple[tuple[tuple[int, ...], torch.dtype], ...]) -> tuple[torch.Tensor, ...]:
    """(``sync`` ((sync_slots,) int32, zero), one tensor per ``scratch`` (shape, dtype)) for one launch
    on ``device``'s current stream: the previous launch's of this layout, so use them for one launch."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    layouts = _BUFFERS.setdefault(stream_key(device), {})
    buffers = layouts.get((sync_slots, scratch))
    if buffers is None:
        if len(layouts) >= _MAX_LAYOUTS:
            layouts.clear()
        buffers = layouts[sync_slots, scratch] = (
            torch.zeros(sync_slots, dtype=torch.int32, device=device),
            *(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in scratch))
    return buffers


def release() -> None:
    """Drop every buffer (the memory returns to PyTorch's allocator)."""
    _BUFFERS.clear()
