"""Greedy, and top-k (then top-p, min-p) of up to MAX_ROWS rows, on the torch path: each row finished on the
host in Python floats (larger top-k batches: :mod:`.selection`).

A CPU torch op costs 3–8 µs of dispatch however short its tensor, and a step's per-row part (head
scalars, row check, eos among the best tokens, truncation, draw) took 60–90 of them. Here the V-wide
part stays in torch (ζ in one reused buffer with eos at −inf, the best token or the exact top k,
Σ e^(ζ − max)), is read back once (on CUDA, ``impl="torch"``: the call's one host sync), and each row
is finished in float64 by the tensors' head formulas (``head_math``, :func:`.distribution.head_terms`).
"""

from __future__ import annotations

import bisect
import math
from itertools import accumulate
from typing import Optional

import numpy as np
import torch

from ..head_math import head_terms, nmst_log_survival, st_step_survival
from .distribution import (
    BLOCK_ENTRIES,
    RowBuffer,
    Steps,
    check_state,
    exp_sum,
    no_distribution_message,
    row_blocks,
    step_values,
)
from .selection import block_topk, first_max, top_tokens
from .truncation import TOP_P_SLACK, active_min_p

# Top-k batches up to this size go row by row: a row costs 10–20 µs of Python, the tensor path's
# per-row ops about 0.4–0.9 ms a call whatever the batch (60–90 ops), so the host wins below some 40
# rows. Greedy goes row by row at any size (3–5 µs a row, besides the best column's block lookup that
# both paths make).
MAX_ROWS = 32


