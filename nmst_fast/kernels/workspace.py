"""Scratch memory that a one-launch decoding step keeps from one step to the next.

Each step of ``scan_select.py`` needs per-row arrival counters that start at zero and per-split
partials that live only inside the launch; allocating and filling them per step cost ≈ 5 µs of a
≈ 17 µs greedy step at 256 × 50257 (H100). So they live here, one set per (device, stream; thread
on CPU): ``sync``, int32 and **zero at rest** (the kernel resets every slot it touched, so the next
launch on the stream needs no fill; only growth allocates), and ``scratch``, uninitialized bytes
carved into the partials. Views are cached per layout.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch

# Scratch tensors start on 16-byte boundaries (vector loads of int64 keys, fp32 quads).
_ALIGN = 16
# Layouts cached per workspace before the cache starts over (one per batch size a loop sees).
_MAX_LAYOUTS = 64


@dataclass
class _Workspace:
    sync: torch.Tensor  # (capacity,) int32, zero at rest
    scratch: torch.Tensor  # (bytes,) uint8
    layouts: dict = field(default_factory=dict)


_WORKSPACES: dict[tuple, _Workspace] = {}


def _key(device: torch.device) -> tuple:
    if device.type == "cuda":
        return ("cuda", device.index, torch.cuda.current_stream(device).cuda_stream)
    return (device.type, device.index, threading.get_ident())


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def step_buffers(device: torch.device, sync_slots: int,
                 scratch: tuple[tuple[tuple[int, ...], torch.dtype], ...]) -> tuple[torch.Tensor, ...]:
    """(``sync`` ((sync_slots,) int32, zero), one tensor per ``scratch`` (shape, dtype)) for one launch
    on ``device``'s current stream. They alias the previous step's: use them for one launch only."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = _key(device)
    space = _WORKSPACES.get(key)
    layout = (sync_slots, scratch)
    views = space.layouts.get(layout) if space is not None else None
    if views is not None:
        return views
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in scratch]
    offsets, total = [], 0
    for nbytes in sizes:
        offsets.append(total)
        total += _aligned(nbytes)
    if space is None or space.sync.numel() < sync_slots or space.scratch.numel() < total:
        space = _grown(space, sync_slots, total, device)
        _WORKSPACES[key] = space
    if len(space.layouts) >= _MAX_LAYOUTS:
        space.layouts.clear()
    views = (space.sync[:sync_slots],) + tuple(
        space.scratch[start:start + nbytes].view(dtype).view(shape)
        for (shape, dtype), start, nbytes in zip(scratch, offsets, sizes))
    space.layouts[layout] = views
    return views


def _grown(space: _Workspace | None, sync_slots: int, nbytes: int, device: torch.device) -> _Workspace:
    """A workspace holding at least ``sync_slots`` and ``nbytes``: parts big enough are kept, the others
    at least doubled."""
    sync = space.sync if space is not None and space.sync.numel() >= sync_slots else torch.zeros(
        max(sync_slots, 64, 0 if space is None else 2 * space.sync.numel()), dtype=torch.int32, device=device)
    scratch = space.scratch if space is not None and space.scratch.numel() >= nbytes else torch.empty(
        max(nbytes, 4096, 0 if space is None else 2 * space.scratch.numel()), dtype=torch.uint8, device=device)
    return _Workspace(sync, scratch)


def release() -> None:
    """Drop every workspace (the memory returns to PyTorch's allocator)."""
    _WORKSPACES.clear()
