"""Scratch memory that a one-launch decoding step keeps from one step to the next.

Each step of ``nmst_fast/kernels/scan_select.py`` needs per-row arrival counters that start at zero, and
per-split partials that only live inside the launch. Allocating them per step cost the host an
allocation per buffer (a few µs each on a small step) and the device a fill launched before the
scan (the counters' start value): on an H100 the fill and the finish chain were ≈ 5 µs of a
≈ 17 µs greedy step at 256 × 50257 (measured on an H100). So they live here, one set per
(device, stream):

* ``sync``: int32, **zero at rest**. The kernel that uses it returns every slot it touched to
  zero before it ends (a row's last arrival resets the row's counter; the last row to finish
  resets the shared ones), so the next launch — ordered after this one on the same stream —
  finds zeros without a fill. Only growth allocates (``torch.zeros``, once per new maximum).
* ``scratch``: uninitialized bytes, carved into the partials' tensors.

Keyed by stream because kernels on two streams may run at once; on CPU (Triton's interpreter,
which runs a launch to completion inside the call) by thread. Views are cached per layout, so a
step with a batch size seen before costs a dictionary lookup. A step captured in a CUDA graph keeps
the workspace of its capture stream (its kernels leave it at zero on every replay too; a workspace
first made during a capture puts its zero fill into the graph, once); two such graphs must not be
replayed concurrently on different streams.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch

# Scratch tensors start on 16-byte boundaries (vector loads of int64 keys, fp32 quads).
_ALIGN = 16
# Layouts cached per workspace before the cache starts over (a decoding loop whose batch shrinks
# sees one layout per batch size; each entry holds only views).
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
    """(sync, *scratch tensors) for one launch on ``device``'s current stream.

    Args:
        device: where the launch runs.
        sync_slots: int32 slots the kernel needs zero at entry (and leaves zero at exit).
        scratch: (shape, dtype) of each uninitialized tensor the launch writes and reads.
    Returns:
        ``sync`` ((sync_slots,) int32 view, zero) then one tensor per ``scratch`` entry. They alias
        the previous step's: use them for one launch, on this stream, and do not keep them.
    """
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
    """A workspace holding at least ``sync_slots`` and ``nbytes``: the parts that are big enough are
    kept (the sync part's zeros with them), the others at least doubled, so a batch that creeps up
    does not reallocate every step."""
    sync = space.sync if space is not None and space.sync.numel() >= sync_slots else torch.zeros(
        max(sync_slots, 64, 0 if space is None else 2 * space.sync.numel()), dtype=torch.int32, device=device)
    scratch = space.scratch if space is not None and space.scratch.numel() >= nbytes else torch.empty(
        max(nbytes, 4096, 0 if space is None else 2 * space.scratch.numel()), dtype=torch.uint8, device=device)
    return _Workspace(sync, scratch)


def release() -> None:
    """Drop every workspace (the memory returns to PyTorch's allocator)."""
    _WORKSPACES.clear()
