"""Decoding for NMST / ST / VA heads: exact step distributions and token selection.

    step_log_probs   exact (B, V) log-distribution of one step (+ ST's running state)
    DecodingStep     a step's token selection, set up once; no host sync per call
    sample           greedy / top-k / top-p / temperature sampling, no full sort
    beam_step        one step of the paper's beam search (k×k candidates, k best prefixes)
    effective_logits the step distribution as softmax of effective logits ζ
"""

from .beam import BeamCandidates, beam_step
from .distribution import StepDistribution, effective_logits, step_log_probs
from .selection import greedy, ranked_candidates, truncated_candidates
from .step import DecodingStep, StepOutput, sample

__all__ = ["BeamCandidates", "DecodingStep", "StepDistribution", "StepOutput", "beam_step", "effective_logits",
           "greedy", "ranked_candidates", "sample", "step_log_probs", "truncated_candidates"]
