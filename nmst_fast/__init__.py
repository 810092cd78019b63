"""nmst-fast: fused, memory-lean training losses for non-monotonic self-terminating LMs.

Public API:
    linear_nmst_loss   fused linear + NMST/ST/VA loss, ``impl=`` picks the backend
    nmst_log_probs     full log-distribution of a head (the readable reference)
    NMSTHead           nn.Module: output layer + loss, weight optionally tied
    termination_bound  t½ = ⌈ln 2 / −ln(1−ε)⌉, the step by which greedy NMST stops
"""

from .head import NMSTHead
from .logmath import termination_bound
from .loss import linear_nmst_loss
from .reference import nmst_log_probs

__all__ = ["NMSTHead", "linear_nmst_loss", "nmst_log_probs", "termination_bound"]
__version__ = "0.1.0"
