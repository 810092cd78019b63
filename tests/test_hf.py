"""Any HF causal LM: the patched loss equals a float64 reference on the unpatched model's own logits,
decoding agrees with HF's, and the per-row step rules, for tiny random models of many families."""

import pytest
import torch
import transformers  # a test dependency (pyproject.toml extra "test")
from torch import nn

from nmst_fast import nmst_log_probs
from nmst_fast.generation import generate
from nmst_fast.integrations.hf import (
    HFDecoder,
    apply_nmst,
    default_steps,
    steps_from_attention_mask,
    steps_from_labels,
    steps_from_positions,
)
from nmst_fast.settings import HeadSettings

from hf_models import EOS, FAMILIES, GQA, V, chat_batch, reference_loss, tiny_model


def _inner_weight(model) -> nn.Parameter:
    return next(p for name, p in model.base_model.named_parameters() if p.dim() == 2 and "emb" not in name
                and "wte" not in name and "wpe" not in name)


@pytest.mark.parametrize("head", ["nmst", "st", "va"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_patched_loss_equals_the_reference_on_the_models_own_logits(family, head):
    ids, labels = chat_batch(sorted(FAMILIES).index(family))
    plain = tiny_model(family)
    logits = plain(ids).logits  # softcap / scale / bias as the model applies them
    steps = steps_from_labels(labels)
    want = reference_loss(logits, labels, steps, head, eps=0.05)
    want.backward()
    patched = apply_nmst(tiny_model(family), head=head, eps=0.05)
    out = patched(ids, labels=labels)
    assert out.logits is None
    out.loss.backward()
    torch.testing.assert_close(out.loss, want, rtol=1e-10, atol=1e-10)
    for pick in (lambda m: m.get_output_embeddings().weight, _inner_weight):
        torch.testing.assert_close(pick(patched).grad, pick(plain).grad, rtol=1e-8, atol=1e-10)
    if head == "va":  # the model's own loss (HF computes it in fp32: logits.float())
        torch.testing.assert_close(out.loss.float(), plain(ids, labels=labels).loss, rtol=1e-6, atol=1e-6)


def test_the_family_configs_exercise_every_post_processing():
    """Guard for the test above: softcap, both scale conventions and an output bias are all present,
    and each changes the logits away from the plain linear layer's."""
    seen = set()
    for family in FAMILIES:
        model = tiny_model(family)
        ids = torch.arange(1, 9)[None]
        with torch.no_grad():
            raw = model.get_output_embeddings()(model.base_model(ids).last_hidden_state)
            if not torch.allclose(raw, model(ids).logits):
                seen.add(family)
        if model.get_output_embeddings().bias is not None:
            seen.add(family)
    assert {"gemma2", "gemma3_text", "granite", "cohere", "gptj"} <= seen


@pytest.mark.parametrize("family", ["llama", "gemma2", "gptj"])
def test_explicit_steps_and_trainer_scaling(family):
    ids, labels = chat_batch(7)
    model = apply_nmst(tiny_model(family), head="nmst", eps=0.05)
    steps = steps_from_labels(labels)
    assert steps[0, :4].tolist() == [0, 0, 1, 2] and steps[1, 4:7].tolist() == [0, 1, 2]
    assert steps[2, :3].tolist() == [0, 1, 2]  # no prompt: t = 1 at the first predicted token
    default = model(ids, labels=labels).loss
    torch.testing.assert_close(model(ids, labels=labels, nmst_steps=steps).loss, default, rtol=0, atol=0)
    shifted = model(ids, labels=labels, nmst_steps=steps + 3).loss
    want = reference_loss(tiny_model(family)(ids).logits, labels, steps + 3, "nmst", 0.05)
    torch.testing.assert_close(shifted, want, rtol=1e-10, atol=1e-10)
    n = int((labels[:, 1:] != -100).sum())
    torch.testing.assert_close(model(ids, labels=labels, num_items_in_batch=7).loss, default * n / 7)


def test_step_rules():
    labels = torch.tensor([[5, -100, -100, 7, 8, 9, -100, 3],
                           [-100, -100, 1, 2, 3, 4, 5, 6]])
    assert steps_from_labels(labels).tolist() == [[0, 0, 0, 1, 2, 3, 4, 5], [0, 0, 1, 2, 3, 4, 5, 6]]
    # Packed documents: position_ids restart at 0; a document's first token is never supervised.
    packed = torch.tensor([[4, 5, 6, 7, 1, 2, 3, -100]])
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    assert steps_from_labels(packed, position_ids=positions).tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert steps_from_positions(positions, 2).tolist() == [[0, 0, 1, 2, 0, 0, 1, 2]]
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    assert steps_from_attention_mask(mask, 1).tolist() == [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 0, 0]]
    settings = HeadSettings("nmst", 1e-5, None, context_length=1)
    assert default_steps(labels[:1], settings).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    left_padded = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    assert default_steps(labels[:1], settings, attention_mask=left_padded).tolist() == [[0, 0, 0, 1, 2, 3, 4, 5]]
    assert default_steps(packed, settings, position_ids=positions).tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]


