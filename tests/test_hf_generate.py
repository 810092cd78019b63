"""HF ``generate()`` of a model with a head decodes the head's exact step distribution, with no flag.

Greedy and beam search give nmst_fast.generate's tokens; sampling (temperature on the non-eos logits, HF's
top-k / top-p / min-p after it) passes a G-test against the float64 reference at the first and second steps (ST's
running sum included); the logits each step carries are the head's effective logits; HF's own processors
(min_new_tokens' ban, a forced eos) act on them as on any model's; the modes the head cannot follow are refused
before any step runs.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import transformers
from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from nmst_fast.decoding import step_log_probs
from nmst_fast.generation import generate
from nmst_fast.integrations.hf import HFDecoder, apply_nmst

from helpers import g_test, slow
from hf_models import EOS, FAMILIES, V, tiny_model

FAST_FAMILIES = {"llama", "gemma2", "gptj", "cohere"}


def _with_head(family: str = "llama", head: str = "nmst", eps: float = 0.2, seed: int = 0):
    return apply_nmst(tiny_model(family, seed), head=head, eps=eps, eos_token_id=EOS)


def _pair(family: str, head: str, eps: float, *, scale: float = 1.0, eos_bias: float = 0.0):
    """(the model with the head, the same model without one): the output layer scaled by ``scale`` and, where it
    has a bias, ``eos_bias`` added to eos's."""
    plain = tiny_model(family)
    with torch.no_grad():
        layer = plain.get_output_embeddings()
        layer.weight.mul_(scale)
        if eos_bias:
            layer.bias[EOS] += eos_bias
    return apply_nmst(copy.deepcopy(plain), head=head, eps=eps, eos_token_id=EOS), plain


def _continuations(sequences: torch.Tensor, prompt_length: int) -> list[list[int]]:
    out = []
    for row in sequences[:, prompt_length:].tolist():
        out.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return out


def _ours(result) -> list[list[int]]:
    return [result.tokens[b, : result.lengths[b]].tolist() for b in range(result.tokens.shape[0])]


