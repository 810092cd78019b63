"""Decoding for NMST / ST / VA heads: exact step distributions and token selection.

    step_log_probs   exact (B, V) log-distribution of one step (+ ST's running state)
    sample           greedy / top-k / top-p / temperature sampling, no full sort
    beam_step        one step of the paper's beam search (k×k candidates, k best prefixes)
    effective_logits the step distribution as softmax of effective logits ζ
"""

from .beam import BeamCandidates, beam_step
from .distribution import StepDistribution, effective_logits, step_log_probs
from .selection import greedy, ranked_candidates, sample, truncated_candidates

__all__ = ["BeamCandidates", "StepDistribution", "beam_step", "effective_logits", "greedy", "ranked_candidates",
           "sample", "step_log_probs", "truncated_candidates"]
