"""Top-p alone on the CPU path, by rejection.

A token c is in the nucleus N exactly when the mass ranked strictly before it is short of p: one
sum over the row decides it, however large N is. Draw c from the distribution; keep it if it is in
N, else draw again from the tokens ranked before c (a set still holding N) — the kept token is
exactly ∝ p on N (the row draw kernel's argument, ``nmst_fast/kernels/row_draw.py``). A row may stop
after a rejection and draw from N ranked exactly among the few tokens before the candidate. Growing
a candidate list costs a selection of N's size (thousands of tokens on flat rows); rejection, a few
passes (≈ 1.1 rounds at p = 0.9 on N(0, 3²) logits).
"""

from __future__ import annotations

from typing import Optional

import torch

from .distribution import StepDistribution
from .truncation import TOP_P_SLACK, draw, inverse_cdf, truncate

PASSES_BEFORE_RANKING = 8  # passes over a row; a row rejected this often is finished by ranking (see _finish)
# A rejected row with at most this many tokens before its candidate is finished by ranking them (about
# the cost of 3 passes), not by another pass that may be rejected again.
FINISH_SIZE = 4096


class _Ranking:
    """Rows' rank keys without a float64 copy of the logits: non-eos float32 ζ compare in float32;
    eos's column is decided from its float64 ζ_eos, and an eos candidate compares by the float32 just
    below it. Float64 input ranks by the float64 log-probabilities, as ``ranked_candidates`` does."""

    def __init__(self, dist: StepDistribution):
        self.eos_index = dist.eos_index
        if dist.zeta.dtype == torch.float64:
            self.keys, self.eos_keys = dist.log_probs(), None
            self.probs = torch.exp(self.keys)
        else:
            self.keys, self.eos_keys = dist.zeta, dist.eos_zeta
            self.probs = dist.probs()

    def take(self, rows: torch.Tensor) -> "_Ranking":
        part = object.__new__(_Ranking)
        part.eos_index, part.keys, part.probs = self.eos_index, self.keys[rows], self.probs[rows]
        part.eos_keys = None if self.eos_keys is None else self.eos_keys[rows]
        return part

    def before(self, candidates: torch.Tensor) -> torch.Tensor:
        """(R, V) bool: the tokens of each row ranked strictly before its candidate (R,): a higher key,
        or an equal one at a lower index (the index rule runs only on rows with a tie)."""
        key = self.keys.gather(1, candidates.unsqueeze(1))
        tie_index = candidates
        if self.eos_keys is not None:
            eos = candidates == self.eos_index
            nearest = self.eos_keys.to(self.keys.dtype)  # the largest key <= ζ_eos ranks just after eos
            below = torch.where(nearest.to(torch.float64) > self.eos_keys,
                                torch.nextafter(nearest, nearest.new_tensor(-torch.inf)), nearest)
            key = torch.where(eos.unsqueeze(1), below.unsqueeze(1), key)
            # Below an inexact ζ_eos no token ties with it: a tie index of 0 ranks none of them first.
            tie_index = torch.where(eos & (below.to(torch.float64) != self.eos_keys), 0, candidates)
        before = self.keys > key
        tied = self.keys == key
        if self.eos_keys is not None:  # eos's column: its exact ζ against the candidate's key
            candidate_keys = key.squeeze(1).to(torch.float64)
            eos_first = (self.eos_keys > candidate_keys) | ((self.eos_keys == candidate_keys)
                                                             & (self.eos_index < tie_index))
            before[:, self.eos_index] = eos_first & (candidates != self.eos_index)
            tied[:, self.eos_index] = candidates == self.eos_index
        with_ties = (torch.count_nonzero(tied, dim=1) > 1).nonzero().squeeze(1)
        if with_ties.numel():
            columns = torch.arange(self.keys.shape[1])
            lower = columns < tie_index[with_ties].unsqueeze(1)
            before[with_ties] |= tied[with_ties] & lower
        return before


