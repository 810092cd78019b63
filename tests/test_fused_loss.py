"""Fast backends (chunked torch, Triton) against the float64 reference: forward and gradients."""

import pytest
import torch
import torch.nn.functional as F

import nmst_fast

from helpers import DEVICE, FAST_IMPLS, Case, assert_matches_truth, make_case, run

HEADS = ("nmst", "st", "va")


def _truth_and_naive(case, dtype, **kw):
    return run(case, "reference", torch.float64, **kw), run(case, "reference", dtype, **kw)


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_random_shapes_fp32(impl, head, reduction, bias):
    seed = torch.seed() % 2**31  # fresh every run; printed on failure
    gen = torch.Generator().manual_seed(seed)
    B, T = int(torch.randint(1, 5, (1,), generator=gen)), int(torch.randint(1, 10, (1,), generator=gen))
    H = [3, 17, 33][seed % 3]
    V = [2, 37, 131, 1000][seed % 4]
    case = make_case(gen, head=head, shape=(B, T), H=H, V=V, bias=bias, eps=[1e-8, 1e-3, 0.5][seed % 3])
    grad_out = torch.rand(B, T, generator=gen).to(DEVICE) if reduction == "none" else None
    chunk = int(torch.randint(1, B * T + 2, (1,), generator=gen))
    fast = run(case, impl, torch.float32, reduction=reduction, chunk_size=chunk, grad_out=grad_out)
    truth, naive = _truth_and_naive(case, torch.float32, reduction=reduction, grad_out=grad_out)
    assert_matches_truth(fast, naive, truth, rel_atol=2e-5, what=f"seed={seed} B,T,H,V={B, T, H, V} chunk={chunk}")


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("head", ["nmst", "va"])
def test_flat_layout_with_explicit_steps(impl, head):
    gen = torch.Generator().manual_seed(11)
    N = 23
    steps = torch.randint(0, 40, (N,), generator=gen).to(DEVICE) if head == "nmst" else None
    case = make_case(gen, head=head, shape=(N,), H=9, V=77, bias=True, steps=steps)
    dtype = torch.float64 if impl == "chunked" else torch.float32  # Triton computes in fp32: fp64 is refused
    fast = run(case, impl, dtype, chunk_size=5)
    truth = run(case, "reference", torch.float64)
    tol = 1e-10 if impl == "chunked" else 1e-5
    for f, t in zip(fast, truth):
        torch.testing.assert_close(f, t, rtol=tol, atol=tol)


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("head", HEADS)
def test_float64_is_exact(impl, head):
    """In float64 the chunked path agrees with the spec to rounding; Triton computes in fp32, so it
    refuses float64 inputs rather than return fp32-accurate results for them (as it did)."""
    gen = torch.Generator().manual_seed(3)
    case = make_case(gen, head=head, shape=(3, 8), H=16, V=129, bias=True)
    if impl == "triton":
        with pytest.raises(ValueError, match="float64"):
            run(case, impl, torch.float64, reduction="none", chunk_size=7)
        return
    fast = run(case, impl, torch.float64, reduction="none", chunk_size=7)
    truth = run(case, "reference", torch.float64, reduction="none")
    for f, t in zip(fast, truth):
        torch.testing.assert_close(f, t, rtol=1e-10, atol=1e-10)


def test_auto_takes_the_chunked_path_for_float64_on_cuda():
    from nmst_fast.loss import resolve_impl

    assert resolve_impl("auto", torch.device("cuda"), torch.float64) == "chunked"
    assert resolve_impl("auto", torch.device("cpu"), torch.float32) == "chunked"


