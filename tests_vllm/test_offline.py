"""The processor in vLLM's offline engine: token-exact greedy, the termination bound, the sampled
distribution (G-test), mixed batches, the other controls and the refusals."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import EPS
from head_reference import HeadEosColumn
from scipy.stats import chi2

import nmst_fast
from nmst_fast.decoding import step_log_probs
from nmst_fast.integrations.hf import HFDecoder, apply_nmst

from helpers import g_test
from hf_models import SERVED_EOS as EOS
from hf_models import SERVED_ST_EOS as ST_EOS
from hf_models import SERVED_V as VOCAB

T_HALF = nmst_fast.termination_bound(EPS)
ST = {"nmst_head": "st", "nmst_eps": 1e-3, "nmst_eos_token_id": ST_EOS}


def _tokens(prompts) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def _reference_greedy(model, prompts, max_length: int, **head) -> list[list[int]]:
    decoder = HFDecoder(model, **head)
    out = []
    for p in prompts:  # prompts of different lengths: one call each
        result = nmst_fast.generate(decoder, torch.tensor([p]), strategy="greedy", max_length=max_length)
        out.append(result.tokens[0, :result.lengths[0]].tolist())
    return out


def test_termination_bound_value():
    assert T_HALF == 14


def test_greedy_nmst_token_exact_and_bounded(llm, reference, prompts):
    from vllm import SamplingParams

    expected = _reference_greedy(reference, prompts, 40, head="nmst", eps=EPS, eos_token_id=EOS)
    outs = llm.generate(_tokens(prompts), SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == expected
    lengths = [len(g) for g in got]
    assert len(set(lengths)) >= 4, lengths  # eos matters: requests finish at different steps
    assert all(g[-1] == EOS and len(g) <= T_HALF for g in got), lengths
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_greedy_st_token_exact_with_chunked_prefill(llm, reference, prompts):
    """ST per request (its own eos), rows finishing at different steps (moves and swaps), and two
    200-token prompts whose prefill runs in chunks (max_num_batched_tokens=128): partial-prefill rows
    pass through the processor and must not enter ST's running sum."""
    from vllm import SamplingParams

    g = torch.Generator().manual_seed(2)
    long = [torch.randint(0, 256, (200,), generator=g).tolist() for _ in range(2)]
    batch = prompts[:8] + long + prompts[8:]
    expected = _reference_greedy(reference, batch, 60, head="st", eps=1e-3, eos_token_id=ST_EOS)
    params = SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[ST_EOS], extra_args=ST)
    outs = llm.generate(_tokens(batch), params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == expected
    assert len({len(x) for x in got}) >= 4


def test_sampled_requests_terminate(llm, prompts):
    """ε = 0.05: no sampled request reaches 500 tokens, under top-k, top-p and plain sampling at
    temperatures 0.7 and 1.5; greedy ones end with eos by t½."""
    from vllm import SamplingParams

    settings = [dict(top_k=20), dict(top_p=0.9), dict()]
    requests, params = [], []
    for temperature in (0.7, 1.5):
        for extra in settings:
            for i, p in enumerate(prompts):
                requests.append(p)
                params.append(SamplingParams(temperature=temperature, max_tokens=500, **extra))
    outs = llm.generate(_tokens(requests), params, use_tqdm=False)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), max(lengths)
    assert all(o.outputs[0].token_ids[-1] == EOS for o in outs)
    assert max(lengths) < 100, max(lengths)  # P(length > t) ≤ 2^-(t - t½): 100 is never reached


