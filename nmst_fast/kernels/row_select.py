"""A row's finish from the scan's partials, with the head's float64 math in-kernel.

The row's last split to finish (``scan_select.py``) merges the splits (L in fp64 from the fp32
partials; the best non-eos value and index, or the K best candidate keys), computes the head's
scalars (``step_common.py``) and picks: eos against the greedy winner, one inverse-CDF draw over eos
and the splits' masses (whose own draw is the token), or top-k then top-p over the candidates with
eos merged in. It stores the token, its log-probability and ST's state, and returns the first row
without a distribution.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .step_common import crossing_with, decode_column_keys, survival_terms, uniform_f64, with_lse


@triton.jit
def _load_partial(ptr, part, part_ok, other):
    """One partial per (row, split), through L2 only (.cg): other programs stored it during this launch."""
    return tl.load(ptr + part, mask=part_ok, other=other, cache_modifier=".cg")


@triton.jit
def _merged_lse(m, total, row_ok):
    """L per row in fp64 from the fp32 per-split max ``m`` and sum ``total`` (padding: −inf and 0)."""
    total = total.to(tl.float64)
    row_max = tl.where(row_ok, tl.max(m, axis=1), 0.0)  # padding rows: finite junk, no log(0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = tl.sum(total * tl.exp((m - shift[:, None]).to(tl.float64)), axis=1)
    return row_max.to(tl.float64) + tl.log(tl.where(row_ok, row_sum, 1.0))


@triton.jit
def select_rows(
    rows, row_ok, part, part_ok, s, t, prev, n_rows, V, max_ptr, sum_ptr, pick_val_ptr, pick_idx_ptr, eos_index,
    temp_hi, temp_lo, log1m_eps_hi, log1m_eps_lo, key, token_ptr, log_prob_ptr, new_state_ptr,
    HEAD: tl.constexpr, GREEDY: tl.constexpr,
):
    """Greedy or sampling for ``rows`` (``row_ok``) from the partials at ``part`` (rows × splits
    offsets, ``part_ok``), the rows' :func:`head_inputs` and the draw's Philox ``key``: stores each row's
    token and log-probability; returns the first row without a distribution (``n_rows``: none)."""
    # Every load before any math: one round trip, under which the survival terms run.
    split_max = _load_partial(max_ptr, part, part_ok, float("-inf"))
    split_sum = _load_partial(sum_ptr, part, part_ok, 0.0)
    # Greedy: each split's largest raw z and its first column; a drawing scan: each split's drawn
    # column and its raw z.
    pick_vals = _load_partial(pick_val_ptr, part, part_ok, float("-inf") if GREEDY else 0.0)
    pick_idxs = _load_partial(pick_idx_ptr, part, part_ok, V if GREEDY else 0)
    survival = survival_terms(s, t, prev, rows, row_ok, log1m_eps_hi, log1m_eps_lo, new_state_ptr, HEAD)
    log_norm, eos_zeta, bad = with_lse(_merged_lse(split_max, split_sum, row_ok), survival, HEAD)
    temperature = tl.cast(temp_hi, tl.float64) + tl.cast(temp_lo, tl.float64)
    if GREEDY:
        # The largest raw z over the splits (raw z, so rounding of z / T cannot make the pick depend on
        # the split layout), ties → first index.
        best = tl.max(pick_vals, axis=1)
        idx = tl.min(tl.where(pick_vals == best[:, None], pick_idxs, V), axis=1)
        chosen = tl.where(best == float("-inf"), 0.0, best.to(tl.float64)) / temperature
        # Eos against the pick's z / T in float64; eos wins a tie when its index is lower.
        best64 = tl.where(best == float("-inf"), float("-inf"), chosen)
        eos_wins = (eos_zeta > best64) | ((eos_zeta == best64) & (eos_index < idx))
    else:
        # Inverse CDF over eos and the splits' masses; the split's own draw is the token.
        split_mass = tl.where(split_sum > 0.0,
                              split_sum.to(tl.float64) * tl.exp(split_max.to(tl.float64) - log_norm[:, None]), 0.0)
        p_eos = tl.exp(eos_zeta - log_norm)  # 0 for VA (ζ_eos = −inf)
        goal = uniform_f64(key, rows) * (p_eos + tl.sum(split_mass, axis=1))
        split_no = tl.arange(0, part.shape[1])[None, :]
        split, idx = crossing_with(tl.cumsum(split_mass, axis=1), split_mass, goal - p_eos, split_no, part.shape[1],
                                   pick_idxs, 0)
        eos_wins = (goal < p_eos) | (split < 0)  # split < 0: no non-eos mass (a certain eos)
        chosen = tl.sum(tl.where(split_no == split[:, None], pick_vals, 0.0), axis=1).to(tl.float64) / temperature
    eos_wins = eos_wins & (HEAD != 0)  # VA: no eos column (its eos_index is -1)
    token = tl.where(eos_wins, eos_index, idx).to(tl.int64)
    log_prob = tl.where(eos_wins, eos_zeta, chosen) - log_norm
    tl.store(token_ptr + rows, token, mask=row_ok)
    tl.store(log_prob_ptr + rows, log_prob, mask=row_ok)
    return tl.min(tl.where(bad & row_ok, rows, n_rows), axis=0)


@triton.jit
def select_candidate_rows(
    rows, row_ok, part, part_ok, s, t, prev, n_rows, n_splits, max_ptr, sum_ptr, key_ptr,
    eos_index, log1m_eps_hi, log1m_eps_lo, top_k, top_p_hi, top_p_lo, key, token_ptr, log_prob_ptr,
    new_state_ptr, HEAD: tl.constexpr, HAS_TOP_P: tl.constexpr, K: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Top-k (``top_k``) then top-p on the K best non-eos candidate keys (``key_ptr``) plus eos, and one
    draw; the rest as :func:`select_rows`."""
    split_max = _load_partial(max_ptr, part, part_ok, float("-inf"))
    split_sum = _load_partial(sum_ptr, part, part_ok, 0.0)
    rank = tl.arange(0, K)
    key_row = key_ptr + rows.to(tl.int64)[:, None] * (n_splits * K)
    slot = tl.arange(0, BLOCK_S * K)
    keys = tl.load(key_row + slot[None, :], mask=row_ok[:, None] & (slot[None, :] < n_splits * K),
                   other=-9223372036854775808, cache_modifier=".cg")
    survival = survival_terms(s, t, prev, rows, row_ok, log1m_eps_hi, log1m_eps_lo, new_state_ptr, HEAD)
    lse = _merged_lse(split_max, split_sum, row_ok)

    # The K best keys over all splits, in rank order (keys sort as (value desc, column asc)).
    if BLOCK_S > 1:  # one split's keys are stored in rank order
        keys = tl.topk(keys, K, dim=1)
    zeta, cols = decode_column_keys(keys)

    log_norm, eos_zeta, bad = with_lse(lse, survival, HEAD)
    if HEAD == 0:
        eos_pos = tl.full((BLOCK_B,), K, tl.int32)  # VA's eos is an ordinary candidate
    else:
        # eos follows every candidate with a higher ζ, or an equal ζ and a lower column.
        outranks_eos = (zeta > eos_zeta[:, None]) | ((zeta == eos_zeta[:, None]) & (cols < eos_index))
        eos_pos = tl.sum(outranks_eos.to(tl.int32), axis=1)
    # Rank of each candidate once eos is merged in (eos sits at eos_pos).
    merged_rank = rank[None, :] + (rank[None, :] >= eos_pos[:, None]).to(tl.int32)
    prob = tl.exp(zeta - log_norm[:, None])
    prob_eos = tl.where(bad, 0.0, tl.exp(eos_zeta - log_norm))  # VA: ζ_eos = −inf, 0
    prob = tl.where(merged_rank < top_k, prob, 0.0)
    prob_eos = tl.where(eos_pos < top_k, prob_eos, 0.0)
    mass = tl.sum(prob, axis=1) + prob_eos
    mass = tl.where(mass > 0.0, mass, 1.0)  # padding rows of the block
    prob = prob / mass[:, None]
    prob_eos = prob_eos / mass
    if HAS_TOP_P:
        threshold = tl.cast(top_p_hi, tl.float64) + tl.cast(top_p_lo, tl.float64)
        # Keep a rank while the mass strictly before it (in merged order) is short of p;
        # rank 0 always stays.
        before = tl.cumsum(prob, axis=1) - prob + tl.where(rank[None, :] >= eos_pos[:, None], prob_eos[:, None], 0.0)
        before_eos = tl.sum(tl.where(rank[None, :] < eos_pos[:, None], prob, 0.0), axis=1)
        # The ranks before the first that reaches p: a prefix even where the GPU's scan is not monotone.
        cut_rank = tl.min(tl.where((before >= threshold) & (merged_rank != 0), rank[None, :], K), axis=1)
        prob = tl.where(rank[None, :] < cut_rank[:, None], prob, 0.0)
        prob_eos = tl.where((before_eos < threshold) | (eos_pos == 0), prob_eos, 0.0)

    # Inverse-CDF draw over the kept mass: eos first, then the candidates in rank order.
    u = uniform_f64(key, rows) * (tl.sum(prob, axis=1) + prob_eos)
    last_kept = tl.max(tl.where(prob > 0.0, rank[None, :], -1), axis=1)
    eos_drawn = ((u < prob_eos) | (last_kept < 0)) & (HEAD != 0)
    crossed = (tl.cumsum(prob, axis=1) > (u - prob_eos)[:, None]) & (prob > 0.0)  # see crossing_with
    pick = tl.min(tl.where(crossed, rank[None, :], K), axis=1)
    pick = tl.where(pick < K, pick, last_kept)  # rounding at the top of the CDF
    at_pick = rank[None, :] == pick[:, None]
    pick_col = tl.sum(tl.where(at_pick, cols, 0), axis=1)
    pick_zeta = tl.sum(tl.where(at_pick, zeta, 0.0), axis=1)
    token = tl.where(eos_drawn, eos_index, pick_col)
    log_prob = tl.where(eos_drawn, eos_zeta, pick_zeta) - log_norm
    tl.store(token_ptr + rows, token, mask=row_ok)
    tl.store(log_prob_ptr + rows, log_prob, mask=row_ok)
    return tl.min(tl.where(bad & row_ok, rows, n_rows), axis=0)


