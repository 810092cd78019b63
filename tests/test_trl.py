"""TRL's own trainers, unchanged, on a patched model: every token they score is the head's (against a float64
reference on the unpatched model's own logits), and what cannot be exact is refused before the first step."""

from __future__ import annotations

import copy
import math
import subprocess
import sys

import pytest
import torch
from datasets import Dataset

import nmst_fast
from nmst_fast.integrations import trl as nmst_trl
from nmst_fast.integrations.hf import apply_nmst

from helpers import slow
from hf_models import EOS, chat_batch, tiny_model, word_tokenizer
from trl_setup import (
    preferences,
    prompt_completion,
    record_fused_calls,
    reference_token_log_probs,
)

trl = pytest.importorskip("trl")
from trl.trainer import utils as trl_utils  # noqa: E402

EPS = 0.05
ALL_OUTPUTS = ("log_probs", "entropy", "is_top1", "mean_logits", "log_sum_sq_probs")


def _patched(head, family="llama", dtype=torch.float64, seed=0, eps=EPS):
    plain = tiny_model(family, seed=seed, dtype=dtype)
    return plain, apply_nmst(copy.deepcopy(plain), head=head, eps=eps)


def _reference_statistics(log_p, targets):
    """Entropy, log Σ p², mean effective logit and top-1 of each row of the head's (B, T, V) log-distribution."""
    p = log_p.exp()
    entropy = -(p * torch.where(torch.isneginf(log_p), 0.0, log_p)).sum(-1)
    # softmax(ζ) = p with ζ = log p + logsumexp(ζ); for NMST/ST logsumexp(ζ) = L − log(1 − α) per row.
    return entropy, torch.logsumexp(2 * log_p, -1), log_p.argmax(-1) == targets


def _close(actual, expected, tol=1e-9):
    assert actual.shape == expected.shape
    error = float((actual.double() - expected.double()).abs().max()) if actual.numel() else 0.0
    assert error <= tol * max(1.0, float(expected.double().abs().max())), error


# --- the fused-head contract ---------------------------------------------------------------------

