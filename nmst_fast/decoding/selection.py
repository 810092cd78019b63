"""Token selection on the NMST/ST/VA step distribution in torch: greedy, top-k, top-p, sampling.

The torch path of :class:`nmst_fast.decoding.step.DecodingStep`, without a full sort of the
vocabulary. Tokens are ranked by
probability with ties broken toward the lower index, exactly:

* non-eos tokens rank by their effective logit ζ (their raw logit, up to a
  temperature), so a partial selection (``torch.topk``) finds the candidates;
  ties are then resolved exactly (see :func:`top_tokens`);
* eos is merged into that list by comparing its exact float64 ζ_eos.

Top-p alone on CPU takes one candidate list of 64 (peaked rows' nuclei fit in it) and
draws the other rows by rejection (:mod:`.rejection`: a few passes over the row whatever
the nucleus size). Elsewhere (top-k then top-p; the CUDA torch path) the candidate list
grows 4× per round until it covers mass p, so its cost follows the nucleus size, not V;
sizes that the mass still missing proves too small are skipped (a flat row's big nucleus
takes two rounds, not log₄ V).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from .distribution import StepDistribution, row_blocks_of
from .rejection import nucleus_by_rejection
from .truncation import check_truncation, draw, insert_eos, truncate, untruncated

_FIRST_CANDIDATES = 64


def _stable_top(values: torch.Tensor, k: int, exclude: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k by a full stable sort: (value desc, index asc), column ``exclude`` left out
    (moved past every other column, not masked to −inf: a row with fewer than k finite values
    would take it back among its −inf entries)."""
    order = torch.sort(values, dim=1, descending=True, stable=True).indices
    if exclude is not None:
        order = order.gather(1, torch.sort((order == exclude).to(torch.int8), dim=1, stable=True).indices)
    order = order[:, :k]
    return order, values.gather(1, order)