@pytest.mark.parametrize("head", ["nmst", "st"])
def test_packed_rows_restart_t_and_sts_running_sum(head):
    """position_ids restarting at 0 mark packed documents: the default steps restart per document,
    and the loss equals the reference with those steps (ST's sum restarting at each t = 1)."""
    model = apply_nmst(tiny_model("llama"), head=head, eps=0.05)
    ids = torch.randint(1, V, (1, 12), generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    labels = ids.clone()
    labels[0, 5] = -100  # the second document's first token is predicted by nothing of its own
    loss = model(ids, labels=labels, position_ids=positions).loss
    steps = steps_from_labels(labels, position_ids=positions)
    assert steps.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]]
    # Without a cache, HF masks attention per document of a packed row (as training runs).
    plain = tiny_model("llama")(ids, position_ids=positions, use_cache=False)
    want = reference_loss(plain.logits, labels, steps, head, 0.05)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-10)


def test_settings_survive_save_pretrained(tmp_path):
    model = apply_nmst(tiny_model("qwen2"), head="st", eps=0.01)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert loaded.config.nmst == dict(head="st", eps=0.01, context_length=None, eos_token_id=EOS)
    decoder = HFDecoder(loaded)
    assert (decoder.nmst_head.head, decoder.nmst_head.eps) == ("st", 0.01)
    with pytest.raises(ValueError, match="eps"):
        apply_nmst(loaded, eps=1e-5)
    apply_nmst(loaded)  # the recorded settings
    ids, labels = chat_batch(1)
    torch.testing.assert_close(loaded(ids, labels=labels).loss, model(ids, labels=labels).loss)


def test_an_eos_list_must_be_resolved_and_every_id_stops_generation():
    model = tiny_model("llama", eos=[EOS, 7])
    with pytest.raises(ValueError, match="eos_token_id="):
        apply_nmst(model)
    with pytest.raises(ValueError, match="eos_token_id="):
        HFDecoder(model)
    decoder = HFDecoder(model, head="va", eos_token_id=EOS)
    assert decoder.stop_token_ids == (EOS, 7)
    contexts = torch.randint(1, V - 1, (6, 3), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():  # 7 takes over the most generated token's place, so some rows stop on it
        before = model.generate(contexts, attention_mask=torch.ones_like(contexts), do_sample=False,
                                max_new_tokens=10, eos_token_id=EOS, pad_token_id=0)[:, 3:]
        common = torch.bincount(before[(before != EOS) & (before != 7)], minlength=V).argmax()
        model.get_output_embeddings().weight[7] = model.get_output_embeddings().weight[common] * 1.2
    for strategy in ("greedy", "beam"):
        ours = generate(decoder, contexts, strategy=strategy, num_beams=2, max_length=10)
        with torch.no_grad():
            hf = model.generate(contexts, attention_mask=torch.ones_like(contexts), do_sample=False,
                                num_beams=1 if strategy == "greedy" else 2, max_new_tokens=10,
                                eos_token_id=[EOS, 7], pad_token_id=0, length_penalty=0.0)
        stopped_on_7 = 0
        for b in range(6):
            cont = hf[b, 3:].tolist()
            end = next((i for i, tok in enumerate(cont) if tok in (EOS, 7)), None)
            cont = cont if end is None else cont[: end + 1]
            assert ours.tokens[b, : ours.lengths[b]].tolist() == cont, f"{strategy} item {b}"
            assert bool(ours.terminated[b]) == (end is not None)
            stopped_on_7 += end is not None and cont[-1] == 7
        assert stopped_on_7 > 0
    assert apply_nmst(model, eos_token_id=EOS).config.nmst["eos_token_id"] == EOS


def test_the_probe_refuses_logits_it_cannot_reproduce():
    # Llama applies no softcap: a config key that says otherwise must not give a silently wrong loss.
    model = tiny_model("llama", final_logit_softcapping=2.0)
    with pytest.raises(ValueError, match="llama"):
        apply_nmst(model)

    class Tempered(transformers.LlamaForCausalLM):  # an unknown post-processing
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits / 1.7
            return out

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**GQA, eos_token_id=EOS)
    with pytest.raises(ValueError, match="Tempered .* own logits"):  # a subclass is a causal LM: probed
        apply_nmst(Tempered(config))


