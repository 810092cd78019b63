"""One step of beam search on a head's exact step distribution."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..validation import check_float_tensor, check_int
from .distribution import Steps, effective_logits
from .selection import ranked_candidates


@dataclass
class BeamCandidates:
    """The best extensions of a batch of beams, best first per batch item: ``tokens`` (B, C) int64,
    ``scores`` (B, C) float64 (log p of prefix + token), ``beam_rows`` (B, C) int64 (the row of the
    B·K beam batch each extends) and ``state`` (B, C) float64 (ST's running log(1−α) after the token;
    None for other heads)."""

    tokens: torch.Tensor
    scores: torch.Tensor
    beam_rows: torch.Tensor
    state: Optional[torch.Tensor]


@torch.no_grad()  # a search, not a loss: no graph through the candidates
def beam_step(
    logits: torch.Tensor,
    beam_scores: torch.Tensor,
    *,
    num_beams: int,
    head: str,
    eos_index: int,
    eps: float = 1e-5,
    steps: Steps = 1,
    state: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    num_candidates: Optional[int] = None,
) -> BeamCandidates:
    """The paper's beam step: each beam proposes its top tokens, the best prefixes survive (ranked in
    torch on any device).

    Args:
        logits: (B·K, V) logits of the K = ``num_beams`` beams of each of B items, beams of one item
            adjacent.
        beam_scores: (B·K,) cumulative log-probabilities (-inf: a beam that must not expand).
        state: "st" only: (B·K,) running log(1−α) of each beam.
        num_candidates: C, extensions to return per item (default K); a loop that sets finished
            (eos) candidates aside asks for more, so that K unfinished ones remain.
    Returns:
        :class:`BeamCandidates`, ranked by score (ties → lower beam, then lower token rank).
    """
    check_int("num_beams", num_beams, 1)
    check_int("num_candidates", num_candidates, 1, optional=True)
    check_float_tensor("logits", logits)
    check_float_tensor("beam_scores", beam_scores)
    if logits.dim() != 2:
        raise ValueError(f"logits must be (B·num_beams, V), got shape {tuple(logits.shape)}")
    rows, V = logits.shape
    if rows % num_beams:
        raise ValueError(f"logits has {rows} rows, not a multiple of num_beams={num_beams}")
    if beam_scores.shape != (rows,):
        raise ValueError(f"beam_scores must have shape ({rows},), got {tuple(beam_scores.shape)}")
    if bool((beam_scores.isnan() | (beam_scores == float("inf"))).any()):  # −inf: a beam not in use
        raise ValueError("beam_scores must be log-probabilities: no NaN or +inf")
    C = num_beams if num_candidates is None else num_candidates
    B = rows // num_beams
    # Any of an item's C best extensions is among its own beam's C best tokens: K·C candidates suffice.
    per_beam = min(C, V)
    dist = effective_logits(logits, head=head, eos_index=eos_index, eps=eps, steps=steps, state=state,
                            temperature=temperature)
    tokens, log_p = ranked_candidates(dist, per_beam)
    scores = (beam_scores.to(torch.float64).unsqueeze(1) + log_p).reshape(B, num_beams * per_beam)
    # Stable sort on the small candidate set: ties go to the lower beam, then the better-ranked token.
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :C]
    beam_in_item = torch.div(order, per_beam, rounding_mode="floor")
    beam_rows = beam_in_item + (torch.arange(B, device=logits.device) * num_beams).unsqueeze(1)
    cand_tokens = tokens.reshape(B, num_beams * per_beam).gather(1, order)
    cand_state = None if dist.state is None else dist.state[beam_rows]
    return BeamCandidates(cand_tokens, scores.gather(1, order), beam_rows, cand_state)

