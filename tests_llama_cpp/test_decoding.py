"""The head decoded by llama-cpp-python: greedy equals nmst_fast.generate on the Hugging Face model, sampling is the
head's tempered and truncated distribution (G-test), errors stop the generation, files without the head are refused,
and plain llama.cpp refuses the NMST files."""

from __future__ import annotations

import shutil
from collections import Counter
from typing import Optional

import numpy as np
import pytest
import torch
from conftest import EPS
from llama_cpp import Llama, LogitsProcessorList
from scipy.stats import chi2
from transformers import AutoModelForCausalLM

import nmst_fast
from nmst_fast.decoding import step_log_probs
from nmst_fast.integrations.hf import HFDecoder
from nmst_fast.integrations.llama_cpp import NMSTLlama, NMSTLogitsProcessor, decoding, load
from nmst_fast.reference import truncated_distribution

from helpers import g_test
from hf_models import head_log_probs
from wikitext_text import generated_lines

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gpt2"]
T_HALF = nmst_fast.termination_bound(EPS)
OPEN = dict(n_ctx=128, verbose=False, seed=0, logits_all=True)  # logits_all: Llama.scores holds every row


def prompts(tokenizer, n: int = 6) -> list[list[int]]:
    return [tokenizer.encode(" " + line, add_special_tokens=False)[: 3 + i % 5]
            for i, line in enumerate(generated_lines("test", n))]


