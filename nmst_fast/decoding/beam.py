"""One step of beam search on a head's exact step distribution."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..validation import check_float_tensor
from .distribution import Steps, check_rows, check_step_args, effective_logits, eos_terms
from .selection import ranked_candidates
from .step import kernels_serve
from .truncation import insert_eos


@dataclass
class BeamCandidates:
    """The best extensions of a batch of beams, best first per batch item.

    Attributes:
        tokens: (B, C) int64 next token of each candidate.
        scores: (B, C) float64 cumulative log-probability of prefix + token.
        beam_rows: (B, C) int64 row of the (B·K) beam batch each candidate extends.
        state: (B, C) float64 head state ("st": running log(1−α)) after the token,
            already taken from the extended beam; None for other heads.
    """

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
    impl: str = "auto",
) -> BeamCandidates:
    """The paper's beam step: each beam proposes its top tokens, the best prefixes survive.

    Args:
        logits: (B·K, V) logits of the K = ``num_beams`` beams of each of B items, beams of
            one item adjacent.
        beam_scores: (B·K,) cumulative log-probabilities of the beams (use -inf for beams
            that should not expand, e.g. all but the first at step 1).
        state: "st" only: (B·K,) running log(1−α) of each beam.
        num_candidates: C, how many extensions to return per item (default K: the k best
            of the k×k candidates). A generation loop that sets finished (eos) candidates
            aside asks for 2K so that K unfinished ones always remain.
        impl: "auto" (on CUDA, the one-read Triton scan's ranked candidates when C is at
            most ``nmst_fast.kernels.row_scan.MAX_CANDIDATES``), "triton" or "torch"; see
            :func:`nmst_fast.decoding.sample`.
    Returns:
        :class:`BeamCandidates`, ranked by score (ties → lower beam, then lower token rank).
    """
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be a positive int, got {num_beams!r}")
    if num_candidates is not None and (isinstance(num_candidates, bool) or not isinstance(num_candidates, int)
                                       or num_candidates < 1):
        raise ValueError(f"num_candidates must be a positive int or None, got {num_candidates!r}")
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
    args = dict(head=head, eos_index=eos_index, eps=eps, steps=steps, state=state, temperature=temperature)
    if kernels_serve(impl, logits.device, per_beam, None, ranked=True):
        tokens, log_p, new_state = _kernel_candidates(logits, k=per_beam, **args)
    else:
        dist = effective_logits(logits, **args)
        tokens, log_p = ranked_candidates(dist, per_beam)
        new_state = dist.state
    scores = (beam_scores.to(torch.float64).unsqueeze(1) + log_p).reshape(B, num_beams * per_beam)
    # Stable sort on the small candidate set: ties go to the lower beam, then the better-ranked token.
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :C]
    beam_in_item = torch.div(order, per_beam, rounding_mode="floor")
    beam_rows = beam_in_item + (torch.arange(B, device=logits.device) * num_beams).unsqueeze(1)
    cand_tokens = tokens.reshape(B, num_beams * per_beam).gather(1, order)
    cand_state = None if new_state is None else new_state[beam_rows]
    return BeamCandidates(cand_tokens, scores.gather(1, order), beam_rows, cand_state)


def _kernel_candidates(
    logits: torch.Tensor, *, head: str, eos_index: int, eps: float, steps: Steps, state: Optional[torch.Tensor],
    temperature: float, k: int,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The k most probable tokens per row in rank order (ties → lower index), from one read of the
    logits: the scan's ranked non-eos candidates (``nmst_fast/kernels/row_scan.py``), eos merged in by
    its exact ζ_eos, then O(B·k) float64 torch math — no (B, V) tensor.

    Returns (tokens (B, k) int64, log_probs (B, k) float64, ST's new state (B,) or None); rows with
    fewer than k tokens are padded with token -1 and log-prob -inf.
    """
    from nmst_fast.kernels.row_scan import row_scan  # lazy: Triton picks interpret mode at import

    check_step_args(logits, head, eos_index, eps, temperature)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    scan = row_scan(logits, eos_index=None if head == "va" else eos_index, temperature=temperature, candidates=k)
    lse, tokens, zeta = scan["lse"].to(torch.float64), scan["cand_idx"], scan["cand_val"].to(torch.float64)
    if head == "va":
        check_rows(lse)
        return tokens[:, :k], zeta[:, :k] - lse.unsqueeze(1), None
    log_norm, eos_zeta, eos_log_prob, next_state = eos_terms(
        lse, logits[:, eos_index].to(torch.float64), head=head, eps=eps, steps=steps, state=state)
    tokens, zeta = insert_eos(tokens, zeta, eos_index, eos_zeta)
    tokens = tokens[:, :k]
    log_p = torch.where(tokens == eos_index, eos_log_prob.unsqueeze(1), zeta[:, :k] - log_norm.unsqueeze(1))
    return tokens, log_p, next_state