@pytest.mark.parametrize("impl", FAST_IMPLS + ("reference",))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_an_empty_batch_has_zero_loss_and_zero_gradients(impl, reduction):
    """No rows: the chunk count divided by zero, and with an explicit chunk size the weight
    gradient came back uninitialized (no chunk ever wrote it)."""
    for chunk_size in (None, 4):
        hidden = torch.zeros(0, 8, device=DEVICE, requires_grad=True)
        weight = torch.randn(11, 8, device=DEVICE, requires_grad=True)
        bias = torch.randn(11, device=DEVICE, requires_grad=True)
        loss = nmst_fast.linear_nmst_loss(hidden, weight, torch.zeros(0, dtype=torch.long, device=DEVICE),
                                          eos_index=3, head="va", bias=bias, reduction=reduction, impl=impl,
                                          chunk_size=None if impl == "reference" else chunk_size)
        assert loss.shape == ((0,) if reduction == "none" else ())
        loss.sum().backward()
        assert float(loss.sum()) == 0.0
        assert torch.equal(weight.grad, torch.zeros_like(weight)) and torch.equal(bias.grad, torch.zeros_like(bias))
        assert hidden.grad is None or hidden.grad.numel() == 0


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp32_loss_keeps_its_digits_at_large_logits(impl, reduction):
    """Logits shifted by 1e4: L rounded to fp32 before L − z_target cost ~1e-4 of the loss (ulp of
    1e4); L is kept in float64 now, so the loss is as accurate as F.cross_entropy's (the gradient of
    "none", rebuilt from L in fp32 by the Triton kernel, keeps its earlier accuracy)."""
    gen = torch.Generator().manual_seed(17)
    hidden = torch.randn(6, 8, generator=gen)
    weight = torch.randn(40, 8, generator=gen)
    targets = torch.randint(0, 40, (6,), generator=gen)
    for shift in (100.0, 1e4):
        bias = torch.full((40,), shift)
        exact = F.cross_entropy(hidden.double() @ weight.double().T + bias.double(), targets, reduction=reduction)
        ce32 = F.cross_entropy(hidden @ weight.T + bias, targets, reduction=reduction).double()
        ours = nmst_fast.linear_nmst_loss(hidden.to(DEVICE), weight.to(DEVICE), targets.to(DEVICE), eos_index=0,
                                          head="va", bias=bias.to(DEVICE), reduction=reduction,
                                          impl=impl).double().cpu()
        assert float((ours - exact).abs().max()) <= 4 * float((ce32 - exact).abs().max()) + 1e-6, shift


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("head", HEADS)
def test_many_rows(impl, head):
    """B·T in the thousands, many chunks, V not a multiple of any block."""
    N_rows = {"chunked": (40, 100), "triton": (8, 64)}[impl]
    gen = torch.Generator().manual_seed(5)
    case = make_case(gen, head=head, shape=N_rows, H=24, V=333, bias=False)
    fast = run(case, impl, torch.float32, chunk_size=700)
    truth, naive = _truth_and_naive(case, torch.float32)
    assert_matches_truth(fast, naive, truth, rel_atol=2e-5, what=f"N={N_rows}")


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("head", HEADS)
def test_bf16(impl, head):
    gen = torch.Generator().manual_seed(7)
    case = make_case(gen, head=head, shape=(4, 12), H=64, V=500, bias=True, logit_scale=4.0)
    fast = run(case, impl, torch.bfloat16, chunk_size=13)
    truth, naive = _truth_and_naive(case, torch.bfloat16)
    # The truth uses the bf16-rounded inputs, so only arithmetic error is compared.
    rounded = Case(*(t.to(torch.bfloat16).double() if torch.is_tensor(t) and t.is_floating_point() else t
                     for t in (case.hidden, case.weight, case.bias, case.targets, case.steps)),
                   case.eos_index, case.eps, case.head)
    truth = run(rounded, "reference", torch.float64)
    assert_matches_truth(fast, naive, truth, factor=2.0, rel_atol=1e-2, what="bf16")


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_upstream_gradient_scales_every_grad(impl, dtype):
    """A non-unit upstream gradient scales dh, dW and db formed in the forward (dW and db leave
    their fp32 accumulators scaled and cast in one step); reductions "mean" and "sum"."""
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    case = make_case(gen, head="nmst", shape=(3, 7), H=16, V=131, bias=True, logit_scale=2.0)
    rounded = Case(*(t.to(dtype).double() if torch.is_tensor(t) and t.is_floating_point() else t
                     for t in (case.hidden, case.weight, case.bias, case.targets, case.steps)),
                   case.eos_index, case.eps, case.head)
    for reduction in ("mean", "sum"):
        grad_out = (torch.rand((), generator=gen) * 6 - 3).to(DEVICE)
        fast = run(case, impl, dtype, reduction=reduction, chunk_size=5, grad_out=grad_out)
        naive = run(case, "reference", dtype, reduction=reduction, grad_out=grad_out)
        truth = run(rounded, "reference", torch.float64, reduction=reduction, grad_out=grad_out)
        assert_matches_truth(fast, naive, truth, factor=2.0, rel_atol=1e-2 if dtype == torch.bfloat16 else 2e-5,
                             what=f"seed={seed} {reduction} upstream={float(grad_out):.3f}")


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("head", HEADS)
def test_extreme_logits(impl, head):
    """|z| up to ~1e4: confident, saturated predictions must stay finite and accurate."""
    gen = torch.Generator().manual_seed(13)
    case = make_case(gen, head=head, shape=(3, 9), H=8, V=97, bias=True, logit_scale=2500.0)
    truth = run(case, "reference", torch.float64)
    z = case.hidden @ case.weight.T + case.bias
    assert z.abs().max() > 5e3
    fast = run(case, impl, torch.float32, chunk_size=10)
    naive = run(case, "reference", torch.float32)
    assert_matches_truth(fast, naive, truth, rel_atol=1e-5, what="extreme")


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("eps", [1e-8, 1e-5, 1e-2, 0.5])
def test_large_steps_and_eps_range(impl, eps):
    gen = torch.Generator().manual_seed(17)
    N = 40
    steps = torch.cat([torch.tensor([0, 1, 2, 10**7]), torch.randint(1, 10**7, (N - 4,), generator=gen)])
    case = make_case(gen, head="nmst", shape=(N,), H=12, V=64, bias=False, eps=eps, steps=steps.to(DEVICE))
    fast = run(case, impl, torch.float32, reduction="none", chunk_size=16)
    truth, naive = _truth_and_naive(case, torch.float32, reduction="none")
    assert_matches_truth(fast, naive, truth, rel_atol=2e-5, what=f"eps={eps}")


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_st_long_sequence_and_context(impl):
    """ST's running sum over a long T, with context positions (t <= 0) at the start."""
    gen = torch.Generator().manual_seed(19)
    B, T = 2, 300
    steps = (torch.arange(T) - 9).expand(B, T).to(DEVICE)  # 10 context positions, then 1, 2, ...
    case = make_case(gen, head="st", shape=(B, T), H=8, V=50, bias=True, eps=1e-3, steps=steps)
    case.targets[:, :10][case.targets[:, :10] == case.eos_index] = -100  # eos is impossible in context
    fast = run(case, impl, torch.float32, chunk_size=128)
    truth, naive = _truth_and_naive(case, torch.float32)
    assert_matches_truth(fast, naive, truth, rel_atol=2e-5, what="st long")


