"""Numerically stable log-space primitives shared by every head implementation."""

from __future__ import annotations

import decimal
import math
from decimal import Decimal
from typing import Union

import torch

_LOG_HALF = -math.log(2.0)


def log1mexp(a: Union[torch.Tensor, float]) -> Union[torch.Tensor, float]:
    """``log(1 - exp(a))`` for ``a <= 0`` (a tensor, or a float of a row on the host), accurate across
    the whole range.

    Uses ``log(-expm1(a))`` near 0 (where ``1 - exp(a)`` cancels) and
    ``log1p(-exp(a))`` for very negative ``a`` (where ``expm1`` saturates);
    the switch at ``-ln 2`` is Mächler's recommendation. ``a == 0`` gives ``-inf``.
    """
    if not isinstance(a, torch.Tensor):
        return -math.inf if a == 0 else math.log(-math.expm1(a)) if a > _LOG_HALF else math.log1p(-math.exp(a))
    near_zero = a > _LOG_HALF
    if not (a.requires_grad and torch.is_grad_enabled()):  # for a <= 0 neither branch is NaN
        return torch.where(near_zero, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))
    # Under autograd each branch sees only inputs where it is well behaved: the derivative of the
    # discarded one (infinite at a = 0 for log1p(-exp(a))) would otherwise turn the gradient to NaN.
    safe_near = torch.where(near_zero, a, torch.full_like(a, _LOG_HALF))
    safe_far = torch.where(near_zero, torch.full_like(a, _LOG_HALF), a)
    return torch.where(near_zero, torch.log(-torch.expm1(safe_near)), torch.log1p(-torch.exp(safe_far)))


def log_sigmoid(x: Union[torch.Tensor, float]) -> Union[torch.Tensor, float]:
    """``log σ(x)`` in float64: of a tensor (as float64), or of a float (min(x, 0) − log1p(e^−|x|), as
    torch computes it)."""
    if isinstance(x, torch.Tensor):
        return torch.nn.functional.logsigmoid(x.double())
    return min(x, 0.0) - math.log1p(math.exp(-abs(x)))


def log1m_eps(eps: float) -> float:
    """``log(1 - eps)`` computed without cancellation for tiny ``eps``."""
    return math.log1p(-eps)


def termination_bound(eps: float) -> int:
    """Step t½ = ⌈ln 2 / −ln(1−ε)⌉ by which greedy NMST decoding must emit eos.

    For t ≥ t½ the NMST head gives p(eos) = 1 − σ(−s)(1−ε)^t > 1 − (1−ε)^t ≥ 1/2, so eos is the
    strict argmax of the distribution (the paper's termination theorem).
    ``termination_bound(1e-5) == 69315``.

    Evaluated to 60 significant digits (``decimal``): in float64 the quotient can round onto an
    integer it exceeds (ε = 0.018559322341406004: the float64 formula gives 37, but (1−ε)^37 is
    above 1/2 by 1.6e-17, so the bound is 38). ε is the float64 value given, exactly.
    """
    from .validation import check_eps

    check_eps(eps)
    with decimal.localcontext() as ctx:
        ctx.prec = 60 + max(0, -Decimal(eps).adjusted())  # 1 − ε keeps ε's 60 leading digits
        quotient = Decimal(2).ln() / -(Decimal(1) - Decimal(eps)).ln()
        # (1−ε)^t = 1/2 exactly (ε = 1/2, t = 1) is a bound too: σ(−s) < 1 keeps p(eos) above 1/2.
        # The slack absorbs the last digits' rounding of such an integer quotient.
        return int((quotient - Decimal("1e-45")).to_integral_value(rounding=decimal.ROUND_CEILING))


def segmented_cumsum(x: torch.Tensor, starts: torch.Tensor, *, reverse: bool = False) -> torch.Tensor:
    """Cumulative sum of ``x`` along its last axis that restarts at every True of ``starts``.

    ``out[..., j]`` sums ``x[..., i]`` from the last start at or before j (the row start if
    there is none) up to j: each run that begins at a start is summed as if it were its own row.
    ``reverse=True`` sums from j to the end of j's run instead (up to the position before the
    next start, or the row end): the adjoint, Σ_j g_j·out_j = Σ_i x_i·out_reverse(g)_i, which
    is how a gradient flows back through the forward sum.

    ``starts`` is bool, broadcastable to ``x``. O(numel), no loop over the axis: a run's sum is
    the row's prefix sum (one cumsum) minus the prefix before the run's start (found by one
    cummax), exact but for the rounding of that prefix; a row without restarts after its first
    position gives plain ``cumsum`` bit for bit. Non-finite values (±inf, NaN) stay in their run
    (one more cummax finds them), as they would in a row of their own. Differentiable (twice).
    """
    starts = torch.broadcast_to(starts, x.shape)
    if reverse:
        # Flipped, a run's last position is its first: run ends are the positions before a start.
        ends = torch.cat([starts[..., 1:], torch.ones_like(starts[..., :1])], dim=-1)
        return segmented_cumsum(x.flip(-1), ends.flip(-1)).flip(-1)
    position = torch.arange(x.shape[-1], device=x.device)
    run_start = torch.where(starts, position, 0).cummax(-1).values  # 0 before the first start
    finite = torch.isfinite(x)
    total = torch.where(finite, x, torch.zeros_like(x)).cumsum(-1)
    before = torch.cat([torch.zeros_like(total[..., :1]), total[..., :-1]], dim=-1)  # exclusive prefix sums
    out = total - before.gather(-1, run_start)
    # ±inf / NaN: whether each kind occurred in the run so far (its latest position is in the run).
    kinds = torch.stack([x == float("-inf"), x == float("inf"), torch.isnan(x)])
    neg, pos, nan = (torch.where(kinds, position, -1).cummax(-1).values >= run_start).unbind(0)
    non_finite_sum = torch.where(nan | (neg & pos), float("nan"), torch.where(pos, float("inf"), float("-inf")))
    return torch.where(neg | pos | nan, non_finite_sum.to(out.dtype), out)
