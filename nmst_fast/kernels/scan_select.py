"""Greedy, sampling and top-k in one launch: the split-V scan, each row finished by its last split.

Every scan program (``row_scan.py``) stores its partials and counts itself in for its row (an
acquire-release atomic at GPU scope); the last to arrive finishes the row (``row_select.py``), so a
row's finish overlaps the other rows' reads (a separate merge launch doubled the step at B = 32 on an
H100). The arrival counters and a draw's count of finished rows live in the step workspace
(``workspace.py``), zero at rest: the last arrival zeroes its row's counter, and the program that
finishes the batch zeroes the count and advances the RNG state's calls (``step_common.philox_key``),
so the next call, or a replay of a captured one, draws afresh. Bad rows are atomic_min'ed into the
flags, which may collect several calls' rows (a deferred step's pair).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .host_math import next_power_of_2
from .row_scan import FINISH_KEYS, scan_launch, scan_split
from .row_select import select_candidate_rows, select_rows
from .step_common import HEAD_CODES, Outputs, Selection, advance_calls, head_inputs, philox_key, rng_state, split_f64


@triton.jit
def _scan_select_kernel(
    z_ptr, z_row_stride, n_rows, V, split_width, eos_index, inv_temp, seed_ptr, max_ptr, sum_ptr, top_val_ptr,
    top_idx_ptr, draw_idx_ptr, key_ptr,  # the scan's arguments (row_scan.scan_split)
    temp_hi, temp_lo, log1m_eps_hi, log1m_eps_lo, steps_ptr, steps_stride, steps_value, state_ptr, state_stride,
    top_k, top_p_hi, top_p_lo,  # K > 0 only: the truncation
    finish_seed_ptr,  # the draw's RNG state: the scan's when it draws (K = 0), the candidates' draw's (K > 0)
    token_ptr, log_prob_ptr, new_state_ptr,
    flags_ptr,  # (2,) int32: the first bad row is atomic_min'ed into [0]
    # (1 + n_rows,) int32, zero at entry and at exit: rows finished (a drawing step), one arrival
    # counter per row
    sync_ptr,
    HAS_EOS: tl.constexpr, DRAW: tl.constexpr, K: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
    LANE_TILES: tl.constexpr, HEAD: tl.constexpr, STEPS_PER_ROW: tl.constexpr, HAS_STATE: tl.constexpr,
    HAS_TOP_P: tl.constexpr, BLOCK_S: tl.constexpr,
):
    scan_split(z_ptr, z_row_stride, n_rows, V, split_width, eos_index, inv_temp, seed_ptr, max_ptr, sum_ptr,
               top_val_ptr, top_idx_ptr, draw_idx_ptr, key_ptr, HAS_EOS, DRAW, K, BLOCK_B, BLOCK_V, LANE_TILES)
    n_splits = tl.num_programs(1)
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < n_rows
    split = tl.arange(0, BLOCK_S)  # the rows' (row, split) partials
    part = rows.to(tl.int64)[:, None] * n_splits + split[None, :]
    part_ok = row_ok[:, None] & (split[None, :] < n_splits)
    # The head's inputs and the RNG state are no program's output: every split loads them before counting in.
    s, t, prev = head_inputs(z_ptr, z_row_stride, rows, row_ok, eos_index, steps_ptr, steps_stride, steps_value,
                             state_ptr, state_stride, HEAD, STEPS_PER_ROW, HAS_STATE, BLOCK_B)
    key = philox_key(finish_seed_ptr, 1) if DRAW or K > 0 else 0
    if n_splits > 1:
        # Stores before the barrier, the barrier before the release: the last arrival sees every partial.
        tl.debug_barrier()
        arrived = tl.atomic_add(sync_ptr + 1 + rows, 1, mask=row_ok, sem="acq_rel", scope="gpu")
        finishes = row_ok & (arrived == n_splits - 1)
        # Every split has counted in: back to zero for the next launch (no other access this launch).
        tl.store(sync_ptr + 1 + rows, 0, mask=finishes)
    else:
        finishes = row_ok
    n_finished = tl.sum(finishes.to(tl.int32), axis=0)
    if n_finished > 0:
        tl.debug_barrier()
        part_ok = part_ok & finishes[:, None]
        if K == 0:
            first_bad = select_rows(rows, finishes, part, part_ok, s, t, prev, n_rows, V, max_ptr, sum_ptr, top_val_ptr,
                                    draw_idx_ptr if DRAW else top_idx_ptr, eos_index, temp_hi, temp_lo, log1m_eps_hi,
                                    log1m_eps_lo, key, token_ptr, log_prob_ptr, new_state_ptr, HEAD, not DRAW)
        else:
            first_bad = select_candidate_rows(
                rows, finishes, part, part_ok, s, t, prev, n_rows, n_splits, max_ptr, sum_ptr, key_ptr,
                eos_index, log1m_eps_hi, log1m_eps_lo, top_k, top_p_hi, top_p_lo, key, token_ptr, log_prob_ptr,
                new_state_ptr, HEAD, HAS_TOP_P, K, BLOCK_B, BLOCK_S)
        if first_bad < n_rows:
            tl.atomic_min(flags_ptr, first_bad, sem="relaxed", scope="gpu")
        if DRAW or K > 0:
            # The program finishing the batch's last rows, after every program has read the RNG state
            # (each read precedes its count): the next call's state, and the count back to zero.
            done = tl.atomic_add(sync_ptr, n_finished, sem="acq_rel", scope="gpu") + n_finished
            if done == n_rows:
                tl.store(sync_ptr, 0)
                advance_calls(finish_seed_ptr)


def scan_select(
    z: torch.Tensor,
    *,
    head: str,
    eos_index: int,
    eps: float,
    temperature: float,
    steps: int | torch.Tensor,
    state: Optional[torch.Tensor],
    seed: Optional[torch.Tensor],
    top_k: Optional[int] = None,
    top_p_threshold: Optional[float] = None,
    launch: tuple[int, int] | None = None,
    flags: Optional[torch.Tensor] = None,
) -> Selection:
    """One token per row of (B, V) ``z`` in one launch: greedy (``seed`` None), exact sampling, or with
    ``top_k`` the top-k (then top-p) truncated draw.

    Args:
        z: (B, V) fp32/bf16/fp16 logits with unit stride along V (any row stride, 0 included).
        head: "va" | "nmst" | "st"; eos_index, eps: the head's; temperature divides non-eos logits.
        steps: t of this step: an int, or a (B,) int64 tensor (stride 0 allowed).
        state: "st" only: (B,) float64 running log(1 − α) before this step (None: 0).
        seed: the draw's seed (None: greedy): an int, a one-element integer tensor, or a (3,) int64 RNG
            state (``step_common.rng_state``) that the launch advances.
        top_k: keep the k most probable tokens, then ranks while the mass before them is below
            ``top_p_threshold`` (top_p less the caller's rounding slack).
        launch: (BLOCK_V, splits) instead of the automatic layout (≤ ``row_scan.FINISH_KEYS`` keys a row).
        flags: a (2,) int32 tensor the kernel atomic_mins bad rows into (None: a new one at B).
    Returns:
        :class:`step_common.Selection`; ``flags[0]`` < B: the first row with no distribution.
    """
    B, V = z.shape
    if top_k is not None and seed is None:
        raise ValueError("a top-k draw needs a seed")
    if top_k is not None and top_k < 1:  # (k >= V keeps every token: the candidates then cover the row)
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    # The candidate scan draws no noise (its select kernel draws): no seed for the scan itself.
    scan = scan_launch(z, eos_index=None if head == "va" else eos_index, temperature=temperature,
                       seed=None if top_k is not None else seed, candidates=top_k or 0, launch=launch,
                       sync_slots=1 + B)
    out = Outputs(z, head, eps, steps, state, flags=flags)
    if B:
        splits = scan.grid[1]
        if scan.meta["K"] and next_power_of_2(splits) * scan.meta["K"] > FINISH_KEYS:
            raise ValueError(f"launch: {splits} splits of {scan.meta['K']} candidates exceed the finish's "
                             f"{FINISH_KEYS} keys")
        # The finish's RNG state: the scan's own (a drawing scan), the top-k draw's, or any pointer (greedy).
        finish_seed = scan.args[7] if top_k is None else rng_state(seed, z.device)
        truncation = (top_k or 0, *split_f64(top_p_threshold if top_p_threshold is not None else 1.0), finish_seed)
        try:
            _scan_select_kernel[scan.grid](
                *scan.args, *split_f64(float(temperature)), *out.head_args, *truncation, out.tokens, out.log_probs,
                out.state, out.flags, scan.sync, **scan.meta, HEAD=HEAD_CODES[head], STEPS_PER_ROW=out.steps_per_row,
                HAS_STATE=out.has_state, HAS_TOP_P=top_p_threshold is not None, BLOCK_S=next_power_of_2(splits),
            )
        except BaseException:
            # A launch that did not finish may leave counts behind: the next step must find zeros.
            scan.sync.zero_()
            raise
    return out.selection(head)