@pytest.mark.parametrize("head", ["nmst", "st"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("layout", ["labels", "shift_labels", "packed"])
def test_fused_head_outputs_are_the_heads(head, temperature, layout):
    plain, model = _patched(head)
    trl_utils.add_fused_lm_head(model, temperature=temperature, outputs=ALL_OUTPUTS)
    ids, labels = chat_batch(seed=3)
    call = dict(input_ids=ids, labels=labels)
    if layout == "shift_labels":
        call = dict(input_ids=ids, shift_labels=torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1))
    elif layout == "packed":  # two documents in row 0, three in row 2: t and ST's sum restart at each
        positions = torch.arange(ids.shape[1]).repeat(ids.shape[0], 1)
        positions[0, 6:] -= 6
        positions[2, 4:] -= 4
        positions[2, 9:] -= 5
        call["position_ids"] = positions
    out = model(**call, fused_lm_head=True)
    expected, log_p, targets, logits = reference_token_log_probs(plain, call, head=head, eps=EPS,
                                                                 temperature=temperature)
    mask = targets != -100
    _close(out.log_probs, expected)
    entropy, log_sum_sq, top1 = _reference_statistics(log_p, targets)
    _close(out.entropy, torch.where(mask, entropy, 0.0))
    _close(out.log_sum_sq_probs, torch.where(mask, log_sum_sq, 0.0))
    assert torch.equal(out.is_top1, top1 & mask)
    assert torch.equal(out.label_mask, mask)
    # The effective logits ζ (softmax(ζ) = p, ζ_v = z_v / T off eos) are log p + (z_0 / T − log p_0).
    zeta = log_p + (logits[..., :1] / temperature - log_p[..., :1])
    _close(out.mean_logits, torch.where(mask, zeta.mean(-1), 0.0))
    _close(out.loss, -expected.sum() / mask.sum())


@pytest.mark.parametrize("head", ["nmst", "st", "va"])
def test_log_probs_gradients_equal_the_patched_losss(head):
    """At T = 1 the fused-head loss is the patched forward's loss, gradients included."""
    _, model = _patched(head)
    twin = copy.deepcopy(model)
    trl_utils.add_fused_lm_head(model, outputs=("log_probs",))
    ids, labels = chat_batch(seed=5)
    model(input_ids=ids, labels=labels, fused_lm_head=True, num_items_in_batch=7).loss.backward()
    twin(input_ids=ids, labels=labels, num_items_in_batch=7).loss.backward()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        if b.grad is not None:
            _close(a.grad, b.grad, 1e-10)


@pytest.mark.parametrize("head", ["nmst", "st"])
def test_entropy_gradient_is_the_heads(head):
    """GRPO's entropy bonus differentiates the entropy: its gradient is the float64 reference's."""
    plain, model = _patched(head)
    trl_utils.add_fused_lm_head(model, temperature=0.8, outputs=("log_probs", "entropy"))
    ids, labels = chat_batch(seed=7)
    model(input_ids=ids, labels=labels, fused_lm_head=True).entropy.sum().backward()
    reference = copy.deepcopy(plain)
    logits = reference(input_ids=ids).logits[:, :-1]
    _, _, targets, _ = reference_token_log_probs(plain, dict(input_ids=ids, labels=labels), head=head, eps=EPS,
                                                 temperature=0.8)
    from trl_setup import reference_steps

    steps = reference_steps(targets, torch.zeros_like(targets, dtype=torch.bool))
    log_p = nmst_fast.nmst_log_probs(logits, eos_index=EOS, eps=EPS, head=head, steps=steps, temperature=0.8)
    entropy = -(log_p.exp() * torch.where(torch.isneginf(log_p), 0.0, log_p)).sum(-1)
    torch.where(targets != -100, entropy, 0.0).sum().backward()
    for a, b in zip(model.parameters(), reference.parameters()):
        if b.grad is not None:
            _close(a.grad, b.grad, 1e-9)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_va_is_trls_own_fused_head(temperature):
    """Head "va" gives what TRL's own fused head gives the unpatched model: same contract, same conventions."""
    plain, model = _patched("va", dtype=torch.float32)
    trl_utils.add_fused_lm_head(model, temperature=temperature, outputs=ALL_OUTPUTS)
    trl_utils.add_fused_lm_head.__wrapped__(plain, temperature=temperature, outputs=ALL_OUTPUTS)
    ids, labels = chat_batch(seed=11)
    for call in (dict(labels=labels, num_items_in_batch=5),
                 dict(shift_labels=torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1))):
        ours = model(input_ids=ids, fused_lm_head=True, **call)
        theirs = plain(input_ids=ids, fused_lm_head=True, **call)
        for name in ("loss",) + ALL_OUTPUTS + ("label_mask",):
            a, b = getattr(ours, name), getattr(theirs, name)
            if b.dtype == torch.bool:
                assert torch.equal(a, b), name
            else:
                _close(a, b, 2e-6)


def test_models_without_a_head_get_trls_own():
    plain = tiny_model("llama", dtype=torch.float32)
    trl_utils.add_fused_lm_head(plain)
    assert plain.forward.__func__.__code__.co_filename == trl_utils.__file__


def test_a_reference_model_loaded_from_a_saved_run_is_patched(tmp_path):
    _, model = _patched("nmst")
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    trl_utils.add_fused_lm_head(loaded)
    ids, labels = chat_batch()
    out = loaded(input_ids=ids, labels=labels, fused_lm_head=True)
    assert torch.allclose(out.loss, model(input_ids=ids, labels=labels).loss, rtol=1e-10)


def test_an_unsupported_trl_is_refused(monkeypatch):
    _, model = _patched("nmst")
    monkeypatch.setattr(trl, "__version__", "1.15.2")
    with pytest.raises(ValueError, match="NMST head: TRL 1.15.2 is not supported"):
        trl_utils.add_fused_lm_head(model)


def test_bad_arguments_are_refused():
    _, model = _patched("nmst")
    with pytest.raises(ValueError, match="temperature"):
        trl_utils.add_fused_lm_head(model, temperature=0.0)
    with pytest.raises(ValueError, match="outputs"):
        trl_utils.add_fused_lm_head(model, outputs=("log_probs", "logits"))
    trl_utils.add_fused_lm_head(model)
    ids, labels = chat_batch()
    with pytest.raises(ValueError, match="exactly one of labels= and shift_labels="):
        model(input_ids=ids, fused_lm_head=True)


