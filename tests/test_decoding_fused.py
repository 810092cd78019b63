"""The one-read Triton selection (interpreter on CPU): exact greedy, exact sampling distribution."""

import pytest
import torch

from nmst_fast.decoding import effective_logits, sample
from nmst_fast.decoding.fused import fused_select

from test_decoding import DRAWS, _g_test, _reference_log_probs, _row, _st_state_before

HEADS = ("nmst", "st", "va")


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_greedy_equals_torch_path(head, temperature):
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(300, 70, generator=gen).round(decimals=1)  # many ties
    steps = torch.randint(-2 if head == "st" else 0, 60, (300,), generator=gen)
    state = torch.rand(300, generator=gen, dtype=torch.float64).neg() if head == "st" else None
    fused, fused_state = sample(z, head=head, eos_index=13, eps=0.02, steps=steps, state=state, top_k=1,
                                temperature=temperature, impl="triton")
    torch_path, torch_state = sample(z, head=head, eos_index=13, eps=0.02, steps=steps, state=state, top_k=1,
                                     temperature=temperature, impl="torch")
    assert torch.equal(fused, torch_path)
    with_top_p, _ = sample(z, head=head, eos_index=13, eps=0.02, steps=steps, state=state, top_k=1, top_p=0.5,
                           temperature=temperature, impl="triton")  # top-p after top-1: still greedy
    assert torch.equal(with_top_p, torch_path)
    if head == "st":
        torch.testing.assert_close(fused_state, torch_state)


@pytest.mark.parametrize("head", HEADS)
def test_fused_log_probs_of_chosen_tokens(head):
    z = torch.randn(50, 33, generator=torch.Generator().manual_seed(1)) * 2
    picked = fused_select(z, head=head, eos_index=4, eps=0.1, steps=7, greedy=False,
                          generator=torch.Generator().manual_seed(2))
    expected = effective_logits(z, head=head, eos_index=4, eps=0.1, steps=7).token_log_probs(picked.tokens)
    torch.testing.assert_close(picked.log_probs, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("head,t", [("nmst", 1), ("nmst", 300), ("st", 20), ("va", 1)])
def test_fused_sampling_distribution(head, t):
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    eos, eps = 2, 0.01
    z = _row(gen, V=16)
    state = _st_state_before(z, eos, eps, t) if head == "st" else None
    reference = torch.exp(_reference_log_probs(z, head, eos, eps, t))
    tokens, _ = sample(z.unsqueeze(0).expand(DRAWS, -1), head=head, eos_index=eos, eps=eps, steps=t,
                       state=None if state is None else state.expand(DRAWS), impl="triton",
                       generator=torch.Generator().manual_seed(seed + 1))
    assert _g_test(tokens, reference) > 1e-5, f"seed={seed}"


def test_fused_rejects_truncation_and_nan():
    z = torch.randn(4, 20)
    with pytest.raises(ValueError, match="top-k/top-p"):
        sample(z, head="nmst", eos_index=0, top_k=4, impl="triton")
    with pytest.raises(ValueError, match="impl"):
        sample(z, head="nmst", eos_index=0, impl="cuda")
    bad = z.clone()
    bad[3, 5] = float("nan")
    with pytest.raises(ValueError, match="row 3"):
        sample(bad, head="nmst", eos_index=0, top_k=1, impl="triton")
