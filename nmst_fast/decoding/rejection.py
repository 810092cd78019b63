"""Top-p alone on the CPU path, by rejection.

The nucleus N is a prefix of the rank order (probability descending, ties → lower index),
so a token c belongs to N exactly when the mass ranked strictly before c is short of p:
one comparison and one sum over the row decide it, however large N is. Draw c from the
whole distribution; keep it if it is in N. If not, N lies inside the tokens ranked before
c, so draw again from those (∝ p) and test again. Each round's set contains N, so the
token finally kept has probability ∝ p on N, exactly (the row draw kernel's argument,
``nmst_fast/kernels/row_draw.py``). A row may also stop after any rejection and draw afresh from N,
found exactly by ranking the few tokens ranked before the rejected candidate.

Growing a ranked candidate list instead costs a partial selection of N's size, thousands
of tokens for the flat rows of an untrained model or of p = 0.9 on a wide vocabulary;
rejection costs a few passes over the row whatever N's size (≈ 1.1 rounds at p = 0.9 on
N(0, 3²) logits). Small nuclei stay on the candidate list, which finds them in one partial
selection of 64 (see :func:`nmst_fast.decoding.selection.select`).
"""

from __future__ import annotations

from typing import Optional

import torch

from .distribution import StepDistribution
from .truncation import TOP_P_SLACK, draw, inverse_cdf, truncate

PASSES_BEFORE_RANKING = 8  # passes over a row; a row rejected this often is finished by ranking (see _finish)
# A rejected row with at most this many tokens ranked before its candidate is finished by ranking
# those tokens (a scan of the mask and a sort of this size) rather than by another pass that may
# be rejected again (≈ 3 passes over the row).
FINISH_SIZE = 4096


class _Ranking:
    """Rows' rank keys without a float64 copy of the logits.

    Non-eos float32 ζ compare exactly in float32. eos's ζ is float64 and ``zeta``'s eos column is
    not it (see ``StepDistribution``), so that column is decided from the float64 value, and an
    eos candidate compares by the float32 just below its ζ. Float64 input ranks by the float64
    log-probabilities, as the reference and the candidate list do (see ``ranked_candidates``).
    """

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
        """(R, V) bool: the tokens of each row ranked strictly before its candidate (R,).

        Higher key, or an equal key at a lower index. Ties other than the candidate with
        itself are rare (equal logits), so the index rule runs only on rows that have one.
        """
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
    """Draw one token per row (B,) int64 from the top-p nucleus of ``dist`` (CPU tensors), by rejection.

    Args:
        dist: the step distribution (B rows of V).
        top_p: in (0, 1): the nucleus is the shortest rank-order prefix with mass >= p.
        generator: source of the uniforms (float64, one per row and round).
        known_members: (B, C) int64 tokens already known to be in each row's nucleus (a
            candidate list whose whole mass is short of p); a first draw among them is kept
            without a pass over the row.
        rounds: passes over a row at most; a row rejected in the last one is finished by ranking.
        finish_size: a rejected row with at most this many tokens ranked before its candidate
            is finished by ranking them at once (see FINISH_SIZE).
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
    """A fresh draw (R,) from the nucleus of the ranking's rows ``rows`` (R,), which lies within
    ``before`` (R, V) bool (the tokens ranked before a rejected candidate, ``counts`` (R,) of them):
    rank those tokens exactly (key descending, then index) and truncate, as the candidate list does."""
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
