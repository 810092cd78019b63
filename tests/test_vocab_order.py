"""The gradient filter's vocabulary order (:mod:`nmst_fast.vocab_order`): where a vocabulary's ids scatter the likely
tokens, the CPU backends sort it by mean logit, so that the filter skips the blocks of unlikely ones; the loss and
the gradients come back in the caller's order."""

import warnings

import pytest
import torch

import nmst_fast
from benchmarks.grad_filter import peaked_rows
from nmst_fast import grad_filter
from nmst_fast.vocab_order import ordered, vocabulary_order


def _scrambled(N, H, V, seed):
    """Peaked rows (a Zipf prior, frequent tokens first) with the vocabulary's ids shuffled, as a real tokenizer's
    ids are to a corpus's frequencies; eos is the last id."""
    hidden, weight = peaked_rows(N, H, V, seed=seed)
    shuffle = torch.randperm(V, generator=torch.Generator().manual_seed(seed))
    weight = weight[shuffle].contiguous()
    targets = torch.multinomial((hidden @ weight.t()).softmax(1), 1,
                                generator=torch.Generator().manual_seed(seed)).squeeze(1)
    return hidden, weight, targets


def test_the_order_is_taken_only_where_the_ids_scatter_the_likely_tokens():
    hidden, weight = peaked_rows(1024, 64, 20000, seed=3)
    assert vocabulary_order(hidden, weight, None) is None  # frequency-numbered: the identity packs them already
    shuffle = torch.randperm(20000, generator=torch.Generator().manual_seed(3))
    order = vocabulary_order(hidden, weight[shuffle], None)
    assert order is not None and torch.equal(order.sort().values, torch.arange(20000))
    mean_logit = weight[shuffle] @ hidden.mean(0)
    assert (mean_logit[order].diff() <= 1e-5).all()  # descending mean logit (the order's, in float32)
    flat = torch.randn(1024, 64, dtype=torch.float64), torch.randn(20000, 64, dtype=torch.float64) / 8
    assert vocabulary_order(*flat, None) is None  # random rows: the mean logits hardly spread


def test_the_order_is_chosen_outside_autograd():
    """Its product of W with the rows' mean leaves no graph and no warning on tensors that require grad."""
    hidden, weight = peaked_rows(256, 32, 4000, seed=4)
    weight = weight[torch.randperm(4000, generator=torch.Generator().manual_seed(4))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        order = vocabulary_order(hidden.requires_grad_(), weight.requires_grad_(), None)
    assert order is not None and not order.requires_grad


def test_ordered_renumbers_targets_and_eos_and_returns_gradients_in_the_callers_order():
    weight = torch.randn(7, 3, requires_grad=True)
    bias = torch.randn(7, requires_grad=True)
    order = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    targets = torch.tensor([3, -100, 6, 9, 0])  # an ignored and an out-of-range target are left for the checks
    w, b, t, eos = ordered(order, weight, bias, targets, eos_index=6)
    assert torch.equal(w, weight[order]) and torch.equal(b, bias[order])
    assert t.tolist() == [0, -100, 2, 9, 1] and eos == 2
    (w * torch.arange(21.0).view(7, 3)).sum().backward()
    expected = torch.zeros(7, 3)
    expected[order] = torch.arange(21.0).view(7, 3)
    assert torch.equal(weight.grad, expected)


@pytest.mark.parametrize("head", ["nmst", "st", "va"])
def test_a_scrambled_vocabulary_is_skipped_as_a_frequency_numbered_one(head):
    """With the ids shuffled, the identity keeps every block (each holds some likely token); the order keeps about
    what the frequency-numbered vocabulary keeps, and the filtered bf16 gradients stay near the unfiltered ones'
    error against float64 (within 1.25x: a block of the order mixes tokens of similar mean logit from all over the
    vocabulary, whose deviations from its mean row are larger than a frequency-numbered block's)."""
    B, T, H, V = 4, 256, 64, 20000
    hidden, weight, targets = _scrambled(B * T, H, V, seed=11)
    eos = V - 1

    def grads(dtype, g):
        h = hidden.view(B, T, H).to(dtype, copy=True).requires_grad_()
        w = weight.to(dtype, copy=True).requires_grad_()
        with grad_filter.recorded_kept_shares() as kept:
            loss = nmst_fast.linear_nmst_loss(h, w, targets.view(B, T), eos_index=eos, head=head, chunk_size=256,
                                              grad_filter=g, impl="chunked")
            loss.backward()
        return loss.double(), h.grad.double(), w.grad.double(), kept

    exact = grads(torch.float64, None)
    unfiltered = grads(torch.bfloat16, None)
    filtered = grads(torch.bfloat16, "auto")
    assert max(filtered[3]) < 0.5
    torch.testing.assert_close(filtered[0], unfiltered[0], rtol=0, atol=0)  # the forward is not filtered
    for i in (1, 2):
        error = [((g[i] - exact[i]).norm() / exact[i].norm()).item() for g in (unfiltered, filtered)]
        assert error[1] <= 1.25 * error[0], error


def test_a_target_out_of_range_is_refused_under_the_order():
    hidden, weight, targets = _scrambled(64, 16, 3000, seed=2)
    targets[5] = 3000
    with pytest.raises(ValueError, match="targets"):
        nmst_fast.linear_nmst_loss(hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_(), targets,
                                   eos_index=2999, steps=torch.arange(1, 65), grad_filter="auto")


@pytest.mark.parametrize("impl_kernels", [True, False])
def test_a_filter_that_keeps_every_block_is_the_unfiltered_loss_on_the_sorted_vocabulary(impl_kernels, monkeypatch):
    """The filtered call (its threshold below every entry) sorts the vocabulary and changes nothing else: bit for
    bit with the C++ row kernels, to float32 rounding with torch's row ops."""
    if not impl_kernels:
        monkeypatch.setattr("nmst_fast.fused.row_kernels", lambda: None)
    hidden, weight, targets = _scrambled(300, 24, 4000, seed=5)
    hidden, weight = hidden.float(), weight.float()
    bias = 0.1 * torch.randn(4000)
    targets[::7] = -100
    order = vocabulary_order(hidden, weight, bias)
    assert order is not None
    position = torch.empty_like(order).index_put_((order,), torch.arange(4000))
    steps = torch.arange(1, 301)
    runs = []
    for w, b, t, eos, g in ((weight[order], bias[order], torch.where(targets >= 0, position[targets.clamp(min=0)],
                                                                      targets), int(position[3999]), None),
                            (weight, bias, targets, 3999, 1e-30)):
        h, w = hidden.clone().requires_grad_(), w.clone().requires_grad_()
        loss = nmst_fast.linear_nmst_loss(h, w, t, eos_index=eos, steps=steps, bias=b, grad_filter=g, chunk_size=64)
        loss.backward()
        runs.append((loss, h.grad, w.grad))
    sorted_run, filtered = runs
    assert torch.equal(sorted_run[0], filtered[0])
    if impl_kernels:  # the same products, bit for bit
        assert torch.equal(sorted_run[1], filtered[1]) and torch.equal(sorted_run[2][position], filtered[2])
    else:  # torch's row ops add the one-hot terms and eos's column apart, in float64, where a filter runs
        torch.testing.assert_close(filtered[1], sorted_run[1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(filtered[2], sorted_run[2][position], rtol=1e-5, atol=1e-6)