@pytest.mark.parametrize("head", ["nmst", "st", "va"])
@pytest.mark.parametrize("family", [f if f in FAST_FAMILIES else slow(f) for f in sorted(FAMILIES)])
def test_greedy_equals_nmst_fast_generate(family, head):
    model = _with_head(family, head)
    contexts = torch.randint(1, V - 1, (3, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf = model.generate(contexts, attention_mask=torch.ones_like(contexts), do_sample=False, max_new_tokens=12,
                            eos_token_id=EOS, pad_token_id=0)
    ours = generate(HFDecoder(model), contexts, strategy="greedy", max_length=12)
    assert _continuations(hf, 4) == _ours(ours)
    if head == "nmst":
        assert ours.terminated.all()  # t½ = 4 at ε = 0.2


@pytest.mark.parametrize("head", ["nmst", "va"])
@pytest.mark.parametrize("family", ["llama", "gemma2", "gptj", slow("opt"), slow("cohere")])
def test_beam_search_equals_nmst_fast_generate(family, head):
    model = _with_head(family, head, eps=0.1)
    contexts = torch.randint(1, V - 1, (2, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hf = model.generate(contexts, attention_mask=torch.ones_like(contexts), num_beams=3, do_sample=False,
                            max_new_tokens=10, eos_token_id=EOS, pad_token_id=0, length_penalty=0.0)
    ours = generate(HFDecoder(model), contexts, strategy="beam", num_beams=3, max_length=10)
    assert _continuations(hf, 4) == _ours(ours)


def _truncated(log_p: torch.Tensor, options: dict) -> torch.Tensor:
    """(R, V) float64 probabilities: the head's ``log_p`` after HF's own top-k, top-p and min-p warpers."""
    scores = log_p.clone()
    for warper, key in ((TopKLogitsWarper, "top_k"), (TopPLogitsWarper, "top_p"), (MinPLogitsWarper, "min_p")):
        if options.get(key) is not None:
            scores = warper(options[key])(None, scores)
    return torch.softmax(scores, dim=-1)


SAMPLING = [dict(temperature=0.7), dict(temperature=1.6, top_k=6), dict(top_p=0.7), dict(temperature=0.8, min_p=0.05)]


@pytest.mark.parametrize("options", SAMPLING, ids=["T", "T-top_k", "top_p", "T-min_p"])
@pytest.mark.parametrize("head", ["nmst", "st", "va"])
def test_sampling_draws_the_heads_distribution(head, options):
    """6000 draws of two tokens from one prompt (no eos id: eos is drawn like any token, and a row goes on after
    it): the first against the head's step-1 distribution, the second, for each first token drawn at least 200
    times, against its step-2 distribution given that token (ST's running sum through step 1); G-statistics
    summed, p > 1e-5."""
    # Softer logits (many tokens with visible mass), and eos at a logit where p(eos) is ~0.1: ST's p(eos) falls
    # as its eos logit rises, NMST's as it falls.
    eps = 0.05
    model, plain = _pair("gptj", head, eps, scale=0.2, eos_bias=3.0 if head == "st" else -2.5)
    prompt = torch.randint(1, V - 1, (1, 5), generator=torch.Generator().manual_seed(3))
    draws = 6000
    torch.manual_seed(11)
    with torch.no_grad():
        out = model.generate(prompt.expand(draws, -1), attention_mask=torch.ones(draws, 5, dtype=torch.long),
                             do_sample=True, max_new_tokens=2, eos_token_id=None, pad_token_id=0,
                             top_k=options.get("top_k", 0), **{k: v for k, v in options.items() if k != "top_k"})
    first, second = out[:, 5].tolist(), out[:, 6].tolist()
    temperature = options.get("temperature", 1.0)
    with torch.no_grad():
        logits = plain(prompt).logits[:, -1]
    log_p, state = step_log_probs(logits, head=head, eos_index=EOS, eps=eps, steps=1, temperature=temperature)
    g, df = g_test(Counter(first), _truncated(log_p, options)[0])
    for token, count in Counter(first).items():
        if count < 200:
            continue
        with torch.no_grad():
            logits = plain(torch.cat([prompt, torch.tensor([[token]])], dim=1)).logits[:, -1]
        log_p2, _ = step_log_probs(logits, head=head, eos_index=EOS, eps=eps, steps=2, state=state,
                                   temperature=temperature)
        g2, df2 = g_test(Counter(s for f, s in zip(first, second) if f == token), _truncated(log_p2, options)[0])
        g, df = g + g2, df + df2
    from scipy.stats import chi2

    assert df >= 8 and chi2.sf(g, df) > 1e-5, (g, df)


def _eos_banned(log_p: torch.Tensor) -> torch.Tensor:
    banned = log_p.clone()
    banned[:, EOS] = float("-inf")
    return banned


@pytest.mark.parametrize("head", ["nmst", "st", "va"])
@pytest.mark.parametrize("do_sample", [False, True])
def test_each_steps_logits_are_the_heads_effective_logits(head, do_sample):
    """output_logits: the logits each step hands HF's processors; divided by the call's temperature T (1 for greedy)
    their softmax is the head's step distribution at T, step by step along the generated sequence (float64
    reference on the model without a head; ST's running sum along it)."""
    temperature, eps, steps = (0.7 if do_sample else 1.0), 0.05, 8
    model, plain = _with_head("llama", head, eps=eps), tiny_model("llama")
    prompts = torch.randint(1, V - 1, (3, 4), generator=torch.Generator().manual_seed(17))
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(prompts, do_sample=do_sample, temperature=temperature if do_sample else None,
                             top_k=0, max_new_tokens=steps, min_new_tokens=steps, pad_token_id=0, eos_token_id=None,
                             output_logits=True, return_dict_in_generate=True)
        logits = plain(input_ids=out.sequences[:, :-1], use_cache=False).logits[:, 3:]
    t = torch.arange(1, steps + 1).expand(prompts.shape[0], steps)
    from nmst_fast import nmst_log_probs

    expected = nmst_log_probs(logits, eos_index=EOS, eps=eps, head=head, steps=None if head == "va" else t,
                              temperature=temperature)
    got = torch.log_softmax(torch.stack(out.logits, dim=1).double() / temperature, dim=-1)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("head", ["nmst", "st"])
def test_hfs_own_processors_act_on_the_head(head):
    """min_new_tokens bans eos after the head: the step's distribution is the head's conditioned on "not eos"
    (its non-eos part renormalized; ST's running sum goes on with the real eos logit); forced_eos_token_id then
    ends every row at max_new_tokens (eos biased so that no row stops before: down for NMST, up for ST)."""
    eps = 0.01
    model, plain = _pair("gptj", head, eps, eos_bias=-20.0 if head == "nmst" else 20.0)
    contexts = torch.randint(1, V - 1, (2, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = model.generate(contexts, attention_mask=torch.ones_like(contexts), do_sample=False, max_new_tokens=6,
                             min_new_tokens=3, forced_eos_token_id=EOS, eos_token_id=EOS, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    scores = torch.stack(out.scores).double()  # (steps, B, V)
    assert scores.shape[0] == 6 and (out.sequences[:, -1] == EOS).all()  # the forced eos at the last step
    state = None
    for t in range(1, 6):
        with torch.no_grad():
            z = plain(out.sequences[:, : 5 + t - 1]).logits[:, -1]
        want, state = step_log_probs(z, head=head, eos_index=EOS, eps=eps, steps=t, state=state)
        if t <= 3:  # banned: eos at 0, the rest the head's non-eos distribution renormalized
            assert (scores[t - 1, :, EOS] == float("-inf")).all()
            want = torch.log_softmax(_eos_banned(want), dim=-1)
        torch.testing.assert_close(torch.log_softmax(scores[t - 1], dim=-1), want, rtol=0, atol=2e-5)
    assert (scores[5, :, EOS] == 0).all() and (scores[5, :, :EOS] == float("-inf")).all()


def _left_padded(seed: int, lengths=(3, 6, 9)):
    """Prompts of different lengths, left-padded with 0, with their attention mask."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, V - 1, (n,), generator=gen) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt):], mask[b, width - len(prompt):] = prompt, 1
    return prompts, ids, mask


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_left_padded_prompts_decode_as_each_alone(family):
    """HF generate() passes attention_mask and position_ids only to a forward whose signature lists them: the
    head's forward advertises its class's, so a left-padded batch decodes each prompt as it would alone (the
    step distribution of each row at each step: t = 1 at each row's first generated token)."""
    model, plain = _with_head(family, "nmst", eps=0.05), tiny_model(family)
    prompts, ids, mask = _left_padded(3)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4, eos_token_id=EOS,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        for b, prompt in enumerate(prompts):
            sequence = prompt
            for t, scores in enumerate(out.scores, start=1):
                want, _ = step_log_probs(plain(sequence[None]).logits[:, -1], head="nmst", eos_index=EOS, eps=0.05,
                                         steps=t)
                torch.testing.assert_close(torch.log_softmax(scores[b].double(), -1), want[0], rtol=0, atol=2e-5,
                                           msg=f"row {b} t {t}")
                token = out.sequences[b, ids.shape[1] + t - 1]
                if int(token) == EOS:
                    break
                sequence = torch.cat([sequence, token[None]])
        # Outside generate() positional calls bind as the class's own; nmst_logits=False gives the base logits.
        torch.testing.assert_close(model(ids, None, mask, nmst_logits=False).logits, plain(ids, None, mask).logits)


def test_consecutive_calls_each_start_at_t_1():
    """Each generate() call is its own generation: a second call (another batch, other lengths) decodes as the
    first call of a fresh model does."""
    model = _with_head("llama", "st", eps=0.05)
    runs = []
    for shape in ((2, 4), (3, 9), (2, 4)):
        contexts = torch.randint(1, V - 1, shape, generator=torch.Generator().manual_seed(sum(shape)))
        with torch.no_grad():
            runs.append((model.generate(contexts, do_sample=False, max_new_tokens=6, eos_token_id=EOS, pad_token_id=0),
                         _with_head("llama", "st", eps=0.05).generate(contexts, do_sample=False, max_new_tokens=6,
                                                                       eos_token_id=EOS, pad_token_id=0)))
    for got, want in runs:
        assert torch.equal(got, want)


@pytest.mark.parametrize("head, kwargs, mode", [
    ("st", dict(num_beams=2), "beam_search"),
    ("st", dict(num_beams=2, do_sample=True), "beam_sample"),
    ("nmst", dict(prompt_lookup_num_tokens=2), "assisted_generation"),
    ("nmst", dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0), "group_beam_search"),
    ("nmst", dict(penalty_alpha=0.6, top_k=4), "contrastive_search"),
    ("nmst", dict(dola_layers="low"), "dola_generation"),
    ("nmst", dict(prefill_chunk_size=2), "prefill_chunk_size"),
])
def test_modes_the_head_cannot_follow_are_refused_before_any_step(head, kwargs, mode):
    model = _with_head("llama", head, eps=0.05)
    calls = []
    model.get_decoder().register_forward_pre_hook(lambda *args: calls.append(1))
    contexts = torch.randint(1, V - 1, (2, 4), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=mode):
        model.generate(contexts, max_new_tokens=3, eos_token_id=EOS, pad_token_id=0, **kwargs)
    assert not calls


def test_a_copy_a_pickled_and_a_reloaded_model_generate_alike(tmp_path):
    """copy.deepcopy (TRL's reference models), pickling (torch.save of a whole model, processes that receive one)
    and save_pretrained / from_pretrained keep the head and decode the same tokens."""
    import pickle

    model = _with_head("qwen2", "nmst", eps=0.1)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    unpickled = pickle.loads(pickle.dumps(model))
    assert type(unpickled) is type(model) is type(loaded) and type(unpickled.config) is type(loaded.config)
    contexts = torch.randint(1, V - 1, (3, 5), generator=torch.Generator().manual_seed(4))
    outs = [m.generate(contexts, do_sample=False, max_new_tokens=10, eos_token_id=EOS, pad_token_id=0)
            for m in (model, copy.deepcopy(model), unpickled, loaded)]
    assert all(torch.equal(outs[0], out) for out in outs[1:])
