"""The reference itself against the spec, computed independently in plain Python floats."""

import math
from decimal import Decimal, getcontext

import pytest
import torch

import nmst_fast
from nmst_fast.logmath import log1mexp


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@pytest.mark.parametrize("eps,t,s", [(1e-5, 1, 0.3), (1e-3, 50, -2.0), (0.2, 7, 4.0), (1e-8, 10**6, -30.0)])
def test_nmst_eos_probability_matches_formula(eps, t, s):
    e = 2
    logits = torch.tensor([[0.1, -1.0, s, 2.0, 0.5]], dtype=torch.float64)
    logp = nmst_fast.nmst_log_probs(logits, eos_index=e, eps=eps, head="nmst", steps=torch.tensor([t]))
    getcontext().prec = 50  # (1 − ε)^t in 50-digit decimals: an independent truth
    survive = float(Decimal(1 - _sigmoid(s)) * (1 - Decimal(eps)) ** t)  # 1 − α_t
    assert logp[0, e].exp().item() == pytest.approx(1 - survive, rel=1e-9)
    non_eos = [0, 1, 3, 4]
    z = logits[0, non_eos]
    expected = survive * torch.softmax(z, 0)
    torch.testing.assert_close(logp[0, non_eos].exp(), expected, rtol=1e-9, atol=0)


def test_st_is_a_running_product():
    eps = 0.1
    s = [0.5, -1.0, 2.0, 0.0]
    logits = torch.zeros(1, 4, 3, dtype=torch.float64)
    logits[0, :, 0] = torch.tensor(s, dtype=torch.float64)
    steps = torch.tensor([[0, 1, 2, 3]])  # the first position is context
    logp = nmst_fast.nmst_log_probs(logits, eos_index=0, eps=eps, head="st", steps=steps)
    survive = 1.0
    assert logp[0, 0, 0].exp().item() == 0.0  # p(eos) = 0 in context
    for t in range(1, 4):
        survive *= _sigmoid(s[t]) * (1 - eps)
        assert logp[0, t, 0].exp().item() == pytest.approx(1 - survive, rel=1e-12)


@pytest.mark.parametrize("head", ["nmst", "st", "va"])
def test_distribution_normalizes(head):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, 41, generator=gen, dtype=torch.float64) * 30
    steps = torch.arange(-3, 47).expand(3, 50)
    logp = nmst_fast.nmst_log_probs(logits, eos_index=40, eps=0.01, head=head,
                                    steps=steps.clamp(min=0) if head == "nmst" else steps)
    torch.testing.assert_close(torch.logsumexp(logp, -1), torch.zeros(3, 50, dtype=torch.float64), atol=1e-12, rtol=0)


def test_va_is_log_softmax():
    logits = torch.randn(4, 9, dtype=torch.float64)
    torch.testing.assert_close(nmst_fast.nmst_log_probs(logits, eos_index=3, head="va"), torch.log_softmax(logits, -1))


def test_nmst_eos_probability_reaches_half_by_the_bound():
    eps = 1e-3
    bound = nmst_fast.termination_bound(eps)
    logits = torch.tensor([[50.0, -1e4]], dtype=torch.float64).expand(2, 2).clone()  # eos logit very low
    logp = nmst_fast.nmst_log_probs(logits, eos_index=1, eps=eps, head="nmst", steps=torch.tensor([bound - 1, bound]))
    assert logp[0, 1].exp() < 0.5 <= logp[1, 1].exp()


def test_termination_bound_values():
    assert nmst_fast.termination_bound(1e-5) == 69315
    assert nmst_fast.termination_bound(0.5) == 1
    for eps in (1e-4, 3e-3, 0.1):
        t = nmst_fast.termination_bound(eps)
        assert (1 - eps) ** t <= 0.5 < (1 - eps) ** (t - 1)
    with pytest.raises(ValueError, match="eps"):
        nmst_fast.termination_bound(1.0)


def test_log1mexp_is_accurate_everywhere():
    a = torch.tensor([-1e-20, -1e-8, -0.5, -math.log(2), -1.0, -40.0, -800.0], dtype=torch.float64)
    expected = torch.tensor([math.log(-math.expm1(x)) if x > -1 else math.log1p(-math.exp(x)) for x in a.tolist()],
                            dtype=torch.float64)
    torch.testing.assert_close(log1mexp(a), expected, rtol=1e-14, atol=0)
    assert log1mexp(torch.tensor([0.0])).item() == float("-inf")
    a.requires_grad_()
    (g,) = torch.autograd.grad(log1mexp(a).sum(), a)
    assert torch.isfinite(g).all()
    with torch.no_grad():  # without autograd the branches need no guard: the same values
        assert torch.equal(log1mexp(a), log1mexp(a.detach()))
    assert torch.equal(log1mexp(a).detach(), log1mexp(a.detach()))