@pytest.mark.parametrize("impl", FAST_IMPLS + ("reference",))
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_targets_ignored(impl, head, reduction):
    gen = torch.Generator().manual_seed(23)
    case = make_case(gen, head=head, shape=(2, 5), H=6, V=20, bias=True, ignore_frac=1.0)
    loss, *grads = run(case, impl, torch.float32, reduction=reduction)
    assert torch.equal(loss, torch.zeros_like(loss))
    for g in grads:
        assert torch.isfinite(g).all()
        if head != "st":
            assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_va_equals_cross_entropy(impl):
    gen = torch.Generator().manual_seed(29)
    case = make_case(gen, head="va", shape=(5, 7), H=10, V=211, bias=True)
    dtype = torch.float64 if impl == "chunked" else torch.float32  # Triton's math is fp32: it refuses fp64
    h, W, b = (t.to(DEVICE, dtype).requires_grad_() for t in (case.hidden, case.weight, case.bias))
    expected = F.cross_entropy((h @ W.T + b).reshape(-1, 211), case.targets.reshape(-1), ignore_index=-100)
    got = nmst_fast.linear_nmst_loss(h, W, case.targets, eos_index=case.eos_index, head="va", bias=b, impl=impl,
                                     chunk_size=8)
    tol = 1e-6 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    for g_got, g_exp in zip(torch.autograd.grad(got, (h, W, b)), torch.autograd.grad(expected, (h, W, b))):
        torch.testing.assert_close(g_got, g_exp, rtol=tol, atol=tol)


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradcheck_chunked(head, reduction):
    gen = torch.Generator().manual_seed(31)
    case = make_case(gen, head=head, shape=(2, 3), H=4, V=6, bias=True, ignore_frac=0.15, eps=0.2)
    h, W, b = (t.clone().requires_grad_() for t in (case.hidden, case.weight, case.bias))

    def f(h, W, b):
        return nmst_fast.linear_nmst_loss(h, W, case.targets.cpu(), eos_index=case.eos_index, eps=case.eps,
                                          head=head, bias=b, reduction=reduction, impl="chunked", chunk_size=4)

    assert torch.autograd.gradcheck(f, (h, W, b))