def _vllm_truncation(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution vLLM samples after its top-k (every token at least the k-th largest) and
    top-p (ascending order, dropping the tail whose cumulative mass is at most 1 − p), float64 (V,)."""
    kth = probs.topk(top_k).values[-1]
    probs = torch.where(probs >= kth, probs, 0.0)
    probs = probs / probs.sum()
    order = probs.argsort(stable=True)
    cumulative = probs[order].cumsum(0)
    drop = cumulative <= 1 - top_p
    drop[-1] = False
    probs = probs.clone()
    probs[order[drop]] = 0.0
    return probs / probs.sum()


def _exact(model, contexts: torch.Tensor, t: int, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """(N, V) float64: the processor's target at step t for each context row (the head's distribution
    from the HF model's logits, temperature on the non-eos logits, then vLLM's top-k and top-p)."""
    with torch.no_grad():
        logits = model(input_ids=contexts).logits[:, -1].double()
    log_p, _ = step_log_probs(logits, head="nmst", eos_index=EOS, eps=EPS, steps=t, temperature=temperature)
    return torch.stack([_vllm_truncation(row.exp(), top_k, top_p) for row in log_p])


def test_sampled_distributiong_test(llm, reference):
    """20,000 draws (the engine's seed 0) at temperature 0.7, top-k 20, top-p 0.9: the 1st generated token against
    the exact distribution, and the 5th against its exact distribution given each draw's first four
    tokens (the G statistics of the prefixes drawn at least 100 times, summed: independent
    multinomials given the prefix counts)."""
    from vllm import SamplingParams

    prompt = [73, 8, 228, 231, 190, 155, 112]  # eos gets 6% at t = 1
    draws = 20_000
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=5)
    outs = llm.generate(_tokens([prompt] * draws), params, use_tqdm=False)
    samples = [list(o.outputs[0].token_ids) for o in outs]

    first = Counter(s[0] for s in samples)
    exact_first = _exact(reference, torch.tensor([prompt]), 1, 0.7, 20, 0.9)[0]
    assert exact_first[EOS] > 0.01  # eos is in play
    g, df = g_test(first, exact_first)
    assert chi2.sf(g, df) > 1e-4, (g, df)

    by_prefix: dict[tuple, Counter] = {}
    for s in samples:
        if len(s) == 5:
            by_prefix.setdefault(tuple(s[:4]), Counter())[s[4]] += 1
    frequent = [prefix for prefix, c in by_prefix.items() if sum(c.values()) >= 100]
    assert sum(sum(by_prefix[p].values()) for p in frequent) >= 2_000
    exact = _exact(reference, torch.tensor([prompt + list(p) for p in frequent]), 5, 0.7, 20, 0.9)
    total_g, total_df = 0.0, 0
    for prefix, probs in zip(frequent, exact):
        g, df = g_test(by_prefix[prefix], probs)
        total_g, total_df = total_g + g, total_df + df
    assert total_df >= 5
    assert chi2.sf(total_g, total_df) > 1e-4, (total_g, total_df)


def test_mixed_batch_plain_rows_untouched(llm, reference, prompts):
    """Plain requests (nmst_head "va") share the batch with sampled NMST and greedy ST requests: they
    equal the model's own greedy continuation (what vLLM decodes without the processor), and the ST
    rows equal their reference."""
    from vllm import SamplingParams

    va = {"nmst_head": "va"}
    plain_greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=False, extra_args=va)
    nmst = SamplingParams(temperature=0.8, max_tokens=30)
    st = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[ST_EOS], extra_args=ST)
    mixed_prompts = prompts[:4] + prompts[4:8] + prompts[8:12] + prompts[12:16]
    mixed_params = [plain_greedy] * 4 + [nmst] * 8 + [st] * 4
    mixed = llm.generate(_tokens(mixed_prompts), mixed_params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "stop" for o in mixed[4:12])
    expected = _reference_greedy(reference, prompts[:4], 20, head="va", eos_token_id=EOS)
    assert [list(o.outputs[0].token_ids) for o in mixed[:4]] == expected
    expected_st = _reference_greedy(reference, prompts[12:16], 30, head="st", eps=1e-3, eos_token_id=ST_EOS)
    assert [list(o.outputs[0].token_ids) for o in mixed[12:16]] == expected_st


def test_min_tokens_and_ignore_eos(llm, reference, prompts):
    """min_tokens bans eos for its first steps: eos stays at 0 and the rest is the head's non-eos
    distribution (HF generation of the model with the head follows the same rule); ignore_eos decodes the head
    to max_tokens."""
    import copy

    from transformers import GenerationConfig
    from vllm import SamplingParams

    outs = llm.generate(_tokens(prompts[:6]), SamplingParams(temperature=0.0, max_tokens=40, min_tokens=5),
                        use_tqdm=False)
    with_head = apply_nmst(copy.deepcopy(reference), head="nmst", eps=EPS, eos_token_id=EOS)
    for p, o in zip(prompts[:6], outs):
        config = GenerationConfig(do_sample=False, max_new_tokens=40, min_new_tokens=5, eos_token_id=EOS,
                                  pad_token_id=EOS)
        hf = with_head.generate(torch.tensor([p]), generation_config=config)
        assert list(o.outputs[0].token_ids) == hf[0, len(p):].tolist()
        assert len(o.outputs[0].token_ids) >= 5
    outs = llm.generate(_tokens(prompts[:2]), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 30 and o.outputs[0].finish_reason == "length" for o in outs)
    # After t½ greedy NMST picks eos at every step: the head runs on past eos.
    assert all(o.outputs[0].token_ids[T_HALF - 1:] == [EOS] * (30 - T_HALF + 1) for o in outs)


@pytest.mark.parametrize("extra, others, message", [
    ({"nmst_head": "beam"}, {}, "nmst_head"),
    ({"nmst_eps": 0.0}, {}, "nmst_eps"),
    ({"nmst_eps": 1.5}, {}, "nmst_eps"),
    ({"nmst_eps": "small"}, {}, "nmst_eps"),
    ({"nmst_eos_token_id": VOCAB}, {}, "nmst_eos_token_id"),
    ({"nmst_eos_token_id": -1}, {}, "nmst_eos_token_id"),
    ({"nmst_epsilon": 0.1}, {}, "unknown"),
    ({"nmst_head": "st"}, {"min_tokens": 3}, "min_tokens"),
    ({"nmst_head": "st"}, {"allowed_token_ids": [1, 2, EOS]}, "allowed_token_ids"),
    # Log-probs vLLM would take from the model's logits (this engine runs the default raw_logprobs).
    ({}, {"logprobs": 2}, "logprobs would be the model's plain softmax.*--logprobs-mode processed_logprobs"),
    (ST, {"logprobs": 0}, "head 'st': logprobs would be the model's plain softmax"),
    ({}, {"prompt_logprobs": 1}, "prompt_logprobs would be the model's plain softmax"),
])
def test_bad_settings_are_refused(llm, prompts, extra, others, message):
    from vllm import SamplingParams

    with pytest.raises(Exception, match=message) as info:
        llm.generate(_tokens(prompts[:1]), SamplingParams(max_tokens=4, extra_args=extra, **others), use_tqdm=False)
    assert isinstance(info.value.__cause__, ValueError) or isinstance(info.value, ValueError)
    out = llm.generate(_tokens(prompts[:1]), SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1


def test_va_requests_get_the_plain_softmax_log_probs(llm, reference, prompts):
    """On a model that records a head, nmst_head "va" decodes plain softmax and gets vLLM's log-probs, sampled
    and prompt, which are then the decoded distribution's: log_softmax of the model's logits."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2,
                            extra_args={"nmst_head": "va"})
    outs = llm.generate(_tokens(prompts[:3]), params, use_tqdm=False)
    for p, o in zip(prompts[:3], outs):
        tokens = list(o.outputs[0].token_ids)
        with torch.no_grad():
            log_p = reference(input_ids=torch.tensor([p + tokens])).logits[0].double().log_softmax(-1)
        returned = [None] + list(o.prompt_logprobs[1:]) + list(o.outputs[0].logprobs)  # row i scores token i
        assert len(returned) == len(p) + len(tokens)
        for i in range(1, len(returned)):
            for candidate, logprob in returned[i].items():
                assert abs(logprob.logprob - float(log_p[i - 1, candidate])) < 2e-4, (i, candidate)


