"""GPT-2 through HF transformers: our decoding agrees with HF's own on a small random model."""

import pytest
import torch
import transformers  # a test dependency (setup.py extra "test")

from nmst_fast.generation import generate
from nmst_fast.integrations.hf_gpt2 import GPT2Decoder


def _model(seed: int):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=49, eos_token_id=49)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        # Random init gives near-uniform, tie-prone logits: make them decisive, and tilt the
        # final LayerNorm toward eos so that some beams finish early and others never do.
        model.transformer.wte.weight *= 20
        eos_direction = model.transformer.wte.weight[49] / model.transformer.wte.weight[49].norm()
        model.transformer.ln_f.bias += 2.5 * eos_direction
    return model


@pytest.mark.parametrize("num_beams", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_search_agrees_with_hf(num_beams, seed):
    model = _model(seed)
    contexts = torch.randint(0, 49, (3, 5), generator=torch.Generator().manual_seed(seed))
    max_new = 16
    with torch.no_grad():
        hf = model.generate(contexts, attention_mask=torch.ones_like(contexts), num_beams=num_beams, do_sample=False,
                            max_new_tokens=max_new, eos_token_id=49, pad_token_id=49, length_penalty=0.0,
                            early_stopping=True)
    ours = generate(GPT2Decoder(model, head="va"), contexts, strategy="beam", num_beams=num_beams,
                    max_length=max_new)
    for b in range(contexts.shape[0]):
        hf_cont = hf[b, contexts.shape[1]:].tolist()
        if 49 in hf_cont:
            hf_cont = hf_cont[: hf_cont.index(49) + 1]
        assert ours.tokens[b, : ours.lengths[b]].tolist() == hf_cont, f"item {b}"
        assert bool(ours.terminated[b]) == (hf_cont[-1] == 49)


def test_the_agreement_cases_cover_finished_and_unfinished_beams():
    """Guard for the test above: its models must produce both kinds of outcome."""
    outcomes = set()
    for seed in range(3):
        contexts = torch.randint(0, 49, (3, 5), generator=torch.Generator().manual_seed(seed))
        for num_beams in (2, 4):
            out = generate(GPT2Decoder(_model(seed), head="va"), contexts, strategy="beam", num_beams=num_beams,
                           max_length=16)
            outcomes |= set(out.terminated.tolist())
    assert outcomes == {True, False}


def test_greedy_agrees_with_hf():
    model = _model(3)
    contexts = torch.randint(0, 49, (4, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf = model.generate(contexts, attention_mask=torch.ones_like(contexts), do_sample=False, max_new_tokens=15,
                            eos_token_id=49, pad_token_id=49)
    ours = generate(GPT2Decoder(model, head="va"), contexts, strategy="greedy", max_length=15)
    for b in range(4):
        hf_cont = hf[b, 6:].tolist()
        if 49 in hf_cont:
            hf_cont = hf_cont[: hf_cont.index(49) + 1]
        assert ours.tokens[b, : ours.lengths[b]].tolist() == hf_cont
