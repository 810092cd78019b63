"""The fused loss's gradient filter (``grad_filter``): dh's and dW's products skip the vocabulary blocks whose
gradient entries are all below the threshold, in every fused backend.

What it may change is bounded, entry by entry: a skipped entry is the smooth part of dz (the softmax term, without a
target's one-hot term), smaller than g times the largest row coefficient. So each row of dh moves by at most the sum
of ‖W_v‖ · |dz_rv| over its entries under that bound, and each row of dW by the sum of ‖h_r‖ · |dz_rv|; the loss, db,
eos's column and the one-hot terms do not move at all. The tests check those bounds against the float64 reference's
dz, that the filter does skip (the results move), and that a filter that keeps everything changes nothing."""

import pytest
import torch

import nmst_fast
from benchmarks.grad_filter import peaked_rows
from nmst_fast import grad_filter
from nmst_fast.vocab_order import vocabulary_order

HEADS = ("nmst", "st", "va")


@pytest.fixture(params=["cpu_kernels", "torch_ops", "triton"])
def backend(request, monkeypatch):
    """The fused backends: the C++ row kernels, torch's row ops (where those cannot build), Triton's (interpreter)."""
    if request.param == "torch_ops":
        monkeypatch.setattr("nmst_fast.fused.row_kernels", lambda: None)
    return request.param