def reference_greedy(directory, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """nmst_fast.generate's greedy tokens on the saved HF model (float32), and the smallest float64 margin between
    the head's two likeliest tokens along them."""
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    out = nmst_fast.generate(HFDecoder(model), torch.tensor([prompt]), strategy="greedy", max_length=max_tokens)
    tokens = out.tokens[0, :out.lengths[0]].tolist()
    settings = model.config.nmst
    with torch.no_grad():
        logits = model.double()(torch.tensor([prompt + tokens]), nmst_logits=False).logits[:, len(prompt) - 1:-1]
    steps = torch.arange(1, len(tokens) + 1)[None]
    log_p = head_log_probs(logits, head=settings["head"], eps=settings["eps"], eos=settings["eos_token_id"],
                           steps=steps)
    top2 = log_p[0].topk(2, dim=-1).values
    return tokens, float((top2[:, 0] - top2[:, 1]).min())


def greedy(llm: Llama, prompt: list[int], max_tokens: int, **kwargs) -> list[int]:
    """llama.cpp's greedy ids (through ``Llama.generate``, as ``create_completion`` runs it), eos included."""
    ids = []
    for token in llm.generate(prompt, temp=0.0, **kwargs):
        ids.append(int(token))
        if token == llm.token_eos() or len(ids) == max_tokens:
            return ids
    return ids


def first_token(llm: Llama, prompt: list[int], seed: int, **kwargs) -> int:
    llm.set_seed(seed)
    kwargs.setdefault("min_p", 0.0)
    return int(next(llm.generate(prompt, **kwargs)))


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_llama_cpp_refuses_the_file_and_the_head_decodes_greedy_as_nmst_fast_generate(family, exported,
                                                                                             tokenizer):
    directory, path = exported(family)
    with pytest.raises(ValueError, match="Failed to load model"):
        Llama(str(path), verbose=False)
    llm = load(path, **OPEN)
    # The weights and hyper-parameters as llama.cpp reads them: its logits are the model's output layer's (to
    # float32 rounding and llama.cpp's float16 KV cache), which nmst_logits=False gives.
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = prompts(tokenizer)[0]
    llm.reset()
    llm.eval(prompt)
    with torch.no_grad():
        expected_logits = model(torch.tensor([prompt]), nmst_logits=False).logits[0]
    got_logits = torch.tensor(np.array(llm.scores[:len(prompt)]))
    assert (got_logits - expected_logits).abs().max() <= 2e-3 * expected_logits.abs().max()
    compared = 0
    for prompt in prompts(tokenizer):
        expected, margin = reference_greedy(directory, prompt, 40)
        if margin < 5e-3:  # llama.cpp's float32 logits differ from torch's by up to ~1e-3 here: a near tie may flip
            continue
        got = greedy(llm, prompt, 40)
        assert got == expected, (prompt, got, expected)
        assert len(got) <= T_HALF and got[-1] == tokenizer.eos_token_id  # NMST stops by t½
        completion = llm.create_completion(prompt, max_tokens=40, temperature=0.0)  # the user's call: same stop
        assert completion["choices"][0]["finish_reason"] == "stop"
        assert completion["usage"]["completion_tokens"] == len(expected) - 1  # eos is not counted
        compared += 1
    assert compared >= 4


@pytest.mark.parametrize("head, eps", [("st", 1e-3), ("st", EPS), ("va", EPS), ("nmst", 0.3)])
def test_st_va_and_a_large_eps_decode_greedy_as_nmst_fast_generate(head, eps, exported, tokenizer):
    directory, path = exported("llama", head, eps=eps)
    llm = load(path, **OPEN)
    compared = 0
    for prompt in prompts(tokenizer):
        expected, margin = reference_greedy(directory, prompt, 30)
        if margin < 5e-3:
            continue
        assert greedy(llm, prompt, 30) == expected, prompt
        compared += 1
    assert compared >= 4


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_f16_and_q8_0_files_stop_by_t_half(dtype, exported, tokenizer):
    _, path = exported("qwen3", dtype=dtype)
    llm = load(path, **OPEN)
    for prompt in prompts(tokenizer):
        got = greedy(llm, prompt, 60)
        assert len(got) <= T_HALF and got[-1] == tokenizer.eos_token_id


def step_one_distribution(llm: Llama, prompt: list[int], *, temperature: float, top_k, top_p,
                          min_p=None) -> torch.Tensor:
    """The head's first-step distribution from llama.cpp's own logits of ``prompt``: tempered, then truncated."""
    llm.reset()
    llm.eval(prompt)
    logits = torch.tensor(np.array(llm.scores[len(prompt) - 1]), dtype=torch.float64)[None]
    head = llm.head
    log_p, _ = step_log_probs(logits, head=head.head, eos_index=head.eos_index, eps=head.eps, steps=1,
                              temperature=temperature)
    return truncated_distribution(log_p, top_k, top_p, min_p)[0]


@pytest.mark.parametrize("temperature, top_k, top_p, min_p, penalty", [
    (1.0, None, None, None, 1.0), (0.6, None, None, None, 1.0), (1.7, 20, None, None, 1.0),
    (0.8, None, 0.7, None, 1.0), (1.3, 30, 0.9, None, 1.0), (0.8, 40, 0.95, 0.05, 1.0), (1.2, None, None, 0.1, 1.0),
    (0.8, 40, 0.95, 0.05, 1.000001)])
def test_sampling_is_the_heads_tempered_truncated_distribution(temperature, top_k, top_p, min_p, penalty, exported,
                                                               tokenizer):
    """G-test of 1500 first tokens per prompt, two prompts (seeds 0…: a fixed, reproducible sample); the head's
    sampler draws them itself (llama.cpp's defaults among the cases: top-k 40, top-p 0.95, min-p 0.05), and, with a
    repeat penalty (1.000001: no visible change of the distribution), hands them to llama.cpp's own samplers."""
    _, path = exported("llama")
    llm = load(path, **OPEN)
    g_total, df_total = 0.0, 0
    for prompt in prompts(tokenizer, 2):
        probs = step_one_distribution(llm, prompt, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        counts = Counter(first_token(llm, prompt, seed, temp=temperature, top_k=top_k or 0, top_p=top_p or 1.0,
                                     min_p=min_p or 0.0, repeat_penalty=penalty)
                         for seed in range(1500))
        assert llm._nmst_sampler.state.draw == (penalty == 1.0)
        g, df = g_test(counts, probs)
        g_total, df_total = g_total + g, df_total + df
    assert chi2.sf(g_total, df_total) > 1e-3, (g_total, df_total)


# load (NMSTLlama) or a Llama of one's own with an NMSTLogitsProcessor, with the CPU kernels (the head is the C
# sampler) or without (a processor in llama-cpp-python's callback)
HEAD_PATHS = ["load", "load without the kernels", "own", "own without the kernels"]


def open_head(path, how: str, monkeypatch) -> tuple[Llama, Optional[LogitsProcessorList]]:
    """The file opened with the head on one of :data:`HEAD_PATHS`, and the processors to pass to each call."""
    if how.endswith("without the kernels"):
        monkeypatch.setattr(decoding, "native_sampler_available", lambda: False)
    if how.startswith("own"):
        _, base = decoding.read_file_head(path)
        llm = Llama(str(path), kv_overrides={"general.architecture": base}, **OPEN)
        processor = NMSTLogitsProcessor(llm)
        processors = LogitsProcessorList([processor])
    else:
        llm = load(path, **OPEN)
        processor, processors = llm._steps, None
    assert (processor.sampler is None) == how.endswith("without the kernels")
    return llm, processors


def ran_as(llm: Llama) -> str:
    """Which way the last generation ran the head (the C sampler: first in the chain llama.cpp sampled with)."""
    import ctypes

    import llama_cpp

    if llm._nmst_sampler is None:
        return "processor"
    first = llama_cpp.llama_sampler_chain_get(llm._sampler.sampler, 0)
    assert ctypes.cast(first, ctypes.c_void_p).value == ctypes.addressof(llm._nmst_sampler._sampler)
    assert llama_cpp.llama_sampler_name(first) == b"nmst-head"
    # drawing alone, the head samples from the context's logits row (the chain's sample is its own)
    assert ("sample" in vars(llm._sampler)) == bool(llm._nmst_sampler.state.draw)
    return "sampler"


@pytest.mark.parametrize("how", HEAD_PATHS[1:])
@pytest.mark.parametrize("head, eps", [("nmst", EPS), ("st", EPS)])
def test_every_path_decodes_greedy_as_nmst_fast_generate(how, head, eps, exported, tokenizer, monkeypatch):
    directory, path = exported("llama", head, eps=eps)
    llm, processors = open_head(path, how, monkeypatch)
    compared = 0
    for prompt in prompts(tokenizer):
        expected, margin = reference_greedy(directory, prompt, 30)
        if margin < 5e-3:
            continue
        assert greedy(llm, prompt, 30, logits_processor=processors) == expected, prompt
        assert ran_as(llm) == ("processor" if how.endswith("without the kernels") else "sampler")
        compared += 1
    assert compared >= 4


def test_the_draw_from_the_logits_row_refuses_a_step_without_logits(exported, tokenizer):
    """Greedy and llama.cpp's default cuts: the head draws alone, from the context's logits row; a ``sample`` call
    for an output llama.cpp holds no logits of (where its own llama_sampler_sample aborts the process) raises the
    head's error, and the next generation runs."""
    _, path = exported("llama")
    llm = load(path, **OPEN)
    prompt = prompts(tokenizer, 1)[0]
    for kwargs in (dict(temp=0.0), dict(temp=0.8, top_k=40, top_p=0.95, min_p=0.05)):
        llm.set_seed(0)
        tokens = [int(token) for _, token in zip(range(4), llm.generate(prompt, **kwargs))]
        assert ran_as(llm) == "sampler" and llm._nmst_sampler.state.draw == 1
        with pytest.raises(RuntimeError, match="NMST head failed") as raised:
            llm.sample(**kwargs, idx=llm.n_tokens + 10_000)
        assert "no logits for the output the step at t=5 samples" in str(raised.value.__cause__)
        llm.set_seed(0)
        assert [int(token) for _, token in zip(range(4), llm.generate(prompt, **kwargs))] == tokens


def test_a_processor_after_another_runs_in_the_callback(exported, tokenizer):
    """The head stays where the call puts it: after a processor of the user's, it is a processor too (and sees
    that processor's logits)."""
    directory, path = exported("llama")
    llm = Llama(str(path), kv_overrides={"general.architecture": "llama"}, **OPEN)
    seen = []

    def watch(input_ids, scores):
        seen.append(len(input_ids))
        return scores

    processors = LogitsProcessorList([watch, NMSTLogitsProcessor(llm)])
    prompt, expected = next((p, e) for p in prompts(tokenizer) for e, margin in [reference_greedy(directory, p, 30)]
                            if margin >= 5e-3)
    assert greedy(llm, prompt, 30, logits_processor=processors) == expected
    assert ran_as(llm) == "processor" and len(seen) == len(expected)


@pytest.mark.parametrize("how", ["own", "own without the kernels"])
def test_a_processor_of_ones_own_follows_the_calls_temperature(how, exported, tokenizer, monkeypatch):
    _, path = exported("gpt2")
    reference = load(path, **OPEN)
    prompt = prompts(tokenizer, 1)[0]
    probs = step_one_distribution(reference, prompt, temperature=0.5, top_k=None, top_p=None)
    llm, processors = open_head(path, how, monkeypatch)
    counts = Counter(first_token(llm, prompt, seed, temp=0.5, top_k=0, top_p=1.0, logits_processor=processors)
                     for seed in range(1500))
    assert ran_as(llm) == ("processor" if how.endswith("without the kernels") else "sampler")
    g, df = g_test(counts, probs)
    assert chi2.sf(g, df) > 1e-3


# The processors' errors pass through llama-cpp-python's callback, which prints them ("Exception ignored ...").
@pytest.mark.filterwarnings("ignore:Exception ignored:pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("how", HEAD_PATHS)
def test_nan_logits_stop_the_generation_before_their_token(how, exported, tokenizer, tmp_path, monkeypatch):
    """A file whose embedding of the second greedy token is NaN: the logits of step 3 are NaN. The C sampler and
    the processor (whose errors llama-cpp-python's callback swallows, sampling the plain logits) keep the failure;
    sample() raises it before that step's token reaches the caller; the next generation starts afresh."""
    import gguf

    _, path = exported("llama", eps=1e-4)
    healthy = load(path, **OPEN)
    for prompt in prompts(tokenizer):
        first = greedy(healthy, prompt, 6)
        if len(first) == 6 and first[1] != first[0] and first[1] not in prompt:
            break
    else:
        pytest.fail("no prompt whose greedy run feeds a new token at step 3")
    poisoned = tmp_path / "nan.gguf"
    shutil.copy(path, poisoned)
    (embedding,) = [t for t in gguf.GGUFReader(poisoned, "r+").tensors if t.name == "token_embd.weight"]
    embedding.data[first[1]] = np.nan
    embedding.data.flush()
    llm, processors = open_head(poisoned, how, monkeypatch)
    chunks = []
    with pytest.raises(RuntimeError, match="NMST head failed") as raised:
        for chunk in llm.create_completion(prompt, max_tokens=20, temperature=0.0, stream=True,
                                           logits_processor=processors):
            chunks.append(chunk)
    assert isinstance(raised.value.__cause__, ValueError)
    assert "logits at step t=3 hold NaN" in str(raised.value)
    assert llm.n_tokens == len(prompt) + 2  # the third token was never taken
    # llama.cpp keeps the poisoned token's NaN keys and values in its cache, where masked cells still enter the
    # attention (0 · NaN): cleared, the next generation runs with no error kept.
    llm._ctx.kv_cache_clear()
    llm.reset()
    assert greedy(llm, prompt, 2, logits_processor=processors) == first[:2]


def test_files_without_the_head_and_modes_the_head_cannot_follow_are_refused(exported, tmp_path):
    import gguf

    _, path = exported("llama")
    reader = gguf.GGUFReader(path)
    plain = tmp_path / "plain.gguf"
    writer = gguf.GGUFWriter(plain, "llama")
    for key, field in reader.fields.items():
        if key.startswith(("nmst.", "general.architecture", "GGUF.")):
            continue
        value = field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, field.types[0])
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_shape=list(reversed(tensor.shape.tolist())),
                          raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    llm = Llama(str(plain), **OPEN)  # a plain llama file: llama.cpp opens it
    with pytest.raises(ValueError, match="carries no NMST head"):
        NMSTLlama(str(plain), **OPEN)
    with pytest.raises(ValueError, match="carries no NMST head"):
        NMSTLogitsProcessor(llm)
    nmst = load(path, **OPEN)
    with pytest.raises(ValueError, match="mirostat"):
        nmst.create_completion([1, 2], max_tokens=2, mirostat_mode=2)


@pytest.mark.parametrize("how", HEAD_PATHS)
def test_logprobs_of_the_raw_logits_are_refused_where_the_head_decodes(how, exported, monkeypatch):
    """llama-cpp-python's completion logprobs are the raw logits' softmax: asked for where the head decodes (every
    call of load's Llama; a call that gives the head's processor), they are refused, also through the chat
    completion and ``__call__``; a Llama of one's own called without the head still returns them."""
    _, path = exported("llama")
    llm, processors = open_head(path, how, monkeypatch)
    calls = [lambda: llm.create_completion([1, 2], max_tokens=2, logprobs=1, logits_processor=processors),
             lambda: llm([1, 2], None, 2, 0.0, 0.95, 0.05, 1.0, 3, logits_processor=processors),  # logprobs: 8th
             lambda: llm.create_chat_completion([{"role": "user", "content": "a b"}], max_tokens=2, logprobs=True,
                                                top_logprobs=1, logits_processor=processors)]
    for call in calls:
        with pytest.raises(ValueError, match="logprobs: llama-cpp-python computes them from the raw logits"):
            call()
    assert llm.create_completion([1, 2], max_tokens=2, logits_processor=processors)["choices"][0]["logprobs"] is None
    if how.startswith("own"):
        plain = llm.create_completion([1, 2], max_tokens=2, logprobs=1)["choices"][0]["logprobs"]
        assert len(plain["token_logprobs"]) == 2