class _Before:
    """An HF logits processor standing for vLLM's controls that run before the head: a logit bias, a
    mask of allowed tokens and banned tokens (single-token bad words)."""

    def __init__(self, bias: dict, allowed, banned=()):
        self.bias, self.allowed, self.banned = bias, allowed, list(banned)

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for token, value in self.bias.items():
            scores[:, token] += value
        if self.allowed is not None:
            banned = torch.ones(scores.shape[-1], dtype=torch.bool)
            banned[self.allowed] = False
            scores[:, banned] = float("-inf")
        scores[:, self.banned] = float("-inf")
        return scores


@pytest.mark.parametrize("bias, allowed, bad", [
    ({EOS: 2.0, 65: 5.0}, None, None),  # logit_bias: the head reads the biased logits, eos's too
    ({}, list(range(40, 80)) + [EOS], None),  # allowed_token_ids with eos: the head over the allowed tokens
    ({}, list(range(40, 80)), None),  # without eos: eos banned, never emitted, the rest renormalized
    ({"A": 8.0}, None, ["A"]),  # bad_words: the token of "A", banned however biased
    ({}, None, ["</s>"]),  # eos as a bad word: banned, the generation runs to max_tokens
])
def test_controls_before_the_head(llm, reference, prompts, nmst_dir, bias, allowed, bad):
    from transformers import AutoTokenizer, GenerationConfig
    from vllm import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(nmst_dir)
    token_of = {word: tokenizer.encode(word, add_special_tokens=False) for word in ("A", "</s>")}
    assert token_of["</s>"] == [EOS] and len(token_of["A"]) == 1
    bias = {token_of[k][0] if isinstance(k, str) else k: v for k, v in bias.items()}

    params = SamplingParams(temperature=0.0, max_tokens=30, logit_bias=bias or None, allowed_token_ids=allowed,
                            bad_words=bad)
    outs = llm.generate(_tokens(prompts[:6]), params, use_tqdm=False)
    config = GenerationConfig(do_sample=False, max_new_tokens=30, eos_token_id=EOS, pad_token_id=EOS)
    for p, o in zip(prompts[:6], outs):
        processor = HeadEosColumn(len(p), eos=EOS, eps=EPS)
        before = _Before(bias, allowed, [t for word in bad or () for t in token_of[word]])
        hf = reference.generate(torch.tensor([p]), generation_config=config, logits_processor=[before, processor])
        assert list(o.outputs[0].token_ids) == hf[0, len(p):].tolist()
        if allowed is not None:
            assert set(o.outputs[0].token_ids) <= set(allowed)
        if bad == ["</s>"]:
            assert len(o.outputs[0].token_ids) == 30 and EOS not in o.outputs[0].token_ids


