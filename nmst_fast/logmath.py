"""Numerically stable log-space primitives shared by every head implementation."""

from __future__ import annotations

import decimal
import math
from decimal import Decimal

import torch

_LOG_HALF = -math.log(2.0)


def log1mexp(a: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(a))`` for ``a <= 0``, accurate across the whole range.

    Uses ``log(-expm1(a))`` near 0 (where ``1 - exp(a)`` cancels) and
    ``log1p(-exp(a))`` for very negative ``a`` (where ``expm1`` saturates);
    the switch at ``-ln 2`` is Mächler's recommendation. ``a == 0`` gives ``-inf``.
    """
    near_zero = a > _LOG_HALF
    # Evaluate each branch only on inputs where it is well behaved so that
    # neither branch produces NaN that ``where`` would then have to discard.
    safe_near = torch.where(near_zero, a, torch.full_like(a, _LOG_HALF))
    safe_far = torch.where(near_zero, torch.full_like(a, _LOG_HALF), a)
    return torch.where(near_zero, torch.log(-torch.expm1(safe_near)), torch.log1p(-torch.exp(safe_far)))


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
