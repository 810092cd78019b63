"""The paper's recurrent LMs: fused-head training equals the reference head; decoding plugs in."""

import pytest
import torch

import nmst_fast
from nmst_fast.models import RecurrentLM


@pytest.mark.parametrize("arch", ["rnn", "lstm"])
@pytest.mark.parametrize("head", ["nmst", "st", "va"])
def test_fused_head_equals_reference_head(arch, head):
    torch.manual_seed(0)
    model = RecurrentLM(57, eos_index=56, arch=arch, head=head, eps=1e-3, embedding_dim=16, hidden_size=16 if arch ==
                        "rnn" else 24, impl="chunked").double().eval()
    tokens = torch.randint(0, 56, (3, 9))
    targets = torch.randint(0, 57, (3, 9))
    targets[0, -2:] = -100
    loss = model.loss(tokens, targets)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    hidden, _ = model(tokens)
    ref = nmst_fast.linear_nmst_loss(hidden, model.embedding.weight, targets, eos_index=56, eps=1e-3, head=head,
                                     impl="reference")
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    torch.testing.assert_close(loss, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_paper_sizes_and_tying():
    lstm = RecurrentLM(100, eos_index=99)
    assert lstm.rnn.hidden_size == 512 and lstm.rnn.num_layers == 2 and lstm.drop.p == 0.5
    assert lstm.nmst_head.weight is lstm.embedding.weight and lstm.nmst_head.bias is None
    rnn = RecurrentLM(100, eos_index=99, arch="rnn")
    assert rnn.rnn.hidden_size == 256 and rnn.drop.p == 0.3
    with pytest.raises(ValueError, match="arch"):
        RecurrentLM(100, eos_index=99, arch="gru")


def test_sizes_and_pad_index_are_checked_with_clear_errors():
    """A smaller LSTM than its embedding was torch's "proj_size has to be smaller than hidden_size"
    (an argument the user never gave); an out-of-range pad_index an AssertionError."""
    with pytest.raises(ValueError, match="hidden_size >= embedding_dim"):
        RecurrentLM(20, eos_index=19, arch="lstm", embedding_dim=16, hidden_size=8)
    with pytest.raises(ValueError, match="hidden_size == embedding_dim"):
        RecurrentLM(20, eos_index=19, arch="rnn", embedding_dim=16, hidden_size=8)
    for bad in (25, 20, -1, True):
        with pytest.raises(ValueError, match="pad_index"):
            RecurrentLM(20, eos_index=19, embedding_dim=8, hidden_size=8, pad_index=bad)
    assert RecurrentLM(20, eos_index=19, embedding_dim=8, hidden_size=12).rnn.proj_size == 8


@pytest.mark.parametrize("arch", ["rnn", "lstm"])
def test_generate_with_recurrent_lm(arch):
    torch.manual_seed(1)
    eps = 0.1
    model = RecurrentLM(40, eos_index=39, arch=arch, eps=eps, embedding_dim=8, hidden_size=8).eval()
    contexts = torch.randint(0, 39, (6, 10))
    out = nmst_fast.generate(model, contexts, strategy="greedy", max_length=500)
    assert out.terminated.all() and int(out.lengths.max()) <= nmst_fast.termination_bound(eps)
    beam = nmst_fast.generate(model, contexts, strategy="beam", num_beams=3, max_length=500)
    assert beam.terminated.all()