def _loss_and_grads(hidden, weight, bias, targets, steps, head, upstream, eos, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    loss = nmst_fast.linear_nmst_loss(h, w, targets, eos_index=eos, head=head, steps=steps, bias=b,
                                      reduction="none", **kw)
    loss.backward(upstream)
    return loss.detach(), h.grad, w.grad, None if b is None else b.grad


def _smooth_dz(hidden, weight, bias, targets, steps, head, upstream, eos, softcap=None):
    """The float64 reference's dz (N, V) without the targets' one-hot terms and eos's column: what the filter may
    skip."""
    logits = (hidden.double() @ weight.double().t() + (0 if bias is None else bias.double())).requires_grad_()
    eye = torch.eye(logits.shape[-1], dtype=torch.float64)
    loss = nmst_fast.linear_nmst_loss(logits, eye, targets, eos_index=eos, head=head, steps=steps,
                                      reduction="none", impl="reference", softcap=softcap)
    (dz,) = torch.autograd.grad(loss, logits, upstream.double())
    dz, targets, upstream = dz.reshape(-1, dz.shape[-1]), targets.reshape(-1), upstream.reshape(-1).double()
    rows = torch.arange(len(targets))
    keep = (targets != -100) & (targets != eos)
    one_hot = upstream[keep]
    if softcap is not None:  # the cap's derivative at the target's raw logit
        raw = logits.detach().reshape(-1, logits.shape[-1])[rows[keep], targets[keep]]
        one_hot = one_hot / torch.cosh(raw / softcap).square()
    dz[rows[keep], targets[keep]] += one_hot  # the one-hot term: -upstream at the target
    dz[:, eos] = 0
    return dz


@pytest.fixture
def kept():
    """Each filtered chunk's share of the vocabulary kept, as the test's calls filter them."""
    with grad_filter.recorded_kept_shares() as shares:
        yield shares


def _case(seed, V, eos, bias):
    torch.manual_seed(seed)
    B, T, H = 3, 37, 24
    hidden, weight = peaked_rows(B * T, H, V, gamma=2.0, seed=seed)
    targets = torch.randint(0, V, (B * T,))
    targets[::9] = eos
    targets[5::13] = -100
    steps = torch.arange(1, T + 1).repeat(B)
    upstream = torch.rand(B * T, dtype=torch.float64) + 0.5
    b = 0.1 * torch.randn(V, dtype=torch.float64) if bias else None
    return hidden.view(B, T, H), weight, b, targets.view(B, T), steps.view(B, T), upstream.view(B, T)


def _positions(backend, hidden, weight, bias) -> torch.Tensor:
    """Each vocabulary entry's position in the order the filter runs on: the CPU backends sort the vocabulary by
    mean logit (:mod:`nmst_fast.vocab_order`) where the mean logits spread, Triton keeps the identity."""
    V = weight.shape[0]
    order = None if backend == "triton" else vocabulary_order(hidden.reshape(-1, hidden.shape[-1]), weight, bias)
    if order is None:
        return torch.arange(V)
    return torch.empty(V, dtype=torch.long).index_put_((order,), torch.arange(V))


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("seed,V,eos,bias,softcap", [(0, 1037, 1036, False, None), (1, 700, 300, True, None),
                                                      (2, 513, 0, False, 4.0)])
def test_what_the_filter_changes_stays_within_its_bound(backend, head, seed, V, eos, bias, softcap, kept):
    hidden, weight, b, targets, steps, upstream = _case(seed, V, eos, bias)
    # Triton computes in float32: its inputs are float32, the bound's slack that float32's
    dtype = torch.float32 if backend == "triton" else torch.float64
    slack = 1e-4 if dtype == torch.float32 else 1e-10
    impl = "triton" if backend == "triton" else "chunked"
    hidden, weight, b = hidden.to(dtype), weight.to(dtype), None if b is None else b.to(dtype)
    args = (hidden, weight, b, targets, steps, head, upstream.to(dtype), eos)
    exact = _loss_and_grads(*args, impl=impl, chunk_size=32, softcap=softcap)
    smooth = _smooth_dz(*args, softcap=softcap).view(-1, V).abs()
    probs_of_targets = smooth.gather(1, targets.view(-1, 1).clamp(min=0)).squeeze(1) / upstream.view(-1)
    assert probs_of_targets.max() < 0.5  # every target's one-hot term dominates its entry (the bound's premise)
    position = _positions(backend, hidden, weight, b)
    # the loss: no filter in the forward; its sums run in the vocabulary's order, the last bit may move with it
    loss_rtol = 0 if torch.equal(position, torch.arange(V)) else 8 * torch.finfo(dtype).eps
    for g in (1e-3, 0.3):
        got = _loss_and_grads(*args, impl=impl, chunk_size=32, grad_filter=g, softcap=softcap)
        torch.testing.assert_close(got[0], exact[0], rtol=loss_rtol, atol=0)
        if b is not None:
            torch.testing.assert_close(got[3], exact[3], rtol=slack, atol=slack)
        skippable = torch.where(smooth < g * upstream.max(), smooth, 0.0)
        h, w = hidden.reshape(-1, hidden.shape[-1]).double(), weight.double()
        block = position // grad_filter.FILTER_BLOCK  # the blocks the filter forms
        off_eos = torch.arange(V) != eos
        counts = torch.bincount(block[off_eos]).double()
        means = torch.zeros(len(counts), w.shape[1], dtype=torch.float64).index_add_(0, block[off_eos], w[off_eos])
        means /= counts.clamp(min=1).unsqueeze(1)
        # a skipped entry moves dh by dz·(W_v − its block's mean row), dW_v by its own dz·h and by its block's share
        dh_bound = skippable @ (w.norm(dim=1) + means[block].norm(dim=1))
        per_row = skippable * h.norm(dim=1, keepdim=True)
        block_total = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, block, per_row.sum(0))
        dw_bound = per_row.sum(0) + (block_total / counts.clamp(min=1))[block]
        dh_bound += slack * (1 + exact[1].reshape(len(h), -1).double().norm(dim=1))
        dw_bound += slack * (1 + exact[2].double().norm(dim=1))
        dh_moved = (got[1] - exact[1]).reshape(len(h), -1).double().norm(dim=1)
        dw_moved = (got[2] - exact[2]).double().norm(dim=1)
        assert (dh_moved <= dh_bound).all(), (dh_moved - dh_bound).max()
        assert (dw_moved <= dw_bound).all(), (dw_moved - dw_bound).max()
        assert dw_moved[eos] <= slack * (1 + exact[2][eos].double().norm())  # eos's column is never filtered
        if g == 0.3:  # the filter did skip blocks
            assert min(kept) < 1