def nucleus_by_rejection(
    dist: StepDistribution,
    top_p: float,
    generator: Optional[torch.Generator],
    *,
    known_members: Optional[torch.Tensor] = None,
    rounds: int = PASSES_BEFORE_RANKING,
    finish_size: int = FINISH_SIZE,
) -> torch.Tensor:
    """One token per row (B,) int64 from the top-p nucleus of ``dist`` (CPU tensors), by rejection.

    Args:
        top_p: in (0, 1): the nucleus is the shortest rank-order prefix with mass >= p.
        generator: source of the uniforms (float64, one per row and round).
        known_members: (B, C) int64 tokens known to be in each row's nucleus; a first draw among
            them is kept without a pass over the row.
        rounds: passes over a row at most; a row rejected in the last one is finished by ranking.
        finish_size: see FINISH_SIZE.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    B = dist.zeta.shape[0]
    ranking = _Ranking(dist)
    work = torch.cumsum(ranking.probs, dim=1)  # round 0 draws from it; round 1 reuses its memory
    candidates = inverse_cdf(work, generator).squeeze(1)
    tokens = candidates.clone()
    rows = torch.arange(B)
    if known_members is not None:
        pending = ~(known_members == candidates.unsqueeze(1)).any(dim=1)
        if not bool(pending.all()):
            rows, ranking, candidates = rows[pending], ranking.take(pending), candidates[pending]
    zero = ranking.probs.new_zeros(())
    for round_no in range(rounds):
        if rows.numel() == 0:
            break
        before = ranking.before(candidates)
        weights = torch.where(before, ranking.probs, zero, out=work[: rows.numel()]) if round_no == 0 else \
            torch.where(before, ranking.probs, zero)
        # Keep c if the mass strictly before it is short of p (the reference's rule and slack).
        rejected = weights.sum(dim=1) >= top_p - TOP_P_SLACK
        counts = torch.count_nonzero(before, dim=1)
        finish = rejected & ((counts <= finish_size) | (round_no == rounds - 1))
        if bool(finish.any()):
            done = finish.nonzero().squeeze(1)
            tokens[rows[done]] = _finish(ranking, done, before[done], counts[done], top_p, generator)
        going_on = (rejected & ~finish).nonzero().squeeze(1)
        rows, ranking = rows[going_on], ranking.take(going_on)
        candidates = inverse_cdf(torch.cumsum(weights[going_on], dim=1), generator).squeeze(1)
        tokens[rows] = candidates
    return tokens


def _finish(ranking: _Ranking, rows: torch.Tensor, before: torch.Tensor, counts: torch.Tensor, top_p: float,
            generator: Optional[torch.Generator]) -> torch.Tensor:
    """A fresh draw (R,) from the nucleus of rows ``rows`` (R,), which lies within ``before`` (R, V)
    bool (``counts`` (R,) tokens each): those tokens ranked exactly, then truncated."""
    R, n = counts.shape[0], int(counts.max())
    row_of, column = before.nonzero(as_tuple=True)  # row-major: columns ascend within a row
    slot = torch.arange(column.numel()) - (torch.cumsum(counts, 0) - counts)[row_of]
    columns = torch.zeros(R, n, dtype=torch.long)
    columns[row_of, slot] = column
    padding = torch.arange(n).unsqueeze(0) >= counts.unsqueeze(1)
    at = (rows.unsqueeze(1), columns)  # only the listed entries are read, no copy of the rows
    keys = ranking.keys[at].to(torch.float64)
    if ranking.eos_keys is not None:
        keys = torch.where(columns == ranking.eos_index, ranking.eos_keys[rows].unsqueeze(1), keys)
    keys = keys.masked_fill(padding, -torch.inf)
    probs = ranking.probs[at].masked_fill(padding, 0.0)
    order = torch.sort(keys, dim=1, descending=True, stable=True).indices  # ties keep the lower column
    kept, _ = truncate(probs.gather(1, order), None, top_p)
    return columns.gather(1, order).gather(1, draw(kept, generator)).squeeze(1)
