"""GPT-2 through HF transformers: our decoding agrees with HF's own on a small random model."""

import pytest
import torch
import transformers  # a test dependency (pyproject.toml extra "test")

from nmst_fast.generation import generate
from nmst_fast.integrations.hf_gpt2 import GPT2Decoder


def _model(seed: int, scale: float = 20.0, eos_tilt: float = 2.5):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=49, eos_token_id=49)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        # Random init gives near-uniform, tie-prone logits: make them decisive, and tilt the
        # final LayerNorm toward eos so that some beams finish early and others never do.
        model.transformer.wte.weight *= scale
        eos_direction = model.transformer.wte.weight[49] / model.transformer.wte.weight[49].norm()
        model.transformer.ln_f.bias += eos_tilt * eos_direction
    return model


# Beam search's test models: decisive logits (finished beams only early, else the horizon), and
# softer ones where eos wins at lengths 1-12 even when live beams keep competing (early_stopping=False).
BEAM_MODELS = {"decisive": dict(scale=20.0, eos_tilt=2.5), "soft": dict(scale=4.0, eos_tilt=1.0)}


@pytest.mark.parametrize("early_stopping, length_penalty", [(False, 0.0), (True, 0.0), ("never", 0.0),
                                                             (False, 1.0), (True, 1.0), ("never", 1.0)])
@pytest.mark.parametrize("num_beams", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("family", sorted(BEAM_MODELS))
def test_beam_search_agrees_with_hf(num_beams, seed, early_stopping, length_penalty, family):
    model = _model(seed, **BEAM_MODELS[family])
    contexts = torch.randint(0, 49, (3, 5), generator=torch.Generator().manual_seed(seed))
    max_new = 16
    with torch.no_grad():
        hf = model.generate(contexts, attention_mask=torch.ones_like(contexts), num_beams=num_beams, do_sample=False,
                            max_new_tokens=max_new, eos_token_id=49, pad_token_id=49, length_penalty=length_penalty,
                            early_stopping=early_stopping)
    ours = generate(GPT2Decoder(model, head="va"), contexts, strategy="beam", num_beams=num_beams,
                    max_length=max_new, length_penalty=length_penalty, early_stopping=early_stopping)
    for b in range(contexts.shape[0]):
        hf_cont = hf[b, contexts.shape[1]:].tolist()
        if 49 in hf_cont:
            hf_cont = hf_cont[: hf_cont.index(49) + 1]
        assert ours.tokens[b, : ours.lengths[b]].tolist() == hf_cont, f"item {b}"
        assert bool(ours.terminated[b]) == (hf_cont[-1] == 49)


@pytest.mark.parametrize("early_stopping", [True, False])
def test_the_agreement_cases_cover_finished_and_unfinished_beams(early_stopping):
    """Guard for the test above: its models must produce both kinds of outcome under each stopping
    rule, and terminated hypotheses of more than one token."""
    outcomes, lengths = set(), set()
    for family in BEAM_MODELS.values():
        for seed in range(3):
            contexts = torch.randint(0, 49, (3, 5), generator=torch.Generator().manual_seed(seed))
            for num_beams in (2, 4):
                out = generate(GPT2Decoder(_model(seed, **family), head="va"), contexts, strategy="beam",
                               num_beams=num_beams, max_length=16, early_stopping=early_stopping)
                outcomes |= set(out.terminated.tolist())
                lengths |= set(out.lengths[out.terminated].tolist())
    assert outcomes == {True, False}
    assert max(lengths) > 2


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


# --- training patch and HF-generate processor ------------------------------------------------

from nmst_fast import linear_nmst_loss  # noqa: E402
from nmst_fast.integrations.hf import steps_from_positions  # noqa: E402
from nmst_fast.integrations.hf_gpt2 import apply_nmst_to_gpt2  # noqa: E402


def _train_batch(seed=0, B=3, T=14):
    ids = torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, -4:] = -100  # a padded tail
    return ids, labels


