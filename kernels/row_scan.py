"""One-read row scan for decoding: split logsumexp, first argmax, and a Gumbel-max race.

Each program takes BLOCK_B rows and walks V in BLOCK_V tiles, so a step reads the
logits once and writes O(B) scalars — no (B, V) probability tensor, no sort.

For every row, over the columns other than ``eos_index`` (all columns when HAS_EOS
is off), with x = z · inv_temp:
  * lse  = logsumexp(x)                                   (L of the NMST head)
  * top  = max(x) and its first (lowest) index            (greedy)
  * race = max(x + G) and its index, G ~ Gumbel(0, 1)     (an exact softmax sample)
G comes from counter-based Philox noise keyed on (seed, row·V + column), so a draw
does not depend on the tiling. The caller adds eos with O(B) float64 math.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_scan_kernel(
    z_ptr,
    z_row_stride,
    n_rows,
    V,
    eos_index,
    inv_temp,
    seed,
    lse_ptr,
    top_val_ptr,
    top_idx_ptr,
    race_val_ptr,
    race_idx_ptr,
    HAS_EOS: tl.constexpr,
    RACE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < n_rows
    row_base = z_ptr + rows.to(tl.int64)[:, None] * z_row_stride
    running_max = tl.full((BLOCK_B,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK_B,), tl.float32)
    top_val = tl.full((BLOCK_B,), float("-inf"), tl.float32)
    top_idx = tl.zeros((BLOCK_B,), tl.int32)
    race_val = tl.full((BLOCK_B,), float("-inf"), tl.float32)
    race_idx = tl.zeros((BLOCK_B,), tl.int32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        keep = row_ok[:, None] & (cols[None, :] < V)
        if HAS_EOS:
            keep = keep & (cols[None, :] != eos_index)
        x = tl.load(row_base + cols[None, :], mask=keep, other=float("-inf")).to(tl.float32) * inv_temp
        x = tl.where(keep, x, float("-inf"))
        tile_max = tl.max(x, axis=1)
        new_max = tl.maximum(running_max, tile_max)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # all-masked tile: avoid -inf - -inf
        running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
        running_max = new_max
        # First index of the tile maximum; a strictly larger tile max replaces the running one,
        # so ties keep the earlier (lower) index.
        tile_idx = tl.min(tl.where(x == tile_max[:, None], cols[None, :], V), axis=1)
        better = tile_max > top_val
        top_idx = tl.where(better, tile_idx, top_idx)
        top_val = tl.where(better, tile_max, top_val)
        if RACE:
            offsets = rows[:, None] * V + cols[None, :]
            # u = 0 has probability 2^-32; clamping it gives a Gumbel draw that never wins,
            # as -inf would, without taking log(0).
            u = tl.maximum(tl.rand(seed, offsets), 1e-30)
            key = tl.where(keep, x - tl.log(-tl.log(u)), float("-inf"))
            key_max = tl.max(key, axis=1)
            key_idx = tl.min(tl.where(key == key_max[:, None], cols[None, :], V), axis=1)
            won = key_max > race_val
            race_idx = tl.where(won, key_idx, race_idx)
            race_val = tl.where(won, key_max, race_val)
    # Padding rows past the batch end hold sum 0; give log a harmless argument there.
    tl.store(lse_ptr + rows, running_max + tl.log(tl.where(row_ok, running_sum, 1.0)), mask=row_ok)
    tl.store(top_val_ptr + rows, top_val, mask=row_ok)
    tl.store(top_idx_ptr + rows, top_idx, mask=row_ok)
    if RACE:
        tl.store(race_val_ptr + rows, race_val, mask=row_ok)
        tl.store(race_idx_ptr + rows, race_idx, mask=row_ok)


def row_scan(
    z: torch.Tensor, *, eos_index: int | None, temperature: float = 1.0, seed: int | None = None
) -> dict[str, torch.Tensor]:
    """Scan (B, V) logits once (see module docstring).

    Args:
        z: (B, V) fp16/bf16/fp32 logits with unit stride along V.
        eos_index: column left out of every reduction, or None to scan all columns.
        temperature: x = z / temperature.
        seed: run the Gumbel race with this Philox seed (None: no race).
    Returns:
        dict of (B,) tensors: "lse", "top_val" (fp32), "top_idx" (int64) and, with a seed,
        "race_val" (fp32), "race_idx" (int64).
    """
    if z.dim() != 2 or z.stride(1) != 1:
        raise ValueError("z must be a 2-D tensor with unit stride along V")
    B, V = z.shape
    f32 = dict(device=z.device, dtype=torch.float32)
    i32 = dict(device=z.device, dtype=torch.int32)
    out = {"lse": torch.empty(B, **f32), "top_val": torch.empty(B, **f32), "top_idx": torch.empty(B, **i32),
           "race_val": torch.empty(B, **f32), "race_idx": torch.empty(B, **i32)}
    block_v = min(2048, triton.next_power_of_2(V))
    # ~8k elements per tile suits GPU registers; the CPU interpreter pays per operation,
    # not per element, so it gets much larger tiles (CI's million-draw tests depend on it).
    tile = 8192 if z.is_cuda else 1 << 18
    block_b = max(1, min(tile // block_v, triton.next_power_of_2(B)))
    if B:
        _row_scan_kernel[(triton.cdiv(B, block_b),)](
            z, z.stride(0), B, V, -1 if eos_index is None else eos_index, 1.0 / temperature,
            0 if seed is None else seed,
            out["lse"], out["top_val"], out["top_idx"], out["race_val"], out["race_idx"],
            HAS_EOS=eos_index is not None, RACE=seed is not None, BLOCK_B=block_b, BLOCK_V=block_v,
        )
    out["top_idx"] = out["top_idx"].long()
    out["race_idx"] = out["race_idx"].long()
    if seed is None:
        del out["race_val"], out["race_idx"]
    return out
