"""nmst-fast: fused, memory-lean training losses for non-monotonic self-terminating LMs.

Public API:
    linear_nmst_loss   fused linear + NMST/ST/VA loss, ``impl=`` picks the backend
    linear_nmst_loss_with_statistics  per-token NLL and the distribution's entropy, log Σ p², mean logit, top-1
    nmst_log_probs     full log-distribution of a head (the readable reference)
    NMSTHead           nn.Module: output layer + loss, weight optionally tied
    termination_bound  t½ = ⌈ln 2 / −ln(1−ε)⌉, the step by which greedy NMST stops
    generate           batched greedy / top-k / nucleus / beam generation
    decoding, metrics  per-step selection; non-termination ratio and friends
"""

from . import decoding, integrations, metrics
from .generation import GenerationOutput, generate
from .head import NMSTHead
from .logmath import termination_bound
from .loss import linear_nmst_loss, linear_nmst_loss_with_statistics
from .reference import nmst_log_probs

__all__ = ["GenerationOutput", "NMSTHead", "decoding", "generate", "linear_nmst_loss",
           "linear_nmst_loss_with_statistics", "metrics", "nmst_log_probs", "termination_bound"]
integrations.install_hooks()

# The one version source: pyproject.toml reads this literal without importing the package (keep it a literal).
__version__ = "0.1.0"