class _HeadThenPenalties:
    """An HF logits processor standing for the head followed by vLLM's penalties (greedy rows): the
    processor's output (non-eos logits as they are, eos at its effective logit ζ_eos), then vLLM's
    repetition penalty on the tokens of prompt and output, then its frequency and presence penalties
    on the output's counts."""

    def __init__(self, prompt_length: int, repetition: float, frequency: float, presence: float):
        self.prompt_length, self.repetition = prompt_length, repetition
        self.frequency, self.presence = frequency, presence
        self.head = HeadEosColumn(prompt_length, eos=EOS, eps=EPS)

    def __call__(self, input_ids, scores):
        row = self.head(input_ids, scores).double()
        seen = torch.zeros_like(row, dtype=torch.bool)
        seen[0, input_ids[0]] = True
        penalty = torch.where(seen, self.repetition, 1.0)
        row = torch.where(row > 0, row / penalty, row * penalty)
        counts = torch.bincount(input_ids[0, self.prompt_length:], minlength=row.shape[1])[None].double()
        return (row - self.frequency * counts - self.presence * (counts > 0)).float()


def test_penalties_act_on_the_heads_output(llm, reference, prompts):
    """Repetition, frequency and presence penalties run after the head, on its output: each greedy
    generation equals the head, then vLLM's penalty formulas, then the argmax."""
    from transformers import GenerationConfig
    from vllm import SamplingParams

    penalties = dict(repetition=1.3, frequency=0.4, presence=0.6)
    params = SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=penalties["repetition"],
                            frequency_penalty=penalties["frequency"], presence_penalty=penalties["presence"])
    outs = llm.generate(_tokens(prompts[:6]), params, use_tqdm=False)
    plain = llm.generate(_tokens(prompts[:6]), SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)
    config = GenerationConfig(do_sample=False, max_new_tokens=30, eos_token_id=EOS, pad_token_id=EOS)
    for p, o in zip(prompts[:6], outs):
        after = _HeadThenPenalties(len(p), **penalties)
        hf = reference.generate(torch.tensor([p]), generation_config=config, logits_processor=[after])
        assert list(o.outputs[0].token_ids) == hf[0, len(p):].tolist()
    assert [o.outputs[0].token_ids for o in outs] != [o.outputs[0].token_ids for o in plain]  # they act


