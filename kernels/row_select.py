"""Greedy / sampled token per row from the row scan's partials, with the head math in-kernel.

``kernels/row_scan.py`` leaves, per row and V-split, the running max/sum of the
non-eos logits, the first argmax and (sampling) the Gumbel-race winner. One
small program per block of rows then does everything that is O(1) per row:

  * merge the splits: L = logsumexp over non-eos (fp64 from the fp32 partials), the
    best non-eos value/index;
  * the head's float64 scalars: a = log(1 − α_t) (NMST: logσ(−s) + t·log1p(−ε);
    ST: state + logσ(s) + log1p(−ε); context rows t <= 0: p(eos) = 0), then
    eos's effective logit ζ_eos = L + log(1 − e^a) − a and log_norm = L − a;
  * eos against the non-eos winner: by value (greedy, ties → lower index) or with
    its own Gumbel draw (sampling: the race then covers all V tokens exactly);
  * the chosen token, its log-probability, ST's new state, and the first row whose
    distribution is undefined (NaN/+inf logits, or no finite non-eos logit).

So a decoding step is two launches with no host sync in between; the caller
checks the bad-row flag once at the end. The math matches
``nmst_fast.decoding.distribution`` (the torch path) to float64 rounding.

Only exp and log are used in float64 (``expm1``/``log1p`` by Kahan's
formulas): Triton lowers those for fp64 on GPUs, and its CPU interpreter has
them too, so CI tests exactly what the GPU runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from .row_scan import ScanPartials

HEAD_CODES = {"va": 0, "nmst": 1, "st": 2}
_LN2 = 0.6931471805599453


@triton.jit
def _expm1(x):
    """exp(x) − 1 in fp64 to a few ulps (Kahan), for x <= 0."""
    u = tl.exp(x)
    um1 = u - 1.0
    plain = (um1 == 0.0) | (um1 == -1.0)  # |x| below 1 ulp of 1, or exp underflowed
    log_u = tl.log(tl.where(plain, 2.0, u))
    return tl.where(um1 == 0.0, x, tl.where(um1 == -1.0, -1.0, um1 * x / log_u))


@triton.jit
def _log1p(x):
    """log(1 + x) in fp64 to a few ulps (Kahan), for x > -1."""
    u = 1.0 + x
    um1 = u - 1.0
    return tl.where(um1 == 0.0, x, tl.log(u) * x / tl.where(um1 == 0.0, 1.0, um1))


@triton.jit
def _log_sigmoid(x):
    return tl.minimum(x, 0.0) - _log1p(tl.exp(-tl.abs(x)))


@triton.jit
def _log1mexp(a):
    """log(1 − e^a) for a <= 0 (−inf at a = 0), switching branches at −ln 2 as the torch path does."""
    near = a > -0.6931471805599453
    at_zero = a == 0.0
    near_arg = -_expm1(tl.where(near & ~at_zero, a, -0.6931471805599453))
    far = _log1p(-tl.exp(tl.where(near, -0.6931471805599453, a)))
    return tl.where(at_zero, float("-inf"), tl.where(near, tl.log(near_arg), far))


@triton.jit
def _uniform_f64(seed, offsets):
    """U(0, 1) with 53 random bits, never 0 or 1 (eos's Gumbel needs its far tail when α_t is tiny)."""
    r0, r1, _, _ = tl.randint4x(seed, offsets)
    hi = (r0.to(tl.uint32, bitcast=True) >> 5).to(tl.float64)
    lo = (r1.to(tl.uint32, bitcast=True) >> 6).to(tl.float64)
    return (hi * 67108864.0 + lo + 0.5) / 9007199254740992.0


@triton.jit
def _select_kernel(
    z_ptr,
    z_row_stride,
    n_rows,
    V,
    n_splits,
    part_row_stride,
    max_ptr,
    sum_ptr,
    pick_val_ptr,
    pick_idx_ptr,
    eos_index,
    temp_hi,
    temp_lo,
    log1m_eps_hi,
    log1m_eps_lo,
    steps_ptr,
    steps_stride,
    steps_value,
    state_ptr,
    state_stride,
    seed_ptr,
    token_ptr,
    log_prob_ptr,
    new_state_ptr,
    first_bad_ptr,
    HEAD: tl.constexpr,  # 0 va, 1 nmst, 2 st
    GREEDY: tl.constexpr,
    STEPS_PER_ROW: tl.constexpr,
    HAS_STATE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < n_rows
    split = tl.arange(0, BLOCK_S)
    part = rows.to(tl.int64)[:, None] * part_row_stride + split[None, :]
    part_ok = row_ok[:, None] & (split[None, :] < n_splits)

    # Merge the splits: L in fp64 from the fp32 partials; the best value, ties → first index.
    m = tl.load(max_ptr + part, mask=part_ok, other=float("-inf"))
    total = tl.load(sum_ptr + part, mask=part_ok, other=0.0).to(tl.float64)
    row_max = tl.where(row_ok, tl.max(m, axis=1), 0.0)  # padding rows: finite junk, no log(0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = tl.sum(total * tl.exp((m - shift[:, None]).to(tl.float64)), axis=1)
    lse64 = row_max.to(tl.float64) + tl.log(tl.where(row_ok, row_sum, 1.0))
    pick_vals = tl.load(pick_val_ptr + part, mask=part_ok, other=float("-inf"))
    pick_idxs = tl.load(pick_idx_ptr + part, mask=part_ok, other=V)
    pick = tl.max(pick_vals, axis=1)
    idx = tl.min(tl.where(pick_vals == pick[:, None], pick_idxs, V), axis=1)

    # fp64 scalars arrive as fp32 (hi, lo) pairs: Triton passes Python floats as fp32.
    temperature = tl.cast(temp_hi, tl.float64) + tl.cast(temp_lo, tl.float64)
    z_row = z_ptr + rows.to(tl.int64) * z_row_stride
    chosen = tl.load(z_row + idx, mask=row_ok & (idx < V), other=0.0).to(tl.float64) / temperature
    bad = ~(tl.abs(lse64) < float("inf"))  # NaN, +inf, or no finite non-eos logit
    if HEAD == 0:
        token = idx.to(tl.int64)
        log_prob = chosen - lse64
    else:
        s = tl.load(z_row + eos_index, mask=row_ok, other=0.0).to(tl.float64)
        bad = bad | (s != s)
        if STEPS_PER_ROW:
            t = tl.load(steps_ptr + rows.to(tl.int64) * steps_stride, mask=row_ok, other=1)
        else:
            t = tl.full((BLOCK_B,), steps_value, tl.int64)
        log1m_eps = tl.cast(log1m_eps_hi, tl.float64) + tl.cast(log1m_eps_lo, tl.float64)
        if HEAD == 1:
            a = tl.where(t >= 1, _log_sigmoid(-s) + t.to(tl.float64) * log1m_eps, 0.0)
        else:
            if HAS_STATE:
                prev = tl.load(state_ptr + rows.to(tl.int64) * state_stride, mask=row_ok, other=0.0).to(tl.float64)
            else:
                prev = tl.zeros((BLOCK_B,), tl.float64)
            a = tl.where(t >= 1, prev + _log_sigmoid(s) + log1m_eps, prev)
            tl.store(new_state_ptr + rows, a, mask=row_ok)
        log_norm = lse64 - a
        eos_zeta = lse64 + _log1mexp(a) - a
        best = pick.to(tl.float64)
        if GREEDY:
            eos_wins = (eos_zeta > best) | ((eos_zeta == best) & (eos_index < idx))
        else:
            # eos's own Gumbel draw, from the scan's Philox stream at the eos column, which the
            # scan generated but never used (eos is left out of its race).
            u = _uniform_f64(tl.load(seed_ptr), rows * V + eos_index)
            eos_wins = eos_zeta - tl.log(-tl.log(u)) > best
        token = tl.where(eos_wins, eos_index, idx).to(tl.int64)
        log_prob = tl.where(eos_wins, eos_zeta, chosen) - log_norm
    tl.store(token_ptr + rows, token, mask=row_ok)
    tl.store(log_prob_ptr + rows, log_prob, mask=row_ok)
    tl.atomic_min(first_bad_ptr, tl.min(tl.where(bad & row_ok, rows, n_rows), axis=0))


@dataclass
class Selection:
    """One token per row; every tensor is on the logits' device."""

    tokens: torch.Tensor  # (B,) int64
    log_probs: torch.Tensor  # (B,) float64 log p of each chosen token
    state: Optional[torch.Tensor]  # (B,) float64 ST's log(1 − α_t) after this step; None for other heads
    first_bad: torch.Tensor  # (1,) int32: the first row without a distribution, B when none


def _split_f64(value: float) -> tuple[float, float]:
    hi = float(np.float32(value))
    return hi, value - hi


def select_from_scan(
    z: torch.Tensor,
    scan: ScanPartials,
    *,
    head: str,
    eos_index: int,
    eps: float,
    temperature: float,
    steps: int | torch.Tensor,
    state: Optional[torch.Tensor],
    seed: Optional[torch.Tensor],
) -> Selection:
    """Finish a greedy (``seed`` None) or sampling (``seed``: the scan's seed) step.

    Args:
        z: (B, V) logits the scan read (any row stride, unit stride along V).
        scan: :func:`kernels.row_scan.scan_partials` of ``z`` (or of its first row when every
            row is the same: its partials then have one row and are shared).
        head: "va" | "nmst" | "st"; eos_index, eps, temperature as in the scan.
        steps: t of this step: an int, or a (B,) int64 tensor (stride 0 allowed).
        state: "st" only: (B,) running log(1 − α) before this step (None: 0).
        seed: one-element int64 tensor the scan raced with (None for greedy).
    """
    B, V = z.shape
    parts = scan.parts
    n_parts, n_splits = parts["max"].shape
    greedy = seed is None
    device = z.device
    tokens = torch.empty(B, dtype=torch.int64, device=device)
    log_probs = torch.empty(B, dtype=torch.float64, device=device)
    new_state = torch.empty(B if head == "st" else 1, dtype=torch.float64, device=device)
    first_bad = torch.full((1,), B, dtype=torch.int32, device=device)
    steps_per_row = isinstance(steps, torch.Tensor)
    steps_tensor = steps if steps_per_row else tokens  # any pointer when unused
    has_state = head == "st" and state is not None
    state_tensor = state if has_state else log_probs
    if B:
        block_b = min(triton.next_power_of_2(B), 128 if z.is_cuda else 1 << 16)
        _select_kernel[(triton.cdiv(B, block_b),)](
            z, z.stride(0), B, V, n_splits, 0 if n_parts == 1 and B > 1 else n_splits,
            parts["max"], parts["sum"],
            parts["top_val" if greedy else "race_val"], parts["top_idx" if greedy else "race_idx"],
            eos_index, *_split_f64(float(temperature)), *_split_f64(math.log1p(-eps)),
            steps_tensor, steps_tensor.stride(0) if steps_per_row else 0, 0 if steps_per_row else int(steps),
            state_tensor, state_tensor.stride(0) if has_state else 0,
            seed if seed is not None else first_bad,
            tokens, log_probs, new_state, first_bad,
            HEAD=HEAD_CODES[head], GREEDY=greedy, STEPS_PER_ROW=steps_per_row, HAS_STATE=has_state,
            BLOCK_B=block_b, BLOCK_S=triton.next_power_of_2(n_splits),
        )
    return Selection(tokens, log_probs, new_state if head == "st" else None, first_bad)