def test_patched_va_loss_equals_hf_loss_and_gradients():
    ids, labels = _train_batch()
    plain = _model(4).train()
    torch.manual_seed(0)  # dropout draws the same masks in both runs
    hf_loss = plain(ids, labels=labels).loss
    hf_loss.backward()
    patched = apply_nmst_to_gpt2(_model(4).train(), head="va")
    torch.manual_seed(0)
    out = patched(ids, labels=labels)
    assert out.logits is None  # the (B, T, V) logits were never formed
    out.loss.backward()
    torch.testing.assert_close(out.loss, hf_loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(plain.named_parameters(), patched.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("head", ["nmst", "st"])
def test_patched_nmst_loss_equals_reference_on_hidden_states(head):
    ids, labels = _train_batch(1)
    model = apply_nmst_to_gpt2(_model(5).eval(), head=head, eps=0.05, context_length=4)
    loss = model(ids, labels=labels).loss
    hidden = model.transformer(ids).last_hidden_state
    steps = steps_from_positions(torch.arange(ids.shape[1]), 4)[1:].expand(ids.shape[0], -1)
    assert steps[0, :4].tolist() == [0, 0, 0, 1]  # tokens 0..3 are the context; token 4 is t = 1
    expected = linear_nmst_loss(hidden[:, :-1], model.lm_head.weight, labels[:, 1:], eos_index=49, eps=0.05,
                                head=head, steps=steps, impl="reference")
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    total = model(ids, labels=labels, num_items_in_batch=7).loss  # HF Trainer's gradient-accumulation scaling
    n = int((labels[:, 1:] != -100).sum())
    torch.testing.assert_close(total, expected * n / 7, rtol=1e-5, atol=1e-6)


def test_settings_survive_save_pretrained_and_conflicts_are_refused(tmp_path):
    model = apply_nmst_to_gpt2(_model(6), head="st", eps=0.01, context_length=3)
    model.save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    apply_nmst_to_gpt2(loaded)  # no arguments: the recorded head is used, never vanilla by default
    assert loaded.config.nmst == dict(head="st", eps=0.01, context_length=3, eos_token_id=49)
    with pytest.raises(ValueError, match="head='st'"):
        apply_nmst_to_gpt2(transformers.GPT2LMHeadModel.from_pretrained(tmp_path), head="va")
    with pytest.raises(ValueError, match="eps"):
        apply_nmst_to_gpt2(_model(6), eps=1.5)


@pytest.mark.parametrize("head", ["nmst", "st", "va"])
def test_hf_greedy_of_the_head_equals_our_generate(head):
    model = apply_nmst_to_gpt2(_model(7), head=head, eps=0.05)
    contexts = torch.randint(0, 49, (4, 6), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        hf = model.generate(contexts, attention_mask=torch.ones_like(contexts), do_sample=False, max_new_tokens=20,
                            eos_token_id=49, pad_token_id=49)
    ours = generate(GPT2Decoder(model), contexts, strategy="greedy", max_length=20)
    for b in range(4):
        hf_cont = hf[b, 6:].tolist()
        if 49 in hf_cont:
            hf_cont = hf_cont[: hf_cont.index(49) + 1]
        assert ours.tokens[b, : ours.lengths[b]].tolist() == hf_cont, f"row {b}"


@pytest.mark.parametrize("num_beams", [2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_hf_beam_search_on_the_nmst_distribution_agrees_with_ours(num_beams, seed):
    """HF's own beam search (and greedy) of the model with the head decodes NMST — equal to ours."""
    model = apply_nmst_to_gpt2(_model(seed), head="nmst", eps=0.05)
    contexts = torch.randint(0, 49, (3, 5), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        # early_stopping left at HF's default
        hf = model.generate(contexts, attention_mask=torch.ones_like(contexts), num_beams=num_beams, do_sample=False,
                            max_new_tokens=16, eos_token_id=49, pad_token_id=49, length_penalty=0.0)
        hf_greedy = model.generate(contexts, attention_mask=torch.ones_like(contexts), do_sample=False,
                                   max_new_tokens=16, eos_token_id=49, pad_token_id=49)
    plain = _model(seed)  # the same weights, decoded by nmst_fast
    ours = generate(GPT2Decoder(plain, head="nmst", eps=0.05), contexts, strategy="beam", num_beams=num_beams,
                    max_length=16)
    ours_greedy = generate(GPT2Decoder(plain, head="nmst", eps=0.05), contexts, strategy="greedy", max_length=16)
    for out, mine in ((hf, ours), (hf_greedy, ours_greedy)):
        for b in range(contexts.shape[0]):
            cont = out[b, contexts.shape[1]:].tolist()
            if 49 in cont:
                cont = cont[: cont.index(49) + 1]
            assert mine.tokens[b, : mine.lengths[b]].tolist() == cont, f"item {b}"


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_generate_refuses_more_positions_than_gpt2_has(strategy):
    """Context + fed tokens beyond n_positions indexed past GPT-2's position table (an IndexError on
    CPU, a device-side assert on CUDA): refused up front; the longest allowed run reaches the end."""
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=49, eos_token_id=49)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # eos held far down: every continuation runs to max_length
        model.transformer.ln_f.bias -= 5 * model.transformer.wte.weight[49] / model.transformer.wte.weight[49].norm()
    contexts = torch.randint(0, 49, (2, 5), generator=torch.Generator().manual_seed(0))
    decoder = GPT2Decoder(model, head="va")
    out = generate(decoder, contexts, strategy=strategy, num_beams=2, max_length=12)  # 5 + 11 fed = 16 positions
    assert out.lengths.tolist() == [12, 12]
    with pytest.raises(ValueError, match="max_length"):
        generate(decoder, contexts, strategy=strategy, num_beams=2, max_length=13)
    if strategy == "greedy":  # greedy NMST is over by t½ = 7 at ε = 0.1: any max_length fits
        nmst = generate(GPT2Decoder(model, head="nmst", eps=0.1), contexts, max_length=10**5)
        assert nmst.terminated.all() and int(nmst.lengths.max()) <= 7


def test_decoder_takes_the_head_the_model_recorded(tmp_path):
    model = apply_nmst_to_gpt2(_model(6), head="st", eps=0.01, context_length=3)
    model.save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    decoder = GPT2Decoder(loaded)
    assert (decoder.nmst_head.head, decoder.nmst_head.eps) == ("st", 0.01)
    with pytest.raises(ValueError, match="eps"):
        GPT2Decoder(loaded, eps=1e-5)
    plain = GPT2Decoder(_model(6))  # nothing recorded: the documented defaults
    assert (plain.nmst_head.head, plain.nmst_head.eps) == ("nmst", 1e-5)
