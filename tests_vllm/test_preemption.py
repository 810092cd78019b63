"""An engine with a KV cache of 4 blocks, so that requests are preempted and recomputed, returning
processed log-probs: ST stays token-exact through preemption, the returned log-probs are the head's, and
prompt log-probs (which no processor sees) are refused."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import ENGINE_ARGS, EPS

import nmst_fast
from nmst_fast.decoding import step_log_probs
from nmst_fast.integrations.hf import HFDecoder

from hf_models import SERVED_EOS as EOS
from hf_models import SERVED_ST_EOS as ST_EOS

ST = {"nmst_head": "st", "nmst_eps": 1e-3, "nmst_eos_token_id": ST_EOS}


@pytest.fixture(scope="module")
def small_llm(nmst_dir):
    from vllm import LLM

    args = {**ENGINE_ARGS, "max_model_len": 256, "num_gpu_blocks_override": 4, "enable_prefix_caching": False,
            "logprobs_mode": "processed_logprobs", "disable_log_stats": False}
    engine = LLM(nmst_dir, **args)
    yield engine
    del engine


def _preemptions(llm) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def test_st_exact_through_preemption(small_llm, reference):
    """Prompts of 90 to 112 tokens: a request that generates past 128 tokens in all needs a second
    block of 128, which the four blocks of the cache only free by preempting another request."""
    from vllm import SamplingParams

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (90 + 2 * i,), generator=g).tolist() for i in range(12)]
    before = _preemptions(small_llm)
    decoder = HFDecoder(reference, head="st", eps=1e-3, eos_token_id=ST_EOS)
    expected = []
    for p in prompts:
        out = nmst_fast.generate(decoder, torch.tensor([p]), strategy="greedy", max_length=120)
        expected.append(out.tokens[0, :out.lengths[0]].tolist())
    params = SamplingParams(temperature=0.0, max_tokens=120, stop_token_ids=[ST_EOS], extra_args=ST)
    outs = small_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert _preemptions(small_llm) > before  # the cache held too little: requests were preempted


def test_processed_logprobs_are_the_heads(small_llm, reference, prompts):
    """logprobs_mode="processed_logprobs": greedy rows return log q (T = 1), sampled rows log q_T,
    where q_T divides the non-eos logits by T only."""
    from vllm import SamplingParams

    for temperature in (0.0, 0.7):
        params = SamplingParams(temperature=temperature, max_tokens=8, logprobs=3)
        outs = small_llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
        for p, o in zip(prompts[:4], outs):
            tokens = list(o.outputs[0].token_ids)
            with torch.no_grad():
                logits = reference(input_ids=torch.tensor([p + tokens])).logits[0, len(p) - 1:-1].double()
            T = temperature if temperature > 0 else 1.0
            for t, (row, token, returned) in enumerate(zip(logits, tokens, o.outputs[0].logprobs), start=1):
                log_q, _ = step_log_probs(row[None], head="nmst", eos_index=EOS, eps=EPS, steps=t, temperature=T)
                for candidate, logprob in returned.items():
                    assert abs(logprob.logprob - float(log_q[0, candidate])) < 2e-4, (t, candidate)
                assert token in returned


def test_processed_logprobs_match_the_reference(small_llm, reference, prompts):
    """Per request, ST (its own eos) and NMST, greedy and at temperature 0.8: each returned log-prob equals
    nmst_fast.nmst_log_probs on the HF model's logits of the generated positions (t = 1, 2, …; ST's running sum
    along them), through max_tokens (ignore_eos: the head runs on past eos), and differs from the plain
    softmax's. Prompt log-probs are refused under this mode too, with the reason."""
    from vllm import SamplingParams

    heads = [("st", 1e-3, ST_EOS, ST), ("nmst", 0.02, EOS, {"nmst_head": "nmst", "nmst_eps": 0.02})]
    checked, off_softmax = 0, Counter()
    for head, eps, eos, extra in heads:
        for temperature in (0.0, 0.8):
            params = SamplingParams(temperature=temperature, max_tokens=10, logprobs=4, ignore_eos=True,
                                    extra_args=extra)
            outs = small_llm.generate([{"prompt_token_ids": p} for p in prompts[4:7]], params, use_tqdm=False)
            for p, o in zip(prompts[4:7], outs):
                tokens = list(o.outputs[0].token_ids)
                with torch.no_grad():
                    logits = reference(input_ids=torch.tensor([p + tokens])).logits[:, len(p) - 1:-1].double()
                if temperature > 0:  # the spec's temperature: the non-eos logits divided by T, eos's untouched
                    logits = torch.cat([logits[..., :eos] / temperature, logits[..., eos:eos + 1],
                                        logits[..., eos + 1:] / temperature], dim=-1)
                log_q = nmst_fast.nmst_log_probs(logits, eos_index=eos, eps=eps, head=head)[0]
                plain = logits[0].log_softmax(-1)
                assert len(o.outputs[0].logprobs) == len(tokens) == 10
                for t, (token, returned) in enumerate(zip(tokens, o.outputs[0].logprobs)):
                    assert token in returned and len(returned) >= 4
                    for candidate, logprob in returned.items():
                        assert abs(logprob.logprob - float(log_q[t, candidate])) < 2e-4, (head, t, candidate)
                        checked += 1
                        off_softmax[head] += abs(logprob.logprob - float(plain[t, candidate])) > 1e-2
    assert checked >= 2 * 2 * 3 * 10 * 4
    assert min(off_softmax["st"], off_softmax["nmst"]) > 20, off_softmax  # the check tells the head from softmax
    with pytest.raises(Exception, match="prompt_logprobs would be the model's plain softmax") as info:
        small_llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2, prompt_logprobs=1),
                           use_tqdm=False)
    assert isinstance(info.value.__cause__, ValueError) or isinstance(info.value, ValueError)
