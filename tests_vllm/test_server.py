"""The processor behind vLLM's OpenAI-compatible server (``vllm serve DIR``, loopback only): a plain
model, NMST asked per request through ``vllm_xargs``, a bad setting answered with HTTP 400."""

from __future__ import annotations

import pytest
import requests
import torch
from conftest import EPS
from server import vllm_server

import nmst_fast
from nmst_fast.integrations.hf import HFDecoder

from hf_models import SERVED_EOS as EOS

T_HALF = nmst_fast.termination_bound(EPS)
NMST = {"nmst_head": "nmst", "nmst_eps": EPS}


@pytest.fixture(scope="module")
def server(plain_dir, tmp_path_factory):
    """``vllm serve`` of the plain model on 127.0.0.1 (the processor comes in as the plugin)."""
    with vllm_server(plain_dir, tmp_path_factory.mktemp("server") / "serve.log") as url:
        yield url, plain_dir


def _complete(server, **body) -> requests.Response:
    url, model = server
    return requests.post(f"{url}/v1/completions", json={"model": model, **body}, timeout=120)


def test_n_choices_stop_by_t_half(server):
    """n > 1 through the sampling path: top-k 1 at temperature 1 is the head's argmax (vLLM refuses
    n > 1 with temperature 0), so every choice ends with eos by t½; sampled choices all stop too."""
    prompt = [72, 101, 108, 108, 111]
    greedy = _complete(server, prompt=prompt, n=4, temperature=1.0, top_k=1, max_tokens=500, vllm_xargs=NMST,
                       return_token_ids=True)
    assert greedy.status_code == 200, greedy.text
    for choice in greedy.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        assert len(choice["token_ids"]) <= T_HALF and choice["token_ids"][-1] == EOS
    sampled = _complete(server, prompt=prompt, n=8, temperature=1.0, max_tokens=500, seed=5, vllm_xargs=NMST,
                        return_token_ids=True)
    assert sampled.status_code == 200, sampled.text
    assert all(c["finish_reason"] == "stop" and c["token_ids"][-1] == EOS for c in sampled.json()["choices"])


def test_xargs_turn_nmst_on_for_a_plain_model(server, reference, prompts):
    decoder = HFDecoder(reference, head="nmst", eps=EPS, eos_token_id=EOS)
    plain = HFDecoder(reference, head="va", eos_token_id=EOS)
    for p in prompts[:4]:
        expected = nmst_fast.generate(decoder, torch.tensor([p]), strategy="greedy", max_length=40)
        r = _complete(server, prompt=p, temperature=0.0, max_tokens=40, vllm_xargs=NMST, return_token_ids=True)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == expected.tokens[0, :expected.lengths[0]].tolist()
        # Without vllm_xargs the plain model decodes plain softmax.
        expected = nmst_fast.generate(plain, torch.tensor([p]), strategy="greedy", max_length=20)
        r = _complete(server, prompt=p, temperature=0.0, max_tokens=20, return_token_ids=True)
        assert r.json()["choices"][0]["token_ids"] == expected.tokens[0, :expected.lengths[0]].tolist()


@pytest.mark.parametrize("xargs", [{"nmst_head": "nmst", "nmst_eps": 2.0}, {"nmst_head": "bogus"},
                                   {"nmst_head": "nmst", "nmst_eos_token_id": 100000}])
def test_bad_setting_is_http_400(server, xargs):
    r = _complete(server, prompt=[1, 2, 3], max_tokens=4, vllm_xargs=xargs)
    assert r.status_code == 400, (r.status_code, r.text)
    assert "nmst" in r.text
    r = _complete(server, prompt=[1, 2, 3], max_tokens=4, temperature=0.0, vllm_xargs=NMST)
    assert r.status_code == 200, r.text


def test_logprobs_are_the_plain_models_or_refused_under_a_head(server, reference):
    """The server runs vLLM's default logprobs_mode (raw_logprobs): a request that decodes NMST and asks for
    log-probs (sampled tokens, prompt tokens, or both through echo) gets HTTP 400 with the fix, and the
    server goes on serving; the plain model's requests, and "va" ones, get vLLM's log-probs: log_softmax of
    the model's logits."""
    prompt = [72, 101, 108, 108, 111, 33, 7]
    refusals = [(dict(logprobs=2), "--logprobs-mode processed_logprobs"),
                (dict(prompt_logprobs=1), "prompt_logprobs would be the model's plain softmax"),
                (dict(echo=True, logprobs=1), "prompt_logprobs would be the model's plain softmax")]
    for body, message in refusals:
        r = _complete(server, prompt=prompt, max_tokens=4, temperature=0.0, vllm_xargs=NMST, **body)
        assert r.status_code == 400, (body, r.status_code, r.text)
        assert message in r.text, r.text
    for xargs in ({}, {"vllm_xargs": {"nmst_head": "va"}}):
        r = _complete(server, prompt=prompt, max_tokens=6, temperature=0.0, logprobs=3, prompt_logprobs=2,
                      return_token_ids=True, **xargs)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        tokens = choice["token_ids"]
        with torch.no_grad():
            log_p = reference(input_ids=torch.tensor([prompt + tokens])).logits[0].double().log_softmax(-1)
        sampled = choice["logprobs"]["token_logprobs"]
        assert len(sampled) == len(tokens) == 6
        for i, (token, value) in enumerate(zip(tokens, sampled)):
            assert abs(value - float(log_p[len(prompt) - 1 + i, token])) < 2e-4, (i, token)
        scored = choice["prompt_logprobs"]
        assert scored[0] is None and len(scored) == len(prompt)
        for i in range(1, len(prompt)):
            assert str(prompt[i]) in scored[i] and len(scored[i]) >= 2
            for token, entry in scored[i].items():
                assert abs(entry["logprob"] - float(log_p[i - 1, int(token)])) < 2e-4, (i, token)
    r = _complete(server, prompt=prompt, max_tokens=4, temperature=0.0, vllm_xargs=NMST)
    assert r.status_code == 200, r.text