def top_tokens(values: torch.Tensor, k: int, exclude: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row of ``values`` (B, V), skipping column ``exclude``.

    Exact order: value descending, ties → lower index. A partial selection
    (``torch.topk``) does the work. Its tie order is unspecified: when its k + 1 values hold a
    tie, the winners are re-sorted by (value, index), and the rare rows whose k-th value is
    tied with a token *outside* the selection are redone with a stable sort.
    Returns (tokens (B, k) int64, values (B, k)).
    """
    B, V = values.shape
    available = V - (exclude is not None)
    k = min(k, available)
    if 2 * k >= available:  # most is selected: one stable sort is the simplest exact answer, and no slower
        return _stable_top(values, k, exclude)
    if exclude is not None and exclude in (0, V - 1):  # a column at an end: select from the view without it
        tokens, vals = top_tokens(values[:, 1:] if exclude == 0 else values[:, :-1], k)
        return (tokens + 1 if exclude == 0 else tokens), vals
    extra = 1 if exclude is not None else 0
    # One entry past the selection (it exists: 2k < available) shows whether a tie crosses its
    # boundary, without a pass over the row.
    vals, tokens = torch.topk(values, k + extra + 1, dim=1, sorted=True)
    if extra:  # drop eos if it was selected, else the last entry
        keep = tokens != exclude
        keep[:, -1] &= ~keep.all(dim=1)
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :k + 1]
        tokens, vals = tokens.gather(1, order), vals.gather(1, order)
    if not bool((vals[:, 1:] == vals[:, :-1]).any()):  # no tie among the k + 1: topk's order is exact
        return tokens[:, :k], vals[:, :k]
    boundary, past = vals[:, k - 1], vals[:, k]  # the k-th and (k+1)-th largest values
    tokens, vals = tokens[:, :k], vals[:, :k]
    # Order the winners by (value desc, index asc): sort by index, then stable by value.
    by_index = torch.sort(tokens, dim=1).indices
    tokens, vals = tokens.gather(1, by_index), vals.gather(1, by_index)
    by_value = torch.sort(vals, dim=1, descending=True, stable=True).indices
    tokens, vals = tokens.gather(1, by_value), vals.gather(1, by_value)
    # A tie at the boundary value is exact only if every tied token made it in: redo the rows
    # where the best token left out ties with the worst one taken.
    redo = (past == boundary).nonzero().squeeze(1)
    if redo.numel():
        tokens[redo], vals[redo] = _stable_top(values[redo], k, exclude)
    return tokens, vals


def ranked_candidates(dist: StepDistribution, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most probable tokens of every row in rank order, with their log-probabilities.

    Returns (tokens (B, k) int64, log_probs (B, k) float64); ranks by probability,
    ties → lower token index. k is capped at V.
    """
    B, V = dist.zeta.shape
    k = min(k, V)
    has_special_eos = dist.eos_zeta is not None
    if dist.zeta.dtype == torch.float64:
        # Rank by the exact float64 log-probabilities with a stable sort (the float64 path is
        # the exact one for tests and references; speed matters for float32/bf16 logits).
        return _stable_top(dist.log_probs(), k)
    tokens, values = top_tokens(dist.zeta, k, exclude=dist.eos_index if has_special_eos else None)
    zeta = values.to(torch.float64)
    if has_special_eos:
        tokens, zeta = insert_eos(tokens, zeta, dist.eos_index, dist.eos_zeta)
    log_p = zeta - dist.log_norm.unsqueeze(1)
    if has_special_eos:
        log_p = torch.where(tokens == dist.eos_index, dist.eos_log_prob.unsqueeze(1), log_p)
    return tokens[:, :k], log_p[:, :k]


def greedy(dist: StepDistribution) -> torch.Tensor:
    """Most probable token per row (B,), ties → lower index (see :func:`greedy_with_log_probs`)."""
    return greedy_with_log_probs(dist)[0]


def greedy_with_log_probs(dist: StepDistribution) -> tuple[torch.Tensor, torch.Tensor]:
    """Most probable token per row (B,) int64, ties → lower index, and its log p (B,) float64.

    The best column on each side of eos (views, no copy; :func:`first_max`), then eos against the
    winner by its exact float64 ζ_eos: a handful of ops, where a ranked list of one would cost dozens
    (they dominate at small batch). The log-probabilities are :meth:`StepDistribution.token_log_probs`'s
    values, from the winners' ζ already at hand.
    """
    if dist.eos_zeta is None:
        value, column = first_max(dist.zeta)
        return column, value.to(torch.float64) - dist.log_norm
    zeta, eos = dist.zeta, dist.eos_index
    best_val = best_idx = None
    for first, part in ((0, zeta[:, :eos]), (eos + 1, zeta[:, eos + 1:])):
        if not part.shape[1]:
            continue
        val, idx = first_max(part)
        if first:
            idx += first
        if best_idx is None:
            best_idx, best_val = idx, val
        else:  # the right side wins only if strictly larger: ties keep the lower index
            right = val > best_val
            best_idx, best_val = torch.where(right, idx, best_idx), torch.where(right, val, best_val)
    best64 = best_val.to(torch.float64)
    if eos == zeta.shape[1] - 1:  # every other token has a lower index: eos must be strictly better
        eos_wins = dist.eos_zeta > best64
    elif eos == 0:
        eos_wins = dist.eos_zeta >= best64
    else:
        eos_wins = (dist.eos_zeta > best64) | ((dist.eos_zeta == best64) & (eos < best_idx))
    return torch.where(eos_wins, eos, best_idx), torch.where(eos_wins, dist.eos_log_prob, best64 - dist.log_norm)


# torch.argmax reads a CPU row at a fraction of amax's speed (≈ 130 against 15 µs at 50257 columns):
# :func:`first_max` takes rows of at least this many blocks by their block maxima instead.
_MAX_BLOCK = 1024
_MIN_BLOCKS = 16


def first_max(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(value (B,), column (B,) int64) of the largest entry of each row of ``values`` (B, n), n >= 1,
    at its first column (as ``torch.argmax``; rows holding NaN are the callers' to refuse).

    Long CPU rows go by blocks: the maxima of the blocks (one vectorized pass; the last block ends at
    the row's end and may overlap the one before), the first block holding the row's maximum, and
    the first column of it there.
    """
    B, n = values.shape
    blocks = n // _MAX_BLOCK
    if blocks < _MIN_BLOCKS or values.device.type != "cpu" or values.stride(1) != 1:
        idx = values.argmax(dim=1, keepdim=True)
        return values.gather(1, idx).squeeze(1), idx.squeeze(1)
    body = values[:, : blocks * _MAX_BLOCK].view(B, blocks, _MAX_BLOCK).amax(dim=2)
    maxima = torch.cat([body, values[:, n - _MAX_BLOCK:].amax(dim=1, keepdim=True)], dim=1)
    best, block = maxima.max(dim=1, keepdim=True)  # the first block holding it
    start = block.mul_(_MAX_BLOCK).clamp_(max=n - _MAX_BLOCK)  # the overlapping last block starts at n − block
    window = values.unfold(1, _MAX_BLOCK, 1).gather(1, start.unsqueeze(2).expand(B, 1, _MAX_BLOCK)).squeeze(1)
    return best.squeeze(1), start.squeeze(1) + window.argmax(dim=1)


def truncated_candidates(
    dist: StepDistribution, top_k: Optional[int], top_p: Optional[float], *, first_size: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates kept by top-k then top-p, and their renormalized probabilities.

    Returns (tokens (B, C) int64, probs (B, C) float64): rows padded with probability 0.
    Top-k keeps exactly k tokens; top-p keeps the smallest prefix (in rank order) whose
    mass, renormalized over the top-k set when both are given, reaches p (at least one token).
    ``first_size``: top-p's first candidate-list size (default 64), for a caller that knows
    smaller lists cannot cover the nucleus.
    """
    V = dist.zeta.shape[1]
    k = top_k if top_k is not None else min(V, first_size or _FIRST_CANDIDATES)
    while True:
        tokens, log_p = ranked_candidates(dist, k)
        ranked_probs = torch.exp(log_p)
        probs, covered = truncate(ranked_probs, top_k, top_p)
        if top_p is None or k >= V or bool(covered.all()):  # top-k alone: its list is the answer
            return tokens, probs
        # Next size on the 4× grid, skipping sizes the missing mass proves too small.
        needed, k = k + _fewest_more(ranked_probs, top_p, V), 4 * k
        while k < min(needed, V):
            k *= 4
        k = min(V, k)


def _fewest_more(ranked_probs: torch.Tensor, top_p: float, V: int) -> int:
    """How many more ranked tokens the neediest row must take at least to reach mass ``top_p``.

    Every token past the list is at most as probable as the list's last one, so a row still
    short of p by m needs at least m / p_last more (capped at V; p_last = 0 means all of V).
    """
    missing = (top_p - ranked_probs.sum(dim=1)).clamp(min=0.0)
    last = ranked_probs[:, -1]
    bound = float(torch.where(missing > 0, missing / last, 0.0).max())  # m / 0 = inf: every token
    return V if not bound < V else math.ceil(bound)


def select(
    dist: StepDistribution,
    *,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
    first_size: Optional[int] = None,
) -> torch.Tensor:
    """Draw one token per row (B,) from ``dist`` after optional top-k / top-p truncation
    (``first_size``: see :func:`truncated_candidates`)."""
    check_truncation(top_k, top_p)
    if top_k == 1:
        return greedy(dist)
    if untruncated(top_k, top_p):
        return _by_row_blocks(dist, lambda part, rows: draw(part.probs(), generator, overwrite=True).squeeze(1))
    if top_k is None and first_size is None and dist.zeta.device.type == "cpu":
        return _top_p_on_cpu(dist, top_p, generator)
    tokens, probs = truncated_candidates(dist, top_k, top_p, first_size=first_size)
    return tokens.gather(1, draw(probs, generator)).squeeze(1)


def _top_p_on_cpu(dist: StepDistribution, top_p: float, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Top-p alone on CPU (B,): one candidate list of 64 settles the rows whose nucleus it
    covers (one partial selection: peaked rows); the rest draw by rejection
    (:mod:`.rejection`: a few passes over the row whatever the nucleus size)."""
    tokens, log_p = ranked_candidates(dist, _FIRST_CANDIDATES)
    probs, covered = truncate(torch.exp(log_p), None, top_p)
    picked = tokens.gather(1, draw(probs, generator)).squeeze(1)
    short = (~covered).nonzero().squeeze(1)
    if short.numel():
        rest = dist if short.numel() == picked.numel() else dist.take(short)
        members = tokens[short]
        picked[short] = _by_row_blocks(rest, lambda part, rows: nucleus_by_rejection(
            part, top_p, generator, known_members=members[rows]))
    return picked


def _by_row_blocks(dist: StepDistribution, pick: Callable[[StepDistribution, slice], torch.Tensor]) -> torch.Tensor:
    """(B,) ``pick(part, rows)`` on blocks of rows of ``dist`` (``part`` = those rows, as views),
    concatenated: the CPU paths that build (B, V) float64 tables do so a block at a time (see
    ``distribution.BLOCK_ENTRIES``)."""
    blocks = row_blocks_of(dist.zeta)
    if len(blocks) == 1:
        return pick(dist, blocks[0])
    return torch.cat([pick(dist.take(rows), rows) for rows in blocks])
