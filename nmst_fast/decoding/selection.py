"""Token selection in torch (the torch path of :class:`nmst_fast.decoding.DecodingStep`): greedy,
top-k, top-p and sampling on the step distribution, with no full sort of the vocabulary. Tokens rank
by probability, ties → lower index, exactly: non-eos tokens by ζ (``torch.topk``, then exact ties:
:func:`top_tokens`), eos merged in by its float64 ζ_eos. Top-p's list grows until it covers p.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .distribution import StepDistribution, row_blocks
from .truncation import draw, insert_eos, truncate, untruncated

_FIRST_CANDIDATES = 64


def _stable_top(values: torch.Tensor, k: int, exclude: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k by a full stable sort (value desc, index asc); column ``exclude`` is moved past every
    other column, not masked to −inf (a row with fewer than k finite values would take it back)."""
    order = torch.sort(values, dim=1, descending=True, stable=True).indices
    if exclude is not None:
        order = order.gather(1, torch.sort((order == exclude).to(torch.int8), dim=1, stable=True).indices)
    order = order[:, :k]
    return order, values.gather(1, order)


def top_tokens(values: torch.Tensor, k: int, exclude: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row of ``values`` (B, V), skipping column ``exclude``: (tokens
    (B, k) int64, values (B, k)), value descending, ties → lower index. ``torch.topk``'s tie order is
    unspecified: when its k + 1 values hold a tie, the winners are re-sorted by (value, index), and
    rows whose k-th value ties with a token outside the selection are redone by a stable sort.
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
    """The k most probable tokens of every row (ties → lower index; k capped at V): (tokens (B, k)
    int64, log_probs (B, k) float64)."""
    k = min(k, dist.zeta.shape[1])
    has_special_eos = dist.eos_zeta is not None
    tokens, values = top_tokens(dist.zeta, k, exclude=dist.eos_index if has_special_eos else None)
    zeta = values.to(torch.float64)
    if has_special_eos:
        tokens, zeta = insert_eos(tokens, zeta, dist.eos_index, dist.eos_zeta)
    log_p = zeta - dist.log_norm.unsqueeze(1)
    if has_special_eos:
        log_p = torch.where(tokens == dist.eos_index, dist.eos_log_prob.unsqueeze(1), log_p)
    return tokens[:, :k], log_p[:, :k]


def greedy(dist: StepDistribution) -> torch.Tensor:
    """Most probable token per row (B,) int64, ties → lower index (the first of :func:`ranked_candidates`;
    a decoding step's greedy path is :mod:`.host_rows`)."""
    return ranked_candidates(dist, 1)[0].squeeze(1)


# CPU torch.argmax reads a row several times slower than amax (≈ 130 against 15 µs at 50257 columns):
# :func:`first_max` takes rows of at least _MIN_BLOCKS blocks by their block maxima.
_MAX_BLOCK = 1024
_MIN_BLOCKS = 16


def first_max(values: torch.Tensor) -> tuple[list[float], list[int]]:
    """(values, columns): per row of ``values`` (B, n) its largest entry and that entry's first column
    (as ``torch.argmax``; a row holding NaN gets some entry, the callers' to refuse). Long CPU rows go
    by blocks: the blocks' maxima (the last block ends at the row's end, overlapping the one before),
    then ``argmax`` of the first block holding the maximum.
    """
    B, n = values.shape
    blocks = n // _MAX_BLOCK
    if blocks < _MIN_BLOCKS or values.device.type != "cpu" or values.stride(1) != 1:
        idx = values.argmax(dim=1, keepdim=True)
        return values.gather(1, idx).view(-1).tolist(), idx.view(-1).tolist()
    # narrow and select, not indexing: Python's indexing costs more than these reductions at B = 1
    maxima = values.narrow(1, 0, blocks * _MAX_BLOCK).view(B, blocks, _MAX_BLOCK).amax(dim=2).tolist()
    tails = values.narrow(1, n - _MAX_BLOCK, _MAX_BLOCK).amax(dim=1).tolist()
    best, columns = [], []
    for row, (row_maxima, tail) in enumerate(zip(maxima, tails)):
        row_maxima.append(tail)
        top = max(row_maxima)
        start = min(row_maxima.index(top) * _MAX_BLOCK, n - _MAX_BLOCK) if top == top else 0
        best.append(top)
        columns.append(start + values.select(0, row).narrow(0, start, _MAX_BLOCK).argmax().item())
    return best, columns


# :func:`block_topk` takes rows of at least 4 blocks per entry it returns by their block maxima.
_TOPK_BLOCK = 64


def block_topk(values: torch.Tensor, n: int) -> tuple[list[list[float]], list[list[int]]]:
    """The n largest entries of each row of ``values`` (B, V), as lists (values descending, columns;
    ties in any order, as ``torch.topk``'s). Long CPU rows go by blocks of _TOPK_BLOCK: the n largest
    entries lie in the n blocks of largest maxima and the tail past the last whole block (those n
    maxima reach the n-th, and every other block lies below it), unless the n-th and (n+1)-th block
    maxima tie; then, and for short rows, ``torch.topk`` of the whole row (4× faster at V = 128256).
    """
    B, V = values.shape
    blocks = V // _TOPK_BLOCK
    if blocks >= 4 * (n + 1) and values.device.type == "cpu" and values.stride(1) == 1:
        body = values.narrow(1, 0, blocks * _TOPK_BLOCK).view(B, blocks, _TOPK_BLOCK)
        maxima, chosen = torch.topk(body.amax(dim=2), n + 1, dim=1)
        if all(nth != next_ for nth, next_ in maxima.narrow(1, n - 1, 2).tolist()):
            chosen = chosen.narrow(1, 0, n)
            picked = body.gather(1, chosen.unsqueeze(2).expand(B, n, _TOPK_BLOCK)).view(B, n * _TOPK_BLOCK)
            tail = values.narrow(1, blocks * _TOPK_BLOCK, V - blocks * _TOPK_BLOCK)
            top, at = torch.topk(torch.cat([picked, tail], dim=1), n, dim=1)
            past = blocks * _TOPK_BLOCK - n * _TOPK_BLOCK  # a tail entry's column less its place
            return top.tolist(), [[starts[j // _TOPK_BLOCK] * _TOPK_BLOCK + j % _TOPK_BLOCK if j < n * _TOPK_BLOCK
                                   else past + j for j in row] for starts, row in zip(chosen.tolist(), at.tolist())]
    top, columns = torch.topk(values, n, dim=1)
    return top.tolist(), columns.tolist()


def truncated_candidates(
    dist: StepDistribution, top_k: Optional[int], top_p: Optional[float], min_p: Optional[float] = None, *,
    first_size: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates kept by top-k, then top-p, then min-p: (tokens (B, C) int64, renormalized probs (B, C)
    float64, padded with 0). Top-p keeps the smallest rank-order prefix whose mass (renormalized over the
    top-k set when both are given) reaches p, min-p the tokens with at least ``min_p`` times the most
    probable one's probability. ``first_size``: the first list size without top-k (default 64)."""
    V = dist.zeta.shape[1]
    k = top_k if top_k is not None else min(V, first_size or _FIRST_CANDIDATES)
    while True:
        tokens, log_p = ranked_candidates(dist, k)
        ranked_probs = torch.exp(log_p)
        probs, covered = truncate(ranked_probs, top_k, top_p, min_p)
        if top_k is not None or k >= V or bool(covered.all()):  # top-k: its list is the answer
            return tokens, probs
        if top_p is None or top_p >= 1.0:  # min-p alone: a 4x longer list
            k = min(V, 4 * k)
            continue
        # Next size on the 4× grid, skipping sizes the missing mass proves too small: a row short by m
        # needs at least m / p_last more tokens (no later token is more probable; m / 0 = inf: all).
        missing = (top_p - ranked_probs.sum(dim=1)).clamp(min=0.0)
        fewest = float(torch.where(missing > 0, missing / ranked_probs[:, -1], 0.0).max())
        needed, k = k + (math.ceil(fewest) if fewest < V else V), 4 * k
        while k < min(needed, V):
            k *= 4
        k = min(V, k)


def select(
    dist: StepDistribution,
    *,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
    first_size: Optional[int] = None,
) -> torch.Tensor:
    """One token per row (B,) from ``dist`` after optional top-k / top-p / min-p truncation (checked by the
    caller)."""
    if top_k == 1:
        return greedy(dist)
    if untruncated(top_k, top_p, min_p):
        # By blocks of rows on CPU (``distribution.BLOCK_ENTRIES``): each (rows, V) float64 table is small.
        parts = [draw(dist.log_probs(rows).exp_(), generator, overwrite=True).squeeze(1)
                 for rows in row_blocks(dist.zeta)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    tokens, probs = truncated_candidates(dist, top_k, top_p, min_p, first_size=first_size)
    return tokens.gather(1, draw(probs, generator)).squeeze(1)