@pytest.mark.parametrize("head", HEADS)
def test_rows_whose_target_is_eos_keep_their_gradient(backend, head):
    hidden, weight, b, targets, steps, upstream = _case(3, 600, 599, False)
    dtype = torch.float32 if backend == "triton" else torch.float64
    impl = "triton" if backend == "triton" else "chunked"
    targets = torch.full_like(targets, 599)
    args = (hidden.to(dtype), weight.to(dtype), None, targets, steps, head, upstream.to(dtype), 599)
    exact = _loss_and_grads(*args, impl=impl, chunk_size=32)
    got = _loss_and_grads(*args, impl=impl, chunk_size=32, grad_filter=0.5)
    if head == "va":  # eos is a token like the others there: only its own column is kept whole
        torch.testing.assert_close(got[2][599], exact[2][599])
    else:  # NMST / ST rows with eos targets: a gradient through s alone
        torch.testing.assert_close(got[1], exact[1])
        torch.testing.assert_close(got[2], exact[2])


def test_a_filter_that_keeps_every_block_changes_nothing(backend):
    """Nothing but the vocabulary's order, where the backend sorts it: the unfiltered loss on the vocabulary in that
    order, its gradients put back, is the filtered one's."""
    hidden, weight, b, targets, steps, upstream = _case(4, 777, 776, True)
    impl = "triton" if backend == "triton" else "chunked"
    args = (hidden.float(), weight.float(), b.float(), targets, steps, "nmst", upstream.float(), 776)
    position = _positions(backend, args[0], args[1], args[2])  # (the identity here: test_vocab_order's sort)
    order = torch.empty_like(position).index_put_((position,), torch.arange(777))
    sorted_targets = torch.where(targets >= 0, position[targets.clamp(min=0)], targets)
    for reduction in ("mean", "none"):
        kw = dict(impl=impl, chunk_size=40)
        h0, w0 = args[0].clone().requires_grad_(), args[1][order].clone().requires_grad_()
        h1, w1 = args[0].clone().requires_grad_(), args[1].clone().requires_grad_()
        for h, w, bias, t, eos, g in ((h0, w0, args[2][order], sorted_targets, int(position[776]), None),
                                      (h1, w1, args[2], targets, 776, 1e-30)):
            loss = nmst_fast.linear_nmst_loss(h, w, t, eos_index=eos, steps=steps, bias=bias,
                                              reduction=reduction, grad_filter=g, **kw)
            loss.sum().backward()
        w0.grad = w0.grad[position]  # back in the vocabulary's own order
        if backend == "cpu_kernels":  # the same products, bit for bit
            assert torch.equal(h0.grad, h1.grad) and torch.equal(w0.grad, w1.grad)
        else:  # the one-hot terms and eos's column are added apart, in float64, not in the chunk
            torch.testing.assert_close(h1.grad, h0.grad, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(w1.grad, w0.grad, rtol=1e-5, atol=1e-6)


def test_the_mean_is_filtered_as_the_sum(backend):
    """For "mean", the forward's gradients are the sum's (unit row weights): the same blocks are skipped."""
    hidden, weight, b, targets, steps, upstream = _case(5, 650, 649, False)
    impl = "triton" if backend == "triton" else "chunked"
    hidden, weight = hidden.float(), weight.float()
    grads = []
    for reduction in ("mean", "sum"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = nmst_fast.linear_nmst_loss(h, w, targets, eos_index=649, steps=steps, reduction=reduction,
                                          impl=impl, chunk_size=48, grad_filter=0.01)
        loss.backward()
        grads.append((h.grad, w.grad))
    count = (targets != -100).sum()
    torch.testing.assert_close(grads[0][0] * count, grads[1][0])
    torch.testing.assert_close(grads[0][1] * count, grads[1][1])


@pytest.mark.parametrize("dtype,expected", [(torch.bfloat16, 2.0**-12), (torch.float16, 2.0**-15),
                                            (torch.float32, None), (torch.float64, None)])
def test_auto_takes_cut_cross_entropys_threshold_in_low_precision_only(dtype, expected):
    assert nmst_fast.validation.resolve_grad_filter("auto", dtype) == expected
    assert nmst_fast.validation.resolve_grad_filter(None, dtype) is None
    assert nmst_fast.validation.resolve_grad_filter(0.01, dtype) == 0.01


@pytest.mark.parametrize("bad,error", [("on", ValueError), (0.0, ValueError), (1.0, ValueError), (-1e-3, ValueError),
                                       (True, TypeError), ([0.1], TypeError)])
def test_a_bad_grad_filter_is_refused_before_any_kernel(bad, error, monkeypatch):
    monkeypatch.setattr(nmst_fast.ops, "fused_forward", lambda *a, **k: pytest.fail("a kernel ran"))
    with pytest.raises(error, match="grad_filter"):
        nmst_fast.linear_nmst_loss(torch.randn(4, 8), torch.randn(11, 8), torch.randint(0, 11, (4,)), eos_index=10,
                                   steps=torch.arange(1, 5), grad_filter=bad)


@pytest.mark.parametrize("chunk_size", [128, None])  # None: one chunk, whose dW is one bf16 GEMM (direct_dw)
def test_bf16_filtered_gradients_are_as_accurate_as_unfiltered_ones(chunk_size, kept):
    """On peaked rows, "auto" (2^-12 in bf16) skips most blocks, and what it changes (the skipped entries' deviations
    from their blocks' means) is below bf16's own rounding of the products: the filtered bf16 gradients' error
    against float64 stays within 1.1x the unfiltered bf16 gradients' error."""
    N, H, V, eos = 512, 128, 8191, 8190
    hidden, weight = peaked_rows(N, H, V, seed=6)
    targets = torch.multinomial((hidden @ weight.t()).softmax(1), 1, generator=torch.Generator().manual_seed(6))
    targets = targets.squeeze(1)
    targets[::17] = eos
    steps = torch.arange(N) % 100 + 1
    upstream = torch.ones(N, dtype=torch.float64)
    exact = _loss_and_grads(hidden, weight, None, targets, steps, "nmst", upstream, eos, impl="chunked")
    errors = {}
    for g in (None, "auto"):
        bf = _loss_and_grads(hidden.bfloat16(), weight.bfloat16(), None, targets, steps, "nmst",
                             upstream.bfloat16(), eos, impl="chunked", chunk_size=chunk_size, grad_filter=g)
        errors[g] = [((a.double() - e).norm() / e.norm()).item() for a, e in zip(bf[1:3], exact[1:3])]
    assert max(kept) < 0.6  # the workload is peaked enough for the filter to skip about half of the blocks or more
    for unfiltered, filtered in zip(errors[None], errors["auto"]):
        assert filtered <= 1.1 * unfiltered, errors



@pytest.mark.parametrize("chunk_size", [None, 16])
def test_flat_rows_among_peaked_ones_keep_their_exact_gradient(backend, chunk_size, kept):
    """A flat row's skipped blocks hold most of its mass, and the softmax's tilt towards its hidden state, which no
    block mean carries: such rows' skipped products are formed exactly (dh now, dW once a chunk's rows are held: with
    16-row chunks, within the chunk loop and at its end), while the chunk's peaked rows skip."""
    gen = torch.Generator().manual_seed(7)
    N, H, V = 256, 128, 8191
    hidden, weight = peaked_rows(N, H, V, seed=7)
    flat = slice(3, N, 8)  # 2 of every 16 rows
    hidden[flat] = 0.05 * torch.randn(N // 8, H, generator=gen, dtype=torch.float64)  # every p near 1/V < 2^-12
    peaked = torch.ones(N, dtype=torch.bool)
    peaked[flat] = False
    targets = torch.randint(0, V, (N,), generator=gen)
    steps = torch.arange(1, N + 1)
    dtype = torch.float32 if backend == "triton" else torch.float64  # Triton computes in float32
    slack = 1e-4 if dtype == torch.float32 else 1e-10
    impl = "triton" if backend == "triton" else "chunked"

    def grads(upstream, grad_filter=None):
        return _loss_and_grads(hidden.to(dtype), weight.to(dtype), None, targets, steps, "nmst", upstream.to(dtype),
                               V - 1, impl=impl, chunk_size=chunk_size, grad_filter=grad_filter)

    ones = torch.ones(N, dtype=torch.float64)
    exact = grads(ones)
    got = grads(ones, 2.0**-12)
    assert min(kept) < 0.75  # the chunks skipped blocks
    dh_scale = exact[1][flat].abs().max()
    torch.testing.assert_close(got[1][flat], exact[1][flat], rtol=slack, atol=slack * dh_scale)
    peaked_moved = (got[1][peaked] - exact[1][peaked]).norm()
    assert peaked_moved > 1e-9 * exact[1].norm()  # the peaked rows took the block means instead
    # dW is linear in the rows' upstream weights under one plan: the peaked rows' filtered part (the flat rows
    # weighted 0 hold no mass: neither heavy nor kept) plus the flat rows' exact part (unfiltered, peaked rows at 0)
    peaked_part = grads(torch.where(peaked, ones, 0.0), 2.0**-12)[2]
    flat_part = grads(torch.where(peaked, 0.0, ones))[2]
    # (by norm, against the flat part's: their skipped entries are about 1% of it, float32's rounding of the peaked
    # part 0.001%)
    residual = (got[2] - peaked_part - flat_part).double().norm()
    assert residual <= (1e-3 if dtype == torch.float32 else 1e-9) * flat_part.double().norm(), residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V, eos", [(3001, 3000), (512, 0), (100, 57)])
def test_the_block_means_with_or_without_the_cpu_kernels(dtype, V, eos, monkeypatch):
    """Each block's mean row of W, eos's row left out, the last block partial: the kernels' one read of W and torch's
    sums (where the kernels are not built, and on CUDA) both equal float64's."""
    W = torch.randn(V, 40).to(dtype)
    block = grad_filter.FILTER_BLOCK
    rows = [[v for v in range(b, min(V, b + block)) if v != eos] for b in range(0, V, block)]
    want = torch.stack([W[r].double().mean(0) for r in rows])
    means = grad_filter.GradFilter(2**-12, W, 16, eos).block_means()
    monkeypatch.setattr(grad_filter, "row_kernels", lambda: None)
    torch_means = grad_filter.GradFilter(2**-12, W, 16, eos).block_means()
    for got in (means, torch_means):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eos", [-1, 5, 300, 530, 800, 1100, 1299])
def test_the_spread_goes_to_each_block_by_runs_as_row_by_row(dtype, eos):
    """finish's spread, written by runs of adjacent blocks alike: a block some chunk wrote takes += its spread, one no
    chunk wrote = its spread, one neither written nor skipped = 0; eos's row keeps its own gradient (0 where its
    block was never written); the vocabulary's last block is short."""
    V, H, block = 1300, 8, grad_filter.FILTER_BLOCK  # 6 blocks, the last of 20 rows
    gate = grad_filter.GradFilter(2**-12, torch.randn(V, H).to(dtype), 16, eos)
    gate.written = [True, False, False, True, False, False]
    gate._spread_any = [True, True, True, False, False, True]  # add, set, set, (kept), zero, set
    gate._spread = torch.randn(gate.blocks, H)
    dw = torch.randn(V, H).to(dtype)
    want = dw.double().clone()
    counts = gate._counts.double()
    for b in range(gate.blocks):
        rows = slice(b * block, min(V, (b + 1) * block))
        share = gate._spread[b].double() / counts[b]
        if gate.written[b] and gate._spread_any[b]:
            want[rows] = (dw[rows].float() + share.to(dtype).float()).to(dtype).double()
        elif gate._spread_any[b]:
            want[rows] = share.to(dtype).double()
        elif not gate.written[b]:
            want[rows] = 0
    if eos >= 0:
        want[eos] = dw[eos].double() if gate.written[eos // block] else 0
    gate.finish_dw_(dw, accumulate=None, add_sparse=None)
    assert gate.written == [True] * gate.blocks
    torch.testing.assert_close(dw.double(), want, rtol=0, atol=0)
