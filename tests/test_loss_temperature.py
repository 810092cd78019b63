"""``temperature`` in the fused loss: the NLL of the distribution decoding samples at T (non-eos logits / T for
NMST / ST, p(eos) unchanged; every logit / T for VA), forward and gradients against the float64 reference, and the
reference against the decoding step's own distribution."""

from __future__ import annotations

import pytest
import torch

import nmst_fast
from nmst_fast.decoding import step_log_probs

from helpers import slow

V, EOS = 37, 5  # V not a multiple of any block


def _case(seed: int, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    B, T, H = 3, 7, 16
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64) * scale
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, 2] = targets[2, 4] = EOS
    targets[1, 3] = -100
    steps = torch.arange(1, T + 1).expand(B, T).clone() * 40  # large t: α near 1 for NMST
    steps[1, :2] = 0  # context rows
    return hidden, weight, bias, targets, steps


POSTS = [dict(), dict(softcap=3.0), dict(softcap=4.0, logit_scale=0.6)]
# Every combination on the torch backend; the Triton kernels (the interpreter on CPU: ~1 s a case) one case per
# head in the fast set, the rest under -m slow.
CASES = [("chunked", head, temperature, post, reduction) for head in ("nmst", "st", "va") for temperature in (0.55, 1.8)
         for post in POSTS for reduction in ("mean", "none")]
CASES += [("triton", head, 0.55, POSTS[2], "none") for head in ("nmst", "st", "va")]
CASES += [slow("triton", head, temperature, post, reduction) for head in ("nmst", "st", "va")
          for temperature in (0.55, 1.8) for post in POSTS for reduction in ("mean", "none")
          if (temperature, post, reduction) != (0.55, POSTS[2], "none")]


@pytest.mark.parametrize("impl, head, temperature, post, reduction", CASES)
def test_temperature_matches_the_reference(impl, head, temperature, post, reduction):
    hidden, weight, bias, targets, steps = _case(seed=hash((head, temperature, reduction)) % 1000)
    dtype = torch.float32 if impl == "triton" else torch.float64
    kw = dict(eos_index=EOS, eps=0.02, head=head, steps=steps, temperature=temperature, reduction=reduction, **post)
    reference_inputs = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    inputs = [t.to(dtype).requires_grad_() for t in (hidden, weight, bias)]
    expected = nmst_fast.linear_nmst_loss(*reference_inputs[:2], targets, bias=reference_inputs[2], impl="reference",
                                          **kw)
    got = nmst_fast.linear_nmst_loss(*inputs[:2], targets, bias=inputs[2], impl=impl, **kw)
    upstream = torch.rand(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) + 0.5
    (expected * upstream).sum().backward()
    (got * upstream.to(dtype)).sum().backward()
    tol = 2e-5 if dtype == torch.float32 else 1e-11
    assert torch.allclose(got.double(), expected.detach(), rtol=tol, atol=tol)
    for a, b in zip(inputs, reference_inputs):
        assert torch.allclose(a.grad.double(), b.grad, rtol=tol, atol=tol * float(b.grad.abs().max()))


@pytest.mark.parametrize("head", ["nmst", "st", "va"])
def test_the_reference_at_temperature_is_the_decoding_steps_distribution(head):
    """nmst_log_probs at T, step by step, equals what decoding samples from at T (an independent implementation:
    effective logits, ST's state carried by hand)."""
    g = torch.Generator().manual_seed(17)
    logits = torch.randn(2, 6, V, generator=g, dtype=torch.float64) * 3
    temperature, eps = 0.7, 0.1
    full = nmst_fast.nmst_log_probs(logits, eos_index=EOS, eps=eps, head=head, temperature=temperature)
    state = None
    for t in range(1, 7):
        step, state = step_log_probs(logits[:, t - 1], head=head, eos_index=EOS, eps=eps, steps=t, state=state,
                                     temperature=temperature)
        assert torch.allclose(full[:, t - 1], step, atol=1e-12)
    if head != "va":  # p(eos) does not depend on T
        cold = nmst_fast.nmst_log_probs(logits, eos_index=EOS, eps=eps, head=head)
        assert torch.allclose(full[..., EOS], cold[..., EOS], atol=1e-12)


def test_temperature_one_is_the_plain_loss_bit_for_bit():
    hidden, weight, bias, targets, steps = _case(seed=4)
    plain = nmst_fast.linear_nmst_loss(hidden, weight, targets, bias=bias, eos_index=EOS, steps=steps, impl="chunked")
    at_one = nmst_fast.linear_nmst_loss(hidden, weight, targets, bias=bias, eos_index=EOS, steps=steps,
                                        impl="chunked", temperature=1.0)
    assert torch.equal(plain, at_one)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), True, "1"])
def test_a_bad_temperature_is_refused(bad):
    hidden, weight, bias, targets, steps = _case(seed=5)
    with pytest.raises(ValueError, match="temperature"):
        nmst_fast.linear_nmst_loss(hidden, weight, targets, eos_index=EOS, steps=steps, temperature=bad)
    with pytest.raises(ValueError, match="temperature"):
        nmst_fast.nmst_log_probs(hidden @ weight.T, eos_index=EOS, steps=steps, temperature=bad)