def test_bad_input_is_refused_before_anything_runs():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        apply_nmst(nn.Linear(3, 4))
    base = transformers.AutoModel.from_config(transformers.AutoConfig.for_model("llama", **GQA))
    with pytest.raises(ValueError, match="causal LM"):
        apply_nmst(base)
    headless = tiny_model("llama")
    headless.lm_head = nn.Identity()
    with pytest.raises(ValueError, match="nn.Linear"):
        apply_nmst(headless)
    with pytest.raises(ValueError, match="eos_token_id"):
        apply_nmst(tiny_model("llama", eos=None))
    with pytest.raises(ValueError, match="eos_token_id"):
        apply_nmst(tiny_model("llama"), eos_token_id=V)
    model = apply_nmst(tiny_model("llama"))
    ids, labels = chat_batch()
    with pytest.raises(ValueError, match="nmst_steps"):
        model(ids, labels=labels, nmst_steps=torch.ones(3, 11, dtype=torch.long))
    with pytest.raises(TypeError, match="nmst_steps"):
        model(ids, labels=labels, nmst_steps=torch.ones(3, 12))
    with pytest.raises(ValueError, match="nmst_steps"):  # the logits' t: aligned with the input ids
        model(ids, nmst_steps=torch.ones(3, 11, dtype=torch.long))
    with pytest.raises(ValueError, match="nmst_steps"):
        model(ids, nmst_steps=torch.ones(3, 12, dtype=torch.long), nmst_logits=False)


def test_an_output_layer_that_is_not_plain_linear_is_refused():
    """A learned per-token logit scale inside the output layer (as DoryLMHead's) is 1 at init, so the probe's
    logits agree; the fused loss would still leave it without a gradient: refused by the layer's form."""

    class ScaledHead(nn.Linear):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.logit_scale = nn.Parameter(torch.ones(self.out_features, dtype=self.weight.dtype))

        def forward(self, x):
            return super().forward(x) * self.logit_scale

    model = tiny_model("llama")
    model.lm_head = ScaledHead(32, V, bias=False, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"model_type 'llama'.*forward of its own"):
        apply_nmst(model)

    class Extra(nn.Linear):  # nn.Linear's forward, one more parameter
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.gain = nn.Parameter(torch.ones(()))

    model.lm_head = Extra(32, V, bias=False, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"model_type 'llama'.*beside weight and bias \(gain\)"):
        apply_nmst(model)


def test_a_parameter_outside_the_stack_and_the_output_layer_is_refused():
    class Tempered(transformers.LlamaForCausalLM):  # a learned temperature, 1 at init
        def __init__(self, config):
            super().__init__(config)
            self.temperature = nn.Parameter(torch.ones(()))

        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            if out.logits is not None:
                out.logits = out.logits / self.temperature
                if kwargs.get("labels") is not None:
                    out.loss = self.loss_function(out.logits, kwargs["labels"], vocab_size=self.config.vocab_size)
            return out

    torch.manual_seed(0)
    model = Tempered(transformers.LlamaConfig(**GQA, eos_token_id=EOS)).double()
    with pytest.raises(ValueError, match=r"model_type 'llama'.*\(temperature\).*without a gradient"):
        apply_nmst(model)