def test_gradcheck_reference():
    gen = torch.Generator().manual_seed(37)
    for head in HEADS:
        case = make_case(gen, head=head, shape=(2, 3), H=4, V=6, bias=True, eps=0.2)
        h, W, b = (t.clone().requires_grad_() for t in (case.hidden, case.weight, case.bias))
        assert torch.autograd.gradcheck(
            lambda h, W, b: nmst_fast.linear_nmst_loss(h, W, case.targets.cpu(), eos_index=case.eos_index,
                                                       eps=0.2, head=head, bias=b, impl="reference"), (h, W, b))


def test_only_some_inputs_need_grad():
    gen = torch.Generator().manual_seed(41)
    case = make_case(gen, head="nmst", shape=(2, 6), H=5, V=30, bias=True)
    h = case.hidden.clone().requires_grad_()
    W, b = case.weight.clone(), case.bias.clone()  # frozen output layer
    loss = nmst_fast.linear_nmst_loss(h, W, case.targets.cpu(), eos_index=case.eos_index, eps=case.eps, bias=b,
                                      impl="chunked")
    (g,) = torch.autograd.grad(loss, (h,))
    ref = nmst_fast.linear_nmst_loss(h, W, case.targets.cpu(), eos_index=case.eos_index, eps=case.eps, bias=b,
                                     impl="reference")
    torch.testing.assert_close(g, torch.autograd.grad(ref, (h,))[0])
    with torch.no_grad():
        torch.testing.assert_close(
            nmst_fast.linear_nmst_loss(h, W, case.targets.cpu(), eos_index=case.eos_index, eps=case.eps, bias=b),
            ref.detach())


def test_loss_used_twice_scales_gradients():
    """Gradients formed in the forward pass are scaled by the real upstream gradient."""
    gen = torch.Generator().manual_seed(43)
    case = make_case(gen, head="st", shape=(2, 6), H=5, V=30, bias=False)
    h = case.hidden.clone().requires_grad_()
    loss = nmst_fast.linear_nmst_loss(h, case.weight, case.targets.cpu(), eos_index=case.eos_index, head="st",
                                      impl="chunked")
    (g_twice,) = torch.autograd.grad(3.0 * loss + loss**2, (h,))
    ref = nmst_fast.linear_nmst_loss(h, case.weight, case.targets.cpu(), eos_index=case.eos_index, head="st",
                                     impl="reference")
    (g_ref,) = torch.autograd.grad(3.0 * ref + ref**2, (h,))
    torch.testing.assert_close(g_twice, g_ref)