class HostRows:
    """Greedy (``top_k=1``) or top-k (then top-p, min-p) selection for one head; arguments as
    :class:`nmst_fast.decoding.DecodingStep`'s. Owns the ζ buffer of its calls."""

    def __init__(self, *, head: str, eos_index: int, eps: float, temperature: float, top_k: int,
                 top_p: Optional[float], min_p: Optional[float] = None):
        self.head, self.eos_index, self.eps, self.temperature, self.top_k = head, eos_index, eps, temperature, top_k
        self.cut = None if top_p is None or top_p >= 1.0 else top_p - TOP_P_SLACK
        self.min_p = active_min_p(min_p)
        self._buffer = RowBuffer()

    def __call__(self, logits: torch.Tensor, steps: Steps, state: Optional[torch.Tensor],
                 generator: Optional[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(tokens (B,) int64, log p (B,) float64 of each under the untruncated step distribution, ST's
        next state (B,) float64 or None) for ``logits`` (B, V)."""
        B, device, special_eos = logits.shape[0], logits.device, self.head != "va"
        eos_logits = logits.select(1, self.eos_index).tolist() if special_eos else [0.0] * B
        t = step_values(steps, B, device) if special_eos else 1
        step_list = [t] * B if isinstance(t, int) else t.tolist()
        prev = [0.0] * B if self.head != "st" or state is None else check_state(state, B, device).double().tolist()
        reduced = self._reduce(logits) if B * logits.shape[1] <= BLOCK_ENTRIES else [
            row for rows in row_blocks(logits) for row in self._reduce(logits[rows])]
        uniforms = [0.0] * B if self.top_k == 1 else torch.rand(
            B, dtype=torch.float64, generator=generator,
            device=generator.device if generator is not None else device).tolist()
        finished = [self._finish(row, *row_reduced, eos_logits[row], step_list[row], prev[row], uniforms[row])
                    for row, row_reduced in enumerate(reduced)]
        tokens, log_probs, states = zip(*finished) if finished else ((), (), ())
        return (_tensor(tokens, np.int64, device), _tensor(log_probs, np.float64, device),
                _tensor(states, np.float64, device) if self.head == "st" else None)

    def _reduce(self, logits: torch.Tensor) -> list[tuple]:
        """Per row: (the top ζ, Σ e^(ζ − top) over non-eos columns, the greedy column or the exact
        top-k tokens, None or their ζ)."""
        R, V = logits.shape
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        last = V - 1 if self.head != "va" and self.eos_index == V - 1 else V  # eos last: ζ is a view of the rest
        buffer = self._buffer.get(R, last, dtype, logits.device)
        head = logits if last == V else logits.narrow(1, 0, last)
        masked = self.head != "va" and last == V  # eos inside the row: its column goes to −inf
        if self.temperature == 1.0 and logits.dtype == dtype and logits.stride(1) == 1 and not masked:
            zeta = head  # read, never written: the exp pass writes the buffer
        else:
            zeta = buffer.copy_(head)
            if self.temperature != 1.0:
                zeta.div_(self.temperature)
            if masked:
                zeta.select(1, self.eos_index).fill_(-math.inf)  # NaN there is refused by the eos logit
        if self.top_k == 1:
            tops, picked = first_max(zeta)
            values: list = [None] * R
        else:
            k = min(self.top_k, last)
            values, picked = block_topk(zeta, min(k + 1, last))
            if any(a == b for row in values for a, b in zip(row, row[1:])):  # topk orders ties arbitrarily
                tokens, ranked = top_tokens(zeta, k)
                values, picked = ranked.tolist(), tokens.tolist()
            values, picked = [row[:k] for row in values], [row[:k] for row in picked]
            tops = [row[0] for row in values]
        shift = tops[0] if R == 1 else zeta.new_tensor(tops).unsqueeze(1)
        totals = exp_sum(torch.sub(zeta, shift, out=buffer))  # NaN, ±inf or all −inf rows: NaN
        return list(zip(tops, totals.tolist(), picked, values))

    def _finish(self, row: int, top: float, total: float, picked, values: Optional[list[float]], eos_logit: float,
                t: int, prev: float, uniform: float) -> tuple[int, float, Optional[float]]:
        """One row's token, its log p and ST's next state, from its reduction."""
        lse = top + math.log(total) if math.isfinite(top) and total > 0 else math.nan
        if not math.isfinite(lse) or math.isnan(eos_logit):
            raise ValueError(no_distribution_message(row))
        eos, next_state = self.eos_index, None
        if self.head == "va":
            log_norm = lse
        else:
            if self.head == "nmst":
                log_surv = nmst_log_survival(eos_logit, t, self.eps)
            else:
                log_surv, next_state = st_step_survival(prev, eos_logit, t, self.eps)
            log_norm, eos_zeta, eos_log_prob = head_terms(lse, log_surv)
        if values is None:  # greedy: eos against the best other token, ties → lower index
            if self.head != "va" and (eos_zeta > top or (eos_zeta == top and eos < picked)):
                return eos, eos_log_prob, next_state
            return picked, top - log_norm, next_state
        tokens, log_ps = picked, [value - log_norm for value in values]
        if self.head != "va":  # eos after every token with a higher ζ, or an equal ζ and a lower index
            at = 0
            while at < len(values) and (values[at] > eos_zeta or (values[at] == eos_zeta and tokens[at] < eos)):
                at += 1
            tokens, log_ps = tokens[:at] + [eos] + tokens[at:], log_ps[:at] + [eos_log_prob] + log_ps[at:]
        weights = [math.exp(log_p) for log_p in log_ps[: self.top_k]]
        if self.cut is not None:  # top-p on the top-k set: keep ranks while the mass before them is short of p
            mass = sum(weights)
            kept = 1 + sum(1 for before in accumulate(weights[:-1]) if before / mass < self.cut)
            weights = weights[:kept]
        if self.min_p is not None:  # the ranks with at least min_p times the first's probability (a prefix)
            floor = self.min_p * weights[0]
            weights = weights[:sum(1 for w in weights if w >= floor)]
        cdf = list(accumulate(weights))
        # u < 1, but u · total may round up to total, which no entry exceeds: stay one ulp below it.
        chosen = bisect.bisect_right(cdf, min(uniform * cdf[-1], math.nextafter(cdf[-1], 0.0)))
        return tokens[chosen], log_ps[chosen], next_state


def _tensor(values: list, dtype: type, device: torch.device) -> torch.Tensor:
    """A list of Python numbers as a (B,) tensor on ``device`` (through numpy: a third of
    ``torch.tensor``'s cost)."""
    out = torch.from_numpy(np.array(values, dtype=dtype))
    return out if device.type == "cpu" else out.to(device)
