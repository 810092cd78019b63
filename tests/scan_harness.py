"""The split-V scan on its own, for tests: its partials, and a torch merge of them.

The product runs the scan (``nmst_fast.kernels.row_scan.scan_split``) only inside the one-launch
step, whose finish merges the splits in registers. Tests check the scan's own results — every
split's logsumexp, first argmax, draw and candidate keys — against float64 here: a kernel that runs
the scan alone, and a plain torch merge of what it leaves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nmst_fast.kernels.row_scan import ScanLaunch, scan_launch, scan_split

_NO_KEY = -(2**63)


@triton.jit
def _scan_kernel(z_ptr, z_row_stride, n_rows, V, split_width, eos_index, inv_temp, seed_ptr, max_ptr, sum_ptr,
                 top_val_ptr, top_idx_ptr, draw_idx_ptr, key_ptr, HAS_EOS: tl.constexpr, DRAW: tl.constexpr,
                 K: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, LANE_TILES: tl.constexpr):
    scan_split(z_ptr, z_row_stride, n_rows, V, split_width, eos_index, inv_temp, seed_ptr, max_ptr, sum_ptr,
               top_val_ptr, top_idx_ptr, draw_idx_ptr, key_ptr, HAS_EOS, DRAW, K, BLOCK_B, BLOCK_V, LANE_TILES)


def scan_partials(z: torch.Tensor, *, eos_index: int | None, temperature: float = 1.0,
                  seed: int | torch.Tensor | None = None, candidates: int = 0,
                  launch: tuple[int, int] | None = None) -> ScanLaunch:
    """The scan of (B, V) ``z`` run alone: its launch, whose ``parts`` then hold the per-split partials
    (arguments as :func:`nmst_fast.kernels.row_scan.scan_launch`)."""
    plan = scan_launch(z, eos_index=eos_index, temperature=temperature, seed=seed, candidates=candidates,
                       launch=launch)
    if z.shape[0]:
        _scan_kernel[plan.grid](*plan.args, **plan.meta)
    return plan


def decode_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float32, columns int64) of candidate keys; padding keys decode to (-inf, -1)."""
    ordered = (keys >> 32).to(torch.int32)
    values = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).view(torch.float32)
    columns = 0x7FFFFFFF - (keys & 0xFFFFFFFF)
    padding = keys == _NO_KEY
    return values.masked_fill(padding, float("-inf")), columns.masked_fill(padding, -1)


def row_scan(z: torch.Tensor, *, eos_index: int | None, temperature: float = 1.0, candidates: int = 0,
             launch: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """The scan of (B, V) ``z`` (eos_index: the column left out; None: none), its splits merged:
    "lse" (B,) float64 logsumexp of x = z / temperature, "top_idx" (B,) the first column of the
    largest z and "top_val" its x (fp32), and with ``candidates`` "cand_val" / "cand_idx" (B, K) the
    K best x in rank order (padding -inf / -1). ``launch``: (BLOCK_V, splits)."""
    scan = scan_partials(z, eos_index=eos_index, temperature=temperature, candidates=candidates, launch=launch)
    parts, K = scan.parts, scan.meta["K"]
    m, s = parts["max"].double(), parts["sum"].double()
    row_max = m.amax(dim=1)
    shift = torch.where(row_max == float("-inf"), 0.0, row_max)
    out = {"lse": row_max + torch.log((s * torch.exp(m - shift[:, None])).sum(dim=1))}
    top_z = parts["top_val"].amax(dim=1)
    out["top_idx"] = torch.where(parts["top_val"] == top_z[:, None], parts["top_idx"].long(), z.shape[1]).amin(dim=1)
    out["top_val"] = top_z * torch.tensor(1.0 / temperature, dtype=torch.float32)
    if K:
        keys = torch.topk(parts["keys"].flatten(1), K, dim=1, sorted=True).values  # keys are distinct: an exact order
        out["cand_val"], out["cand_idx"] = decode_keys(keys)
    return out