def test_a_deep_copy_runs_its_own_weights():
    """TRL's reference models are deep copies: the copy's forward (plain and fused) reads the copy."""
    _, model = _patched("nmst")
    trl_utils.add_fused_lm_head(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.get_output_embeddings().weight.mul_(0.5)
    ids, labels = chat_batch()
    assert not torch.allclose(twin(input_ids=ids).logits, model(input_ids=ids).logits)
    assert not torch.allclose(twin(input_ids=ids, labels=labels, fused_lm_head=True).loss,
                              model(input_ids=ids, labels=labels, fused_lm_head=True).loss)


@pytest.mark.slow
def test_the_hook_waits_for_trl_to_be_imported():
    """apply_nmst before TRL is imported: the trainer modules imported later bind the head's function."""
    script = ("import sys, torch; sys.path.insert(0, 'tests'); from hf_models import tiny_model; "
              "from nmst_fast.integrations.hf import apply_nmst; assert 'trl' not in sys.modules; "
              "apply_nmst(tiny_model('llama'), head='nmst', eps=0.05); "
              "import trl.trainer.sft_trainer as s, trl.trainer.grpo_trainer as g; "
              "assert s.add_fused_lm_head._nmst_wraps and g.add_fused_lm_head._nmst_wraps; print('ok')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


# --- the trainers themselves ---------------------------------------------------------------------

def _config(cls, tmp_path, **extra):
    return cls(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, report_to="none",
               logging_steps=1, save_strategy="no", use_cpu=True, dataloader_num_workers=0, seed=0, bf16=False,
               **extra)  # fp32 (TRL turns bf16 autocast on where the CPU has it): exact to fp32 rounding


def _check_calls(calls, plain, head, temperature=1.0, tol=2e-5):
    assert calls, "the trainer made no fused-head call"
    for call, out in calls:
        expected = reference_token_log_probs(plain, call, head=head, eps=EPS, temperature=temperature)[0]
        _close(out.log_probs, expected, tol)


def _sft(tmp_path, head, **extra):
    from trl import SFTConfig, SFTTrainer

    plain, model = _patched(head, dtype=torch.float32)
    trainer = SFTTrainer(model=model, args=_config(SFTConfig, tmp_path, **extra),
                         train_dataset=Dataset.from_dict(prompt_completion()), processing_class=word_tokenizer())
    return plain, model, trainer


@pytest.mark.parametrize("head", ["nmst", slow("st"), slow("va")])
def test_sft_trains_on_the_head(tmp_path, head):
    plain, model, trainer = _sft(tmp_path, head)
    calls = record_fused_calls(model)
    trainer.train()
    _check_calls(calls, plain, head)
    call, out = calls[0]
    expected, _, targets, _ = reference_token_log_probs(plain, call, head=head, eps=EPS, temperature=1.0)
    assert math.isclose(trainer.state.log_history[0]["loss"], float(-expected.sum() / (targets != -100).sum()),
                        rel_tol=1e-5)


@pytest.mark.slow
def test_sft_packed_documents_each_start_their_own_t(tmp_path):
    from trl import SFTConfig, SFTTrainer

    plain, model = _patched("st", dtype=torch.float32)
    data = prompt_completion(seed=2)
    texts = Dataset.from_dict({"text": [p + c for p, c in zip(data["prompt"], data["completion"])]})
    trainer = SFTTrainer(model=model, args=_config(SFTConfig, tmp_path, packing=True, max_length=24),
                         train_dataset=texts, processing_class=word_tokenizer())
    calls = record_fused_calls(model)
    trainer.train()
    assert any(c.get("position_ids") is not None and int((c["position_ids"] == 0).sum()) > 1 for c, _ in calls)
    _check_calls(calls, plain, "st")


@pytest.mark.slow
def test_sft_with_lora(tmp_path):
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    plain, model = _patched("nmst", dtype=torch.float32)
    trainer = SFTTrainer(model=model, args=_config(SFTConfig, tmp_path),
                         train_dataset=Dataset.from_dict(prompt_completion()), processing_class=word_tokenizer(),
                         peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    calls = record_fused_calls(trainer.model.get_base_model())
    trainer.train()
    # B is zero at init: the first step scores the base model's head exactly.
    _check_calls(calls, plain, "nmst")


@pytest.mark.slow
@pytest.mark.parametrize("head", ["nmst", "st"])
def test_dpo_scores_chosen_and_rejected_with_the_head(tmp_path, head):
    """The policy patched in place, the reference model loaded from the saved policy's directory (it opens with
    the head): both score with the head."""
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    plain, model = _patched(head, dtype=torch.float32)
    model.save_pretrained(tmp_path / "saved")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    assert type(reference).__name__ == "NMSTLlamaForCausalLM"
    trainer = DPOTrainer(model=model, ref_model=reference, args=_config(DPOConfig, tmp_path),
                         train_dataset=Dataset.from_dict(preferences()), processing_class=word_tokenizer())
    policy_calls, reference_calls = record_fused_calls(model), record_fused_calls(reference)
    trainer.train()
    _check_calls(policy_calls, plain, head)
    _check_calls(reference_calls, plain, head)


@pytest.mark.slow
def test_dpo_with_lora_scores_its_reference_with_the_adapters_disabled(tmp_path):
    """Without a ref_model, DPO under PEFT scores the reference as the base model with its adapters disabled:
    those calls, and the policy's, are the head's (LoRA's B is zero at init: both are the base model)."""
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer

    plain, model = _patched("nmst", dtype=torch.float32)
    trainer = DPOTrainer(model=model, args=_config(DPOConfig, tmp_path), train_dataset=Dataset.from_dict(preferences()),
                         processing_class=word_tokenizer(),
                         peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    calls = record_fused_calls(trainer.model.get_base_model())
    trainer.train()
    assert len(calls) >= 2  # the policy's and the adapter-disabled reference's
    _check_calls(calls, plain, "nmst")


@pytest.mark.slow
def test_kto_scores_with_the_head(tmp_path):
    from trl import KTOConfig, KTOTrainer

    plain, model = _patched("nmst", dtype=torch.float32)
    reference = copy.deepcopy(model)
    data = preferences(n=4)
    rows = {"prompt": data["prompt"] * 2, "completion": data["chosen"] + data["rejected"],
            "label": [True] * 4 + [False] * 4}
    trainer = KTOTrainer(model=model, ref_model=reference, args=_config(KTOConfig, tmp_path),
                         train_dataset=Dataset.from_dict(rows), processing_class=word_tokenizer())
    policy_calls, reference_calls = record_fused_calls(model), record_fused_calls(reference)
    trainer.train()
    _check_calls(policy_calls, plain, "nmst")
    _check_calls(reference_calls, plain, "nmst")


def _length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


@pytest.mark.slow
@pytest.mark.parametrize("trainer_name", ["grpo", "rloo"])
def test_online_trainers_sample_and_score_the_head(tmp_path, trainer_name):
    """GRPO / RLOO given the saved policy's path (TRL loads it) with HF generate: completions sampled at T from the
    head end with eos by t½ (ε = 0.5: t½ = 1, and a completion of 8 tokens misses eos with probability ≤ 2^-36;
    under the plain softmax most would run to max_completion_length), and the scored log-probs are the head's at
    the same T."""

    if trainer_name == "grpo":
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as Trainer
    else:
        from trl import RLOOConfig as Config
        from trl import RLOOTrainer as Trainer
    eps, temperature = 0.5, 0.7
    plain = tiny_model("llama", dtype=torch.float32)
    apply_nmst(copy.deepcopy(plain), head="nmst", eps=eps).save_pretrained(tmp_path / "policy")
    seen = []

    def reward(completions, completion_ids, **kwargs):
        seen.extend(completion_ids)
        return _length_reward(completions)

    prompts = Dataset.from_dict({"prompt": prompt_completion(n=4)["prompt"]})
    args = _config(Config, tmp_path / "out", max_completion_length=8, num_generations=2, temperature=temperature,
                   beta=0.1, model_init_kwargs=dict(dtype=torch.float32))
    trainer = Trainer(model=str(tmp_path / "policy"), reward_funcs=reward, args=args, train_dataset=prompts,
                      processing_class=word_tokenizer())
    assert type(trainer.model).__name__ == "NMSTLlamaForCausalLM"
    calls = record_fused_calls(trainer.model) + record_fused_calls(trainer.ref_model)
    trainer.train()
    assert seen and all(ids and ids[-1] == EOS for ids in seen), seen
    assert nmst_trl.SUPPORTED_TRL and trainer.ref_model is not None
    for call, out in calls:
        expected = reference_token_log_probs(plain, call, head="nmst", eps=eps, temperature=temperature)[0]
        _close(out.log_probs, expected, 2e-5)


@pytest.mark.slow
def test_hf_sampling_at_the_trainers_temperature_draws_the_head():
    """GRPO / RLOO sample with HF generate at their T: the first token's law (G-test, 20,000 draws) is the
    head's at T with the sampling semantics (non-eos logits / T, p(eos) unchanged), as their scoring reads it."""
    from helpers import g_test_p

    eps, temperature, draws = 0.3, 0.6, 20_000
    plain, model = _patched("nmst", dtype=torch.float32, eps=eps)
    trl_utils.add_fused_lm_head(model, temperature=temperature)
    prompt = chat_batch(seed=13)[0][:1, :5]
    torch.manual_seed(1)
    with torch.no_grad():
        drawn = model.generate(prompt.repeat(draws, 1), do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                               max_new_tokens=1, min_new_tokens=0, pad_token_id=0, eos_token_id=EOS)[:, -1]
        logits = plain.double()(input_ids=prompt).logits[:, -1:]
    expected = nmst_fast.nmst_log_probs(logits, eos_index=EOS, eps=eps, steps=torch.ones(1, 1, dtype=torch.long),
                                        temperature=temperature)[0, 0].exp()
    assert float(expected[EOS]) > 0.3  # eos is a large part of the law: a temperature applied to it would show
    assert g_test_p(drawn, expected) > 1e-5


def test_a_forward_that_replaces_the_patched_one_is_refused_before_it_trains():
    """Liger's fused linear cross-entropy (or any trainer's own fused head) sets model.forward to a function
    that runs the decoder stack and reads the output layer's weight itself: its first training call raises."""
    _, model = _patched("nmst")

    def own_fused_forward(self, input_ids, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids).last_hidden_state
        logits = hidden @ self.lm_head.weight.T
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                 ignore_index=-100)

    ids, labels = chat_batch()
    model.forward = own_fused_forward.__get__(model)
    model.train()
    with pytest.raises(ValueError, match="NMST head: .* training outside the patched forward"):
        model(ids, labels=labels)
    model.eval()  # evaluation and generation that read the stack directly (HFDecoder) pass
    model(ids, labels=labels)


def test_ligers_fused_linear_cross_entropy_is_refused_before_it_trains():
    """Liger's instance patching (what HF Trainer's and TRL's use_liger_kernel run) finds no kernels for a model
    with a head (its type is "nmst"), which keeps training the head's loss; Liger's Llama forward put on it by
    hand is refused before it trains."""
    import types

    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.model.llama import lce_forward

    _, model = _patched("nmst", dtype=torch.float32)
    ids, labels = chat_batch()
    before = model(input_ids=ids, labels=labels).loss
    _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=True, rms_norm=False, swiglu=False,
                                    rope=False)
    assert "forward" not in model.__dict__
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, before)
    model.forward = types.MethodType(lce_forward, model)
    model.train()
    with pytest.raises(ValueError, match="NMST head: .*Liger's fused linear cross-entropy"):
        model(input_ids=ids, labels=labels)


@pytest.mark.parametrize("head", ["nmst", "st"])
def test_hf_sampling_at_the_trainers_temperature_draws_the_heads_steps(head):
    """HF generate on the policy after TRL's hook, sampling at the trainer's temperature T as GRPO / RLOO do,
    draws the head step by step (ST's running state included): every step's logits divided by T give the head's
    log p_T at that step (float64 reference on the unpatched model)."""
    temperature, eps, steps = 0.7, 0.02, 10
    plain, model = _patched(head, dtype=torch.float64, eps=eps)
    trl_utils.add_fused_lm_head(model, temperature=temperature)
    prompts = chat_batch(seed=17)[0][:, :4]
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(prompts, do_sample=True, temperature=temperature, top_k=0, max_new_tokens=steps,
                             min_new_tokens=steps, pad_token_id=0, eos_token_id=None, output_logits=True,
                             return_dict_in_generate=True)
        logits = plain(input_ids=out.sequences[:, :-1], use_cache=False).logits[:, 3:]
    t = torch.arange(1, steps + 1).expand(prompts.shape[0], steps)
    expected = nmst_fast.nmst_log_probs(logits, eos_index=EOS, eps=eps, head=head, steps=t, temperature=temperature)
    got = torch.log_softmax(torch.stack(out.logits, dim=1).double() / temperature, dim=-1)
    _close(got, expected, 2e-6)
