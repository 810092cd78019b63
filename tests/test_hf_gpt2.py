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
from nmst_fast.integrations.hf_gpt2 import NMSTLogitsProcessor, apply_nmst_to_gpt2  # noqa: E402


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
def test_processor_greedy_equals_our_generate(head):
    model = _model(7)
    contexts = torch.randint(0, 49, (4, 6), generator=torch.Generator().manual_seed(7))
    processor = NMSTLogitsProcessor(eos_token_id=49, head=head, eps=0.05)
    with torch.no_grad():
        hf = model.generate(contexts, attention_mask=torch.ones_like(contexts), do_sample=False, max_new_tokens=20,
                            eos_token_id=49, pad_token_id=49, logits_processor=[processor])
    ours = generate(GPT2Decoder(model, head=head, eps=0.05), contexts, strategy="greedy", max_length=20)
    for b in range(4):
        hf_cont = hf[b, 6:].tolist()
        if 49 in hf_cont:
            hf_cont = hf_cont[: hf_cont.index(49) + 1]
        assert ours.tokens[b, : ours.lengths[b]].tolist() == hf_cont, f"row {b}"


def test_processor_outputs_the_step_distribution_and_refuses_beam_scores():
    z = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    ids = torch.zeros(3, 5, dtype=torch.long)
    processor = NMSTLogitsProcessor(eos_token_id=49, head="nmst", eps=0.1)
    first = processor(ids, z)
    from nmst_fast.decoding import step_log_probs

    torch.testing.assert_close(first.double(), step_log_probs(z, head="nmst", eos_index=49, eps=0.1, steps=1)[0])
    second = processor(torch.zeros(3, 6, dtype=torch.long), z)  # one token later: t = 2
    torch.testing.assert_close(second.double(), step_log_probs(z, head="nmst", eos_index=49, eps=0.1, steps=2)[0])
    with pytest.raises(ValueError, match="beam"):
        processor(torch.zeros(3, 7, dtype=torch.long), torch.log_softmax(z, dim=-1))


@pytest.mark.parametrize("head", ["nmst", "st"])
def test_a_reused_processor_starts_each_generate_call_at_t_1(head):
    """A second generate() call through the same processor (a longer, a shorter prompt, another batch
    size) decodes as a fresh processor does; the one ambiguous shape raises until reset()."""
    model = _model(5)
    reused = NMSTLogitsProcessor(eos_token_id=49, head=head, eps=0.05)

    def run(contexts, processor):
        with torch.no_grad():
            out = model.generate(contexts, attention_mask=torch.ones_like(contexts), do_sample=False,
                                 max_new_tokens=6, eos_token_id=49, pad_token_id=49, logits_processor=[processor],
                                 output_scores=True, return_dict_in_generate=True)
        return out.sequences, torch.stack(out.scores)

    for shape in ((2, 4), (2, 9), (3, 3), (2, 5)):
        contexts = torch.randint(0, 49, shape, generator=torch.Generator().manual_seed(sum(shape)))
        got, got_scores = run(contexts, reused)
        want, want_scores = run(contexts, NMSTLogitsProcessor(eos_token_id=49, head=head, eps=0.05))
        assert torch.equal(got, want), shape
        torch.testing.assert_close(got_scores, want_scores)

    # Same batch size, prompts one token longer than the last sequences: continuing or new?
    last = reused._previous
    longer = torch.randint(0, 49, (last.shape[0], last.shape[1] + 1), generator=torch.Generator().manual_seed(9))
    z = torch.randn(last.shape[0], 50, generator=torch.Generator().manual_seed(9))
    with pytest.raises(ValueError, match="reset"):
        reused(longer, z)
    reused.reset()
    from nmst_fast.decoding import step_log_probs

    torch.testing.assert_close(reused(longer, z).double(),
                               step_log_probs(z, head=head, eos_index=49, eps=0.05, steps=1)[0])