def test_stop_strings_end_a_generation_and_leave_the_head_alone(llm, prompts, nmst_dir):
    """A stop string ends a generation where its text appears (finish_reason "stop", the string as the
    stop reason, the tokens a prefix of the generation without it); generations it does not occur in are
    unchanged."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(nmst_dir)
    free = llm.generate(_tokens(prompts), SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    texts = [tokenizer.decode([t for t in o.outputs[0].token_ids if t < 256]) for o in free]
    letters = Counter(ch for text in texts for ch in set(text) if ch.isascii() and ch.isalnum())
    stop = letters.most_common(1)[0][0]
    outs = llm.generate(_tokens(prompts), SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]),
                        use_tqdm=False)
    stopped = 0
    for f, text, o in zip(free, texts, outs):
        tokens, full = list(o.outputs[0].token_ids), list(f.outputs[0].token_ids)
        if stop in text:
            stopped += 1
            assert (o.outputs[0].finish_reason, o.outputs[0].stop_reason) == ("stop", stop), (text, o.outputs[0])
            assert full[:len(tokens)] == tokens and stop not in o.outputs[0].text
        else:
            assert tokens == full
    assert 0 < stopped < len(prompts)


def test_min_p_acts_on_the_heads_distribution(llm, reference):
    """20,000 first tokens at temperature 1.3 with min_p 0.05: the head's distribution (temperature on the
    non-eos logits), cut to the tokens of probability ≥ 0.05 × the largest, renormalized (G-test)."""
    from vllm import SamplingParams

    prompt = [73, 8, 228, 231, 190, 155, 112]
    draws = 20_000
    outs = llm.generate(_tokens([prompt] * draws), SamplingParams(temperature=1.3, min_p=0.05, max_tokens=1),
                        use_tqdm=False)
    first = Counter(o.outputs[0].token_ids[0] for o in outs)
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor([prompt])).logits[:, -1].double()
    probs = step_log_probs(logits, head="nmst", eos_index=EOS, eps=EPS, steps=1, temperature=1.3)[0][0].exp()
    probs = torch.where(probs >= 0.05 * probs.max(), probs, 0.0)
    probs = probs / probs.sum()
    assert probs[EOS] > 0.01 and int((probs > 0).sum()) >= 10  # eos in play, a real cut
    g, df = g_test(first, probs)
    assert chi2.sf(g, df) > 1e-4, (g, df)