@pytest.mark.parametrize("dtype, chunk_size", [(torch.float32, 7), (torch.float64, None), (torch.bfloat16, None)])
def test_a_unit_upstream_gradient_hands_out_the_forwards_gradients_without_aliasing_a_kept_graph(dtype, chunk_size,
                                                                                                   monkeypatch):
    """On CPU "mean"'s 1/N is in the forward's gradients (fp32, fp64; bf16 in one chunk), so a unit upstream gradient
    needs no pass: backward hands out those in the parameters' dtype as they are, unless the graph is kept, where the
    next backward must not see what the caller did to the first one's gradients. Each way equals the reference."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = make_case(gen, head="nmst", shape=(3, 11), H=16, V=131, bias=True, logit_scale=2.0)
    leaves = [t.to(dtype).requires_grad_() for t in (case.hidden, case.weight, case.bias)]

    def loss_of(impl):
        return nmst_fast.linear_nmst_loss(leaves[0], leaves[1], case.targets, eos_index=case.eos_index, eps=case.eps,
                                          steps=case.steps, bias=leaves[2], impl=impl, chunk_size=chunk_size)

    truth = run(Case(*(t.to(dtype).double() if torch.is_tensor(t) and t.is_floating_point() else t
                       for t in (case.hidden, case.weight, case.bias, case.targets, case.steps)),
                     case.eos_index, case.eps, case.head), "reference", torch.float64)[1:]
    loss = loss_of("chunked")
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    for got, ref in zip(first, truth):
        assert float((got.double() - ref).norm() / ref.norm()) < (2e-2 if dtype == torch.bfloat16 else 1e-5)
    kept = [g.clone() for g in first]
    for g in first:
        g.zero_()  # the caller's own use of the first gradients
    second = torch.autograd.grad(loss, leaves)
    assert all(torch.equal(a, b) for a, b in zip(second, kept))
    passes = []
    scale_cast = nmst_fast.ops.scale_cast
    monkeypatch.setattr(nmst_fast.ops, "scale_cast", lambda *args: passes.append(args) or scale_cast(*args))
    loss = loss_of("chunked")
    loss.backward()
    assert all(torch.equal(leaf.grad, g) for leaf, g in zip(leaves, kept))
    # no pass over dW (bf16's float32 dh and db are cast in one)
    assert not (passes if dtype != torch.bfloat16 else [a for a in passes if a[0].shape == leaves[1].shape])


def test_targets_of_any_integer_dtype_and_ignore_index_checked():
    """int16 / uint8 targets pass validation, so every backend takes them (the reference's gather
    needed int64); a non-integer ignore_index is a TypeError naming it, before any kernel runs."""
    gen = torch.Generator().manual_seed(19)
    hidden, weight = torch.randn(2, 5, 8, generator=gen), torch.randn(30, 8, generator=gen)
    targets = torch.randint(0, 30, (2, 5), generator=gen)
    want = nmst_fast.linear_nmst_loss(hidden, weight, targets, eos_index=4, impl="reference")
    for impl in ("chunked", "reference"):
        for dtype in (torch.int16, torch.uint8):
            got = nmst_fast.linear_nmst_loss(hidden, weight, targets.to(dtype), eos_index=4, impl=impl)
            torch.testing.assert_close(got, want)
    for bad in (-100.0, None, True):
        with pytest.raises(TypeError, match="ignore_index"):
            nmst_fast.linear_nmst_loss(hidden, weight, targets, eos_index=4, ignore_index=bad)
    with pytest.raises(ValueError, match="ignore_index must fit in int64"):  # was a bare OverflowError
        nmst_fast.linear_nmst_loss(hidden, weight, targets, eos_index=4, ignore_index=2**70)


def test_uint8_targets_keep_the_token_ignore_index_wraps_to():
    """In uint8, -100 wraps to 156: `targets != ignore_index` dropped every target 156 from the
    loss, and an out-of-range 156 passed the range check."""
    gen = torch.Generator().manual_seed(23)
    hidden, weight = torch.randn(1, 4, 8, generator=gen), torch.randn(200, 8, generator=gen)
    targets = torch.tensor([[156, 3, 156, 5]])
    for impl in ("chunked", "reference"):
        want = nmst_fast.linear_nmst_loss(hidden, weight, targets, eos_index=0, impl=impl, reduction="none")
        got = nmst_fast.linear_nmst_loss(hidden, weight, targets.to(torch.uint8), eos_index=0, impl=impl,
                                         reduction="none")
        assert float(got[0, 0]) > 0.0
        torch.testing.assert_close(got, want)
        with pytest.raises(ValueError, match="outside"):
            nmst_fast.linear_nmst_loss(hidden, weight[:100], targets.to(torch.uint8), eos_index=0, impl=impl)


@pytest.mark.parametrize("impl", FAST_IMPLS + ("reference",))
@pytest.mark.parametrize("head", HEADS)
def test_empty_sequences_have_zero_loss(impl, head):
    """(B, 0, H): ST's view of the rows along T was ambiguous for T = 0 (a RuntimeError)."""
    hidden = torch.zeros(2, 0, 8, device=DEVICE, requires_grad=True)
    weight = torch.randn(11, 8, device=DEVICE, requires_grad=True)
    loss = nmst_fast.linear_nmst_loss(hidden, weight, torch.zeros(2, 0, dtype=torch.long, device=DEVICE),
                                      eos_index=3, head=head, impl=impl)
    loss.backward()
    assert float(loss) == 0.0 and torch.equal(weight.grad, torch.zeros_like(weight))


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_autocast_casts_the_projection_inputs_as_f_linear_would(impl, reduction):
    """Under torch.autocast the loss is the loss of the autocast-dtype inputs (the projection is a
    matmul), whole: the op's eos GEMV was re-cast alone (fp32 inputs got a bf16 eos logit, the
    gradients of "mean" ~1e-3 off); AMP's bf16 hidden states with an fp32 head weight were refused."""
    gen = torch.Generator().manual_seed(29)
    hidden = torch.randn(2, 7, 16, generator=gen).to(DEVICE)
    weight = torch.randn(70, 16, generator=gen).to(DEVICE).requires_grad_()
    targets = torch.randint(0, 70, (2, 7), generator=gen).to(DEVICE)
    low = torch.get_autocast_dtype(DEVICE)
    for h in (hidden, hidden.to(low)):  # fp32 (a final LayerNorm's output) or already low (a Linear's)
        h = h.detach().requires_grad_()
        with torch.autocast(h.device.type):
            got = nmst_fast.linear_nmst_loss(h, weight, targets, eos_index=5, head="nmst", impl=impl,
                                             reduction=reduction)
        got.sum().backward()
        got_dh, got_dw = h.grad, weight.grad
        weight.grad = None
        h2 = h.detach().to(low).requires_grad_()
        w2 = weight.detach().to(low).requires_grad_()
        want = nmst_fast.linear_nmst_loss(h2, w2, targets, eos_index=5, head="nmst", impl=impl, reduction=reduction)
        want.sum().backward()
        assert got.dtype == torch.float32 and got_dw.dtype == torch.float32 and got_dh.dtype == h.dtype
        torch.testing.assert_close(got.to(low), want, rtol=0, atol=0)  # the same op, its loss left in fp32
        torch.testing.assert_close(got_dw, w2.grad.float(), rtol=0, atol=0)
        torch.testing.assert_close(got_dh, h2.grad.to(h.dtype), rtol=0, atol=0)