@pytest.mark.parametrize("num_beams", [2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_hf_beam_search_on_the_nmst_distribution_agrees_with_ours(num_beams, seed):
    """generation_logits=True: HF's own beam search decodes NMST (no processor) — equal to ours."""
    model = apply_nmst_to_gpt2(_model(seed), head="nmst", eps=0.05, generation_logits=True)
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
    with pytest.raises(ValueError, match="ST"):
        apply_nmst_to_gpt2(_model(seed), head="st", generation_logits=True)


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


def _left_padded(seed: int, lengths=(3, 6, 9)):
    """Prompts of different lengths, left-padded with eos, with their attention mask."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 49, (n,), generator=gen) for n in lengths]
    width = max(lengths)
    ids = torch.full((len(prompts), width), 49)
    mask = torch.zeros_like(ids)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt):], mask[b, width - len(prompt):] = prompt, 1
    return prompts, ids, mask


@pytest.mark.parametrize("generation_logits", [False, True])
def test_patched_model_generates_left_padded_prompts_as_each_alone(generation_logits):
    """HF generate() passes attention_mask and position_ids only to a forward whose signature lists
    them: the patched forward advertises the original's, so a left-padded batch decodes each prompt
    exactly as it would alone (it was off by ~0.5 in log p)."""
    from nmst_fast.decoding import step_log_probs

    model = apply_nmst_to_gpt2(_model(3, scale=4.0, eos_tilt=1.0), head="nmst", eps=0.05,
                               generation_logits=generation_logits)
    plain = _model(3, scale=4.0, eos_tilt=1.0)
    prompts, ids, mask = _left_padded(3)
    processors = [] if generation_logits else [NMSTLogitsProcessor(eos_token_id=49, head="nmst", eps=0.05)]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4, eos_token_id=49,
                             pad_token_id=49, logits_processor=processors, output_scores=True,
                             return_dict_in_generate=True)
        for b, prompt in enumerate(prompts):
            sequence = prompt
            for t, scores in enumerate(out.scores, start=1):
                want, _ = step_log_probs(plain(sequence[None]).logits[:, -1], head="nmst", eos_index=49, eps=0.05,
                                         steps=t)
                torch.testing.assert_close(scores[b].double(), want[0], rtol=0, atol=2e-5, msg=f"row {b} t {t}")
                token = out.sequences[b, ids.shape[1] + t - 1]
                if int(token) == 49:
                    break
                sequence = torch.cat([sequence, token[None]])
    # Positional calls bind as the original forward's do (input_ids, cache, attention_mask, ...).
    with torch.no_grad():
        torch.testing.assert_close(model(ids, None, mask).logits[:, :-1], plain(ids, None, mask).logits[:, :-1])


def test_generation_logits_score_a_plain_forward_as_the_first_step():
    """Without a cache object, model(ids) scores the token after ids (t = 1), as HF's prefill."""
    from nmst_fast.decoding import step_log_probs

    model = apply_nmst_to_gpt2(_model(2), head="nmst", eps=0.05, generation_logits=True)
    ids = torch.randint(0, 49, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for kwargs in ({}, dict(use_cache=False)):
            got = model(ids, **kwargs).logits[:, -1]
            want, _ = step_log_probs(_model(2)(ids).logits[:, -1], head="nmst", eos_index=49, eps=0.05, steps=1)
            torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("head", ["nmst", "va"])
def test_processor_keeps_hf_eos_bans_and_forced_eos(head):
    """HF's own processors run first: min_new_tokens bans eos (score −inf), which the head read as a
    logit (NMST: p(eos) = α_t > 0 at step 1); forced_eos_token_id leaves eos the only finite score
    (it was refused as beam scores). A ban renormalizes the non-eos tokens; a force emits eos."""
    from nmst_fast.decoding import step_log_probs

    model = _model(5, eos_tilt=-3.0)  # decisive, eos unlikely: the rows run until the force ends them
    contexts = torch.randint(0, 49, (2, 5), generator=torch.Generator().manual_seed(5))
    processor = NMSTLogitsProcessor(eos_token_id=49, head=head, eps=0.02)
    with torch.no_grad():
        out = model.generate(contexts, attention_mask=torch.ones_like(contexts), do_sample=False, max_new_tokens=6,
                             min_new_tokens=3, forced_eos_token_id=49, eos_token_id=49, pad_token_id=49,
                             logits_processor=[processor], output_scores=True, return_dict_in_generate=True)
        scores = torch.stack(out.scores).double()  # (steps, B, V)
        assert scores.shape[0] == 6 and (out.sequences[:, -1] == 49).all()  # the forced eos at the last step
        for t in range(1, 4):  # min_new_tokens: eos at 0, the rest the non-eos softmax
            assert (scores[t - 1, :, 49] == float("-inf")).all()
            sequence = out.sequences[:, : 5 + t - 1]
            z = model(sequence).logits[:, -1].double()
            want = torch.log_softmax(z[:, :49], dim=-1)
            torch.testing.assert_close(scores[t - 1, :, :49], want, rtol=0, atol=2e-5)
        for t in (4, 5):  # free steps: the head's own distribution
            z = model(out.sequences[:, : 5 + t - 1]).logits[:, -1]
            want, _ = step_log_probs(z, head=head, eos_index=49, eps=0.02, steps=t)
            torch.testing.assert_close(scores[t - 1], want, rtol=0, atol=2e-5)
        assert scores[5, :, 49].tolist() == [0.0, 0.0] and (scores[5, :, :49] == float("-inf")).all()


def test_processor_refuses_an_eos_ban_for_st():
    """ST's running sum needs the real eos logit at every step: a ban cannot be served."""
    model = _model(5)
    contexts = torch.randint(0, 49, (2, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), pytest.raises(ValueError, match="min_new_tokens"):
        model.generate(contexts, attention_mask=torch.ones_like(contexts), do_sample=False, max_new_tokens=4,
                       min_new_tokens=2, eos_token_id=49, pad_token_id=49,
                       logits_processor=[NMSTLogitsProcessor(eos_token_id=49, head="st", eps=0.3)])


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