def test_the_probe_sees_a_cap_that_small_logits_hide():
    """A float32 model whose output layer gives |logits| ≤ 0.1: a cap of 30 moves them by < 4e-7, inside the
    first probe's tolerance; the second probe, at logits of about ±50, sees it."""

    class Capped(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = 30.0 * torch.tanh(out.logits / 30.0)
            return out

    torch.manual_seed(0)
    model = Capped(transformers.LlamaConfig(**GQA, eos_token_id=EOS)).eval()
    ids = torch.arange(7)[None] * 7919 % V
    with torch.no_grad():
        model.lm_head.weight.mul_(0.1 / float(model(ids).logits.abs().max()))
        weight = model.lm_head.weight.clone()
        small = model(ids).logits
    assert float(small.abs().max()) <= 0.1001
    with pytest.raises(ValueError, match=r"model_type 'llama'.*at max \|logit\| (2|3)\d"):
        apply_nmst(model)
    assert torch.equal(model.lm_head.weight, weight), "the probe restores the output layer's weight"
    # The same model without the cap is patched, and its weight is restored bit for bit.
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**GQA, eos_token_id=EOS)).eval()
    with torch.no_grad():
        plain.lm_head.weight.copy_(weight)
    apply_nmst(plain)
    assert torch.equal(plain.lm_head.weight, weight)


def test_unshifted_labels_take_explicit_steps_aligned_with_them():
    """BART's decoder scores labels[:, i] at position i: nmst_steps aligned with labels give each label's t."""
    from hf_families import probe_batch, tiny_causal_lm

    ids, labels = probe_batch(3)
    steps = torch.randint(0, 9, labels.shape, generator=torch.Generator().manual_seed(5))
    plain, model = tiny_causal_lm("bart"), apply_nmst(tiny_causal_lm("bart"), head="nmst", eps=0.05, eos_token_id=7)
    logits = plain(input_ids=ids, use_cache=False).logits
    log_p = nmst_log_probs(logits.double(), eos_index=7, eps=0.05, head="nmst", steps=steps)
    active = labels != -100
    nll = -log_p.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    want = torch.where(active, nll, 0.0).sum() / active.sum()
    torch.testing.assert_close(model(input_ids=ids, labels=labels, nmst_steps=steps).loss, want,
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("model_type", ["bart", "llama"])
def test_class_labels_score_token_i_plus_1_at_position_i_in_either_convention(model_type):
    from nmst_fast.integrations.hf import class_labels

    from hf_families import probe_batch, tiny_causal_lm

    ids, labels = probe_batch(4)
    with pytest.raises(ValueError, match="apply_nmst"):
        class_labels(tiny_causal_lm(model_type), labels)
    model = apply_nmst(tiny_causal_lm(model_type), head="va", eps=0.05, eos_token_id=7)
    logits = tiny_causal_lm(model_type)(input_ids=ids, use_cache=False).logits[:, :-1].double()
    want = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100)
    torch.testing.assert_close(model(input_ids=ids, labels=class_labels(model, labels)).loss, want,
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model_type", ["bart", "llama"])
def test_half_precision_models_keep_their_label_convention(model_type, dtype):
    """The convention is read from the class's own loss, computed in half precision by some classes (BART):
    its tolerance follows the loss's dtype, so neither convention is mistaken for the other."""
    from hf_families import probe_batch, tiny_causal_lm

    ids, labels = probe_batch(6)
    plain = tiny_causal_lm(model_type, dtype=dtype)
    model = apply_nmst(tiny_causal_lm(model_type, dtype=dtype), head="va", eps=0.05, eos_token_id=7)
    own = plain(input_ids=ids, labels=labels, use_cache=False).loss
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss.float(), own.float(), rtol=2e-2, atol=2e-2)


def test_the_probe_reads_a_small_copy_not_the_models_weights(monkeypatch):
    """apply_nmst probes a small random copy of the model (its class and config, 64 wide, 2 layers): the model's
    own weights are never run or scaled, and the caller's random stream is where it was."""
    import transformers

    from nmst_fast.integrations.hf import probe as probe_module

    config = transformers.Qwen3Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(config)
    probed = []
    original = probe_module.probe
    monkeypatch.setattr(probe_module, "probe", lambda m, *a: probed.append(m) or original(m, *a))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    apply_nmst(model, head="nmst", eps=0.01)
    assert torch.equal(torch.rand(3), expected)
    (small,) = probed
    assert small is not model and small.config.hidden_size == 64 and small.config.num_hidden_layers == 2
    assert small.config.vocab_size == 1000 and type(small).__name__ == "Qwen3ForCausalLM"
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