def test_double_backward_is_refused_not_silently_zero():
    """The fused paths hand back gradients computed in the forward: their own derivatives were zero
    (a zero Hessian, with no error). create_graph=True is now refused; the reference differentiates twice."""
    torch.manual_seed(0)
    h = torch.randn(1, 3, 3, dtype=torch.float64, requires_grad=True)
    W = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([[0, 2, 1]])

    def loss(x, impl):
        return nmst_fast.linear_nmst_loss(x, W, y, eos_index=1, eps=0.2, head="nmst", impl=impl)

    assert torch.autograd.functional.hessian(lambda x: loss(x, "reference"), h).abs().max() > 0.1
    h32 = h.detach().float().requires_grad_()
    W = W.detach().float().requires_grad_()  # the Triton kernels compute in fp32
    for impl in FAST_IMPLS:
        with pytest.raises(RuntimeError, match="no second derivatives"):
            torch.autograd.grad(loss(h32, impl), h32, create_graph=True)
        first, = torch.autograd.grad(loss(h32, impl), h32)  # first order still works
        torch.testing.assert_close(first, torch.autograd.grad(loss(h32, "reference"), h32)[0])


def test_the_op_computes_a_bias_gradient_only_for_a_bias():
    """Called directly with need_grad_bias and no bias, the op's real and fake kernels disagreed
    (a (V,) zero gradient vs an empty one) and its backward raised AttributeError."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    N, H, V = 6, 4, 7
    h, W = torch.randn(N, H), torch.randn(V, H)
    y, s = torch.randint(0, V, (N,)), torch.arange(1, N + 1)
    args = (h, W, None, y, s, 1, "nmst", 2, 0.1, -100, "mean", "chunked", 4, True, True, True)
    real = torch.ops.nmst_fast.linear_loss(*args)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.ops.nmst_fast.linear_loss(*args)
    assert real[4].shape == fake[4].shape == (0,)
    back = (torch.ones(N), h, W, None, y, s, real[1], 1, "nmst", 2, 0.1, -100, "chunked", 4, True, True, True)
    assert torch.ops.nmst_fast.linear_loss_backward(*back)[2].shape == (0,)


def test_the_loss_runs_on_meta_tensors():
    """Shape dry runs of a model built on the meta device: the autocast probe raised for "meta"."""
    V, H = 7, 4
    h = torch.randn(2, 3, H, device="meta", requires_grad=True)
    W = torch.randn(V, H, device="meta", requires_grad=True)
    y = torch.zeros(2, 3, dtype=torch.long, device="meta")
    for impl in ("chunked", "reference"):
        loss = nmst_fast.linear_nmst_loss(h, W, y, eos_index=2, impl=impl, validate=False)
        assert loss.shape == () and loss.device.type == "meta"


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_fp16_mean_gradients_survive_loss_scaling(impl):
    """"mean" formed dz = p_v / N in fp16 before backward scaled by the upstream gradient: a
    GradScaler's scale came too late, and rarely-targeted rows' dW lost 20-80% (0.04% for fp16
    F.cross_entropy). Now the forward forms the sum's gradients and backward divides, in fp32."""
    gen = torch.Generator().manual_seed(3)
    N, H, V, scale = 1024, 8, 3000, 1024.0  # p_v / N of a rare row ≈ 3e-7: fp16 subnormal
    hidden = torch.randn(N, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.3
    targets = torch.randint(0, V // 2, (N,), generator=gen)  # tokens V/2.. are never targets

    steps = torch.randint(1, 60, (N,), generator=gen)

    def grads(impl, dtype):
        h, w = (t.detach().to(DEVICE, dtype).requires_grad_() for t in (hidden, weight))
        loss = nmst_fast.linear_nmst_loss(h, w, targets.to(DEVICE), eos_index=0, head="nmst", eps=0.01, impl=impl,
                                          steps=steps.to(DEVICE))
        (loss * scale).backward()
        return h.grad.double().cpu() / scale, w.grad.double().cpu() / scale

    truth_dh, truth_dw = grads("reference", torch.float64)
    dh, dw = grads(impl, torch.float16)
    rare = slice(V // 2, V)
    assert (dw[rare] - truth_dw[rare]).norm() / truth_dw[rare].norm() < 2e-3
    assert (dh - truth_dh).norm() / truth_dh.norm() < 2e-3


@pytest.mark.parametrize("impl", FAST_IMPLS + ("reference",))
def test_autocast_fp16_loss_takes_a_default_grad_scaler(impl):
    """Under fp16 autocast the loss came back fp16, and GradScaler's default scale, 65536 > fp16's
    max, reached backward as inf: every gradient inf (F.cross_entropy's AMP loss is fp32)."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 8, 16, generator=gen).to(DEVICE).requires_grad_()
    w = torch.randn(50, 16, generator=gen).to(DEVICE).requires_grad_()
    y = torch.randint(0, 50, (2, 8), generator=gen).to(DEVICE)
    scaler = torch.amp.GradScaler(h.device.type)
    with torch.autocast(h.device.type, dtype=torch.float16):
        loss = nmst_fast.linear_nmst_loss(h, w, y, eos_index=0, head="nmst", impl=impl)
    assert loss.dtype == torch.float32
    scaler.scale(loss).backward()
    assert torch.isfinite(w.grad).all() and torch.isfinite(h.grad).all()
