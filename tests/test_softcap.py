"""Logit softcapping and logit scale (Gemma 2/3, Cohere, Granite) in the fused loss, every backend.

The heads see y = softcap · tanh(logit_scale · z / softcap), z = hidden @ weight.T + bias. Every
backend is checked against an independent float64 expression (F.linear, the cap written out by
hand, :func:`nmst_fast.nmst_log_probs`, the NLL, autograd), forward and gradients.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nmst_fast

from helpers import DEVICE, LargestTensor, assert_matches_truth, make_case

HEADS = ("nmst", "st", "va")
IMPLS = ("reference", "chunked", "triton")
# (softcap, logit_scale): the cap alone (Gemma), a scale alone (Granite divides by its
# logits_scaling: a scale < 1), both (a Cohere-like scale > 1). test_sum_without_bias adds both with
# a scale < 1, test_flat_layout_and_sum a scale alone > 1.
TRANSFORMS = {
    "softcap": (3.0, None),
    "granite": (None, 0.25),
    "both": (2.0, 1.7),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The shapes here are tiny: a second intra-op thread only waits for a busy core (3x slower on a
    loaded 2-core machine). Restored afterwards for the other test modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _leaves(case, dtype):
    return [None if t is None else t.to(DEVICE, dtype).requires_grad_() for t in (case.hidden, case.weight, case.bias)]


def _grads(loss, leaves, grad_out):
    inputs = [t for t in leaves if t is not None]
    if grad_out is None:
        grad_out = torch.ones_like(loss)
    grads = torch.autograd.grad(loss, inputs, grad_out.to(loss.device, loss.dtype))
    return [loss.detach().double().cpu()] + [g.double().cpu() for g in grads]


def truth(case, softcap, logit_scale, *, reduction="mean", grad_out=None):
    """The independent float64 expression: logits by hand, then the readable log-probabilities."""
    leaves = _leaves(case, torch.float64)
    hidden, weight, bias = leaves
    y = F.linear(hidden, weight, bias)
    if logit_scale is not None:
        y = logit_scale * y
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    log_p = nmst_fast.nmst_log_probs(y, eos_index=case.eos_index, eps=case.eps, head=case.head, steps=case.steps)
    active = case.targets != -100
    nll = -log_p.gather(-1, case.targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    nll = torch.where(active, nll, 0.0)
    loss = {"none": nll, "sum": nll.sum(), "mean": nll.sum() / active.sum().clamp(min=1)}[reduction]
    return _grads(loss, leaves, grad_out)


def fast(case, impl, dtype, softcap, logit_scale, *, reduction="mean", grad_out=None, chunk_size=4):
    leaves = _leaves(case, dtype)
    hidden, weight, bias = leaves
    loss = nmst_fast.linear_nmst_loss(
        hidden, weight, case.targets, eos_index=case.eos_index, eps=case.eps, head=case.head, steps=case.steps,
        bias=bias, reduction=reduction, impl=impl, chunk_size=None if impl == "reference" else chunk_size,
        softcap=softcap, logit_scale=logit_scale,
    )
    return _grads(loss, leaves, grad_out)


def _check(impl, got, want, naive=None, what=""):
    if impl == "triton":  # fp32 math: as accurate as plain fp32 torch, to a small relative slack
        assert_matches_truth(got, naive, want, rel_atol=2e-5, what=what)
        return
    for name, g, t in zip(["loss", "d_hidden", "d_weight", "d_bias"], got, want):
        torch.testing.assert_close(g, t, rtol=1e-10, atol=1e-10, msg=lambda m, name=name: f"{what} {name}: {m}")


def _case(seed, head, *, bias=True, V=37, H=12, shape=(3, 6), logit_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return make_case(gen, head=head, shape=shape, H=H, V=V, bias=bias, logit_scale=logit_scale, eps=0.05)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_matches_the_float64_expression(impl, head, transform):
    """Random inputs, a bias, ignored and eos targets (one whole sequence ignored), several chunks;
    logits of a few units, so the cap is active but not saturated. "mean", and "none" with a random
    upstream gradient (the recompute backward) for the fused backends."""
    softcap, scale = TRANSFORMS[transform]
    seed = sum(map(ord, impl + head + transform))
    case = _case(seed, head, logit_scale=3.0)
    dtype = torch.float32 if impl == "triton" else torch.float64
    for reduction in ("mean", "none"):
        grad_out = torch.rand(case.targets.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        grad_out = grad_out if reduction == "none" else None
        want = truth(case, softcap, scale, reduction=reduction, grad_out=grad_out)
        got = fast(case, impl, dtype, softcap, scale, reduction=reduction, grad_out=grad_out)
        naive = fast(case, "reference", dtype, softcap, scale, reduction=reduction, grad_out=grad_out)
        _check(impl, got, want, naive, what=f"{impl} {head} {transform} {reduction}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("head", HEADS)
def test_sum_without_bias(impl, head):
    case = _case(7, head, bias=False, V=101, H=8, shape=(2, 9), logit_scale=2.0)
    dtype = torch.float32 if impl == "triton" else torch.float64
    want = truth(case, 4.0, 0.8, reduction="sum")
    got = fast(case, impl, dtype, 4.0, 0.8, reduction="sum", chunk_size=5)
    _check(impl, got, want, fast(case, "reference", dtype, 4.0, 0.8, reduction="sum"), what=f"{impl} {head}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("raw_scale, reduction", [(40.0, "none"), (3000.0, "mean")])
def test_the_cap_bites_on_large_logits(impl, head, raw_scale, reduction):
    """Raw |z| far beyond the cap (up to ~1e4 against a cap of 2): y saturates at ±c, the loss stays
    that of bounded logits, and the gradients through the flat tanh (down to sech² ≈ 0) stay right."""
    case = _case(11 + int(raw_scale), head, logit_scale=raw_scale, V=37)
    dtype = torch.float32 if impl == "triton" else torch.float64
    want = truth(case, 2.0, None, reduction=reduction)
    got = fast(case, impl, dtype, 2.0, None, reduction=reduction)
    naive = fast(case, "reference", dtype, 2.0, None, reduction=reduction)
    _check(impl, got, want, naive, what=f"{impl} {head} {raw_scale} {reduction}")
    if head == "va":  # every logit within ±2: no target costs more than log V + 2·2
        assert float(truth(case, 2.0, None, reduction="none")[0].max()) <= math.log(37) + 4.0


@pytest.mark.parametrize("head", ["nmst", "va"])
def test_flat_layout_and_sum(head):
    gen = torch.Generator().manual_seed(5)
    N = 23
    steps = torch.randint(0, 30, (N,), generator=gen).to(DEVICE) if head == "nmst" else None
    case = make_case(gen, head=head, shape=(N,), H=9, V=37, bias=True, steps=steps, logit_scale=4.0)
    for impl, dtype in (("chunked", torch.float64), ("triton", torch.float32)):
        for softcap in (1.5, None):
            want = truth(case, softcap, 2.0, reduction="sum")
            got = fast(case, impl, dtype, softcap, 2.0, reduction="sum", chunk_size=6)
            _check(impl, got, want, fast(case, "reference", dtype, softcap, 2.0, reduction="sum"), what=impl)


def test_bf16_chunked_is_no_worse_than_plain_bf16():
    """The torch row pass differentiates the cap by sech²(z / c) of the raw logits: in bf16, 1 − tanh²
    would round to 0 wherever tanh rounds to 1."""
    case = _case(3, "nmst", logit_scale=6.0, V=101, shape=(4, 6))
    want = truth(case, 3.0, 1.5)
    got = fast(case, "chunked", torch.bfloat16, 3.0, 1.5, chunk_size=7)
    naive = fast(case, "reference", torch.bfloat16, 3.0, 1.5)
    assert_matches_truth(got, naive, want, factor=2.0, rel_atol=1e-2, what="bf16")


@pytest.mark.parametrize("impl", ("chunked", "triton"))
def test_no_transform_and_unit_scale_change_nothing(impl):
    case = _case(2, "st")
    dtype = torch.float32 if impl == "triton" else torch.float64
    plain = fast(case, impl, dtype, None, None)
    for got in (fast(case, impl, dtype, None, 1.0), fast(case, impl, dtype, None, None)):
        for a, b in zip(got, plain):
            assert torch.equal(a, b)


def test_the_kernels_apply_the_cap_on_load():
    from nmst_fast.kernels.split_softmax import split_lse, split_softmax_grad_

    gen = torch.Generator().manual_seed(0)
    rows, V, eos, c = 6, 37, 5, 2.5
    magnitude = torch.tensor([1e-3, 0.3, 3.0, 30.0, 3e3, 3e5], dtype=torch.float64).unsqueeze(1)
    x = torch.randn(rows, V, generator=gen, dtype=torch.float64) * magnitude
    targets = torch.randint(0, V, (rows,), generator=gen)
    targets[0] = eos
    y = c * torch.tanh(x / c)
    lse, z_target = split_lse(x.float().to(DEVICE), targets.to(DEVICE), eos, softcap=c)
    expected_lse = torch.logsumexp(y.masked_fill(torch.arange(V) == eos, float("-inf")), dim=1)
    torch.testing.assert_close(lse.cpu(), expected_lse, rtol=0, atol=1e-6)
    torch.testing.assert_close(z_target.double().cpu(), y.gather(1, targets[:, None]).squeeze(1), rtol=0, atol=1e-6)
    coef, grad_eos, grad_target = (torch.rand(rows, generator=gen) for _ in range(3))
    z = x.float().to(DEVICE)
    split_softmax_grad_(z, targets.to(DEVICE), lse, coef.to(DEVICE), grad_eos.to(DEVICE), grad_target.to(DEVICE), eos,
                        softcap=c)
    dy = coef.double()[:, None] * torch.exp(y - expected_lse[:, None])
    dy[:, eos] = grad_eos.double()
    dy[torch.arange(rows), targets] += grad_target.double()
    torch.testing.assert_close(z.double().cpu(), dy / torch.cosh(x / c) ** 2, rtol=1e-5, atol=1e-7)


# --- validation ---------------------------------------------------------------------------------

BAD_VALUES = [(0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
              (True, TypeError), ("3", TypeError), (torch.tensor(2.0), TypeError)]


@pytest.mark.parametrize("name", ["softcap", "logit_scale"])
@pytest.mark.parametrize("value, exc", BAD_VALUES)
def test_bad_softcap_and_scale_are_refused_by_name(name, value, exc):
    hidden, weight = torch.randn(2, 3, 4), torch.randn(7, 4)
    with pytest.raises(exc, match=name):
        nmst_fast.linear_nmst_loss(hidden, weight, torch.zeros(2, 3, dtype=torch.long), eos_index=1,
                                   impl="chunked", **{name: value})
    with pytest.raises(exc, match=name):
        nmst_fast.NMSTHead(4, 7, eos_index=1, **{name: value})


def test_integer_and_numpy_values_are_accepted():
    np = pytest.importorskip("numpy")
    hidden, weight, targets = torch.randn(2, 3, 4), torch.randn(7, 4), torch.zeros(2, 3, dtype=torch.long)
    a = nmst_fast.linear_nmst_loss(hidden, weight, targets, eos_index=1, impl="chunked", softcap=2, logit_scale=3)
    b = nmst_fast.linear_nmst_loss(hidden, weight, targets, eos_index=1, impl="chunked", softcap=np.float64(2.0),
                                   logit_scale=np.float32(3.0))
    assert torch.equal(a, b)


def test_the_memory_bound_holds_with_a_softcap():
    """The torch row pass's second (chunk, V) buffer is the only extra one, and the default chunk
    halves so the two share the usual byte budget."""
    from nmst_fast.fused import (
        LANE_ALIGN,
        HeadConfig,
        chunk_budget,
        default_chunk_rows,
        fused_backward_from_lse,
        fused_forward,
    )
    from nmst_fast.settings import HeadSettings

    N, H, V, chunk = 300, 8, 400, 32
    h, W, b = torch.randn(N, H), torch.randn(V, H), torch.randn(V)
    y, steps = torch.randint(0, V, (N,)), torch.randint(1, 50, (N,))
    cfg = HeadConfig(HeadSettings("nmst", 1e-3, 7), -100, 1, softcap=3.0)
    with LargestTensor() as mode:
        _, lse, *_ = fused_forward(h, W, b, y, steps, cfg, reduction="mean", backend="chunked", chunk_rows=chunk,
                                   need=(True, True, True))
        fused_backward_from_lse(torch.ones(N), h, W, b, y, steps, lse, cfg, backend="chunked", chunk_rows=chunk,
                                need=(True, True, True))
    assert mode.largest <= max(chunk * V, V * H)
    one = default_chunk_rows(10**6, 50257, torch.float32, torch.device("cpu"))
    two = default_chunk_rows(10**6, 50257, torch.float32, torch.device("cpu"), buffers=2)
    # halved, less at most the rows that keep a chunk a multiple of LANE_ALIGN rows
    assert 2 * two * 50257 * 4 <= chunk_budget(torch.device("cpu")) and two >= one // 2 - LANE_ALIGN


def test_the_op_takes_the_softcap_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    N, H, V = 6, 4, 7
    h, W = torch.randn(N, H), torch.randn(V, H)
    y, s = torch.randint(0, V, (N,)), torch.arange(1, N + 1)
    args = (h, W, None, y, s, 1, "nmst", 2, 0.1, -100, "none", "chunked", 4, True, True, False, 2.0)
    real = torch.ops.nmst_fast.linear_loss(*args)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.ops.nmst_fast.linear_loss(*args)
    assert [t.shape for t in real] == [t.shape for t in fake]
    back = (torch.ones(N), h, W, None, y, s, real[1], 1, "nmst", 2, 0.1, -100, "chunked", 4, True, True, False, 2.0)
    dh, dw, _ = torch.ops.nmst_fast.linear_loss_backward(*back)
    hh, WW = h.double().requires_grad_(), W.double().requires_grad_()
    log_p = nmst_fast.nmst_log_probs(2.0 * torch.tanh(hh @ WW.T / 2.0), eos_index=2, eps=0.1, head="nmst", steps=s)
    want_dh, want_dw = torch.autograd.grad(-log_p.gather(1, y[:, None]).sum(), [hh, WW])
    torch.testing.assert_close(dh.double(), want_dh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw.double(), want_dw, rtol=1e-5, atol=1e-6)


# --- NMSTHead -----------------------------------------------------------------------------------

def test_head_forward_gives_the_capped_logits_and_loss_matches():
    torch.manual_seed(0)
    H, V = 8, 37
    head = nmst_fast.NMSTHead(H, V, eos_index=3, head="st", eps=0.05, bias=True, impl="chunked",
                              softcap=2.0, logit_scale=0.5)
    with torch.no_grad():
        head.weight.mul_(20.0)
        head.bias.normal_()
    hidden = torch.randn(2, 5, H)
    targets = torch.randint(0, V, (2, 5))
    expected = 2.0 * torch.tanh(0.5 * F.linear(hidden, head.weight, head.bias) / 2.0)
    torch.testing.assert_close(head(hidden), expected)
    assert float(head(hidden).detach().abs().max()) <= 2.0
    direct = nmst_fast.linear_nmst_loss(hidden, head.weight, targets, eos_index=3, eps=0.05, head="st",
                                        bias=head.bias, impl="chunked", softcap=2.0, logit_scale=0.5)
    torch.testing.assert_close(head.loss(hidden, targets), direct)
    log_p = head.log_probs(hidden)
    nll = -log_p.gather(-1, targets.unsqueeze(-1)).mean()
    torch.testing.assert_close(head.loss(hidden, targets), nll, rtol=1e-5, atol=1e-6)
    assert "softcap=2.0" in repr(head) and "logit_scale=0.5" in repr(head)
    assert "softcap" not in repr(nmst_fast.NMSTHead(H, V, eos_index=3))


def test_head_ties_an_existing_bias():
    H, V = 6, 11
    lm_head = nn.Linear(H, V, bias=True)
    with torch.no_grad():
        lm_head.bias.normal_()
    before = lm_head.bias.detach().clone()
    head = nmst_fast.NMSTHead(H, V, eos_index=0, weight=lm_head.weight, bias=lm_head.bias, impl="chunked",
                              softcap=5.0)
    assert head.bias is lm_head.bias and head.weight is lm_head.weight
    assert torch.equal(head.bias, before)  # the owner's values, not re-initialized
    head.reset_parameters()
    assert torch.equal(head.bias, before)
    hidden = torch.randn(2, 4, H)
    torch.testing.assert_close(head(hidden), 5.0 * torch.tanh(lm_head(hidden) / 5.0))
    head.loss(hidden, torch.randint(0, V, (2, 4))).backward()
    assert lm_head.bias.grad is not None and lm_head.bias.grad.abs().sum() > 0
    assert "bias=True" in repr(head)
    own = nmst_fast.NMSTHead(H, V, eos_index=0, bias=True)
    assert isinstance(own.bias, nn.Parameter) and own.bias is not lm_head.bias and torch.equal(own.bias, torch.zeros(V))
    assert nmst_fast.NMSTHead(H, V, eos_index=0, bias=False).bias is None


@pytest.mark.parametrize("bias, exc", [(torch.zeros(11), TypeError), (nn.Parameter(torch.zeros(10)), ValueError),
                                       (1, TypeError), ("yes", TypeError)])
def test_head_refuses_a_bad_bias(bias, exc):
    with pytest.raises(exc, match="bias"):
        nmst_fast.NMSTHead(6, 11, eos_index=0, bias=bias)
