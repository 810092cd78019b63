"""A model at real width and vocabulary (Qwen3-0.6B's: 1024 wide, V = 151936, tied embeddings; 2 of its 28
layers) through the whole path a user takes: saved with a head, opened in a fresh process with ``from_pretrained``
and decoded with ``generate()``, exported to q8_0 with the ``nmst-fast`` command, decoded by llama.cpp through
``load`` (whose default keeps quantized weights out of llama.cpp's AMX buffers on a CPU that has AMX). Every greedy
run ends with eos by t½."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import nmst_fast
from nmst_fast.integrations.hf import apply_nmst
from nmst_fast.integrations.llama_cpp import load

from hf_models import QWEN3_06B, real_size_qwen3
from test_decoding import OPEN, greedy, prompts

EPS = 0.05


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer) -> Path:
    directory = tmp_path_factory.mktemp("qwen3-real-size")
    model = apply_nmst(real_size_qwen3(tokenizer, layers=2), head="nmst", eps=EPS)
    assert model.get_output_embeddings().weight.shape == (QWEN3_06B["vocab_size"], QWEN3_06B["hidden_size"])
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_a_real_size_model_saves_opens_generates_exports_and_decodes_in_llama_cpp(saved, tokenizer, tmp_path):
    t_half = nmst_fast.termination_bound(EPS)
    cases = prompts(tokenizer, 3)
    opened = subprocess.run([sys.executable, "-c", f"""
import json, torch
import nmst_fast
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(saved)!r})
assert type(model).__name__ == "NMSTQwen3ForCausalLM", type(model)
runs = []
for prompt in {cases!r}:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False)
    runs.append(out[0, len(prompt):].tolist())
print(json.dumps(runs))
"""], capture_output=True, text=True, timeout=600)
    assert opened.returncode == 0, opened.stderr[-3000:]
    eos = tokenizer.eos_token_id
    for run in json.loads(opened.stdout.strip().splitlines()[-1]):
        assert eos in run and run.index(eos) < t_half, run

    out = tmp_path / "model-q8_0.gguf"
    exported = subprocess.run([Path(sys.executable).with_name("nmst-fast"), "export-gguf", str(saved), str(out),
                               "--type", "q8_0"], capture_output=True, text=True, timeout=600)
    assert exported.returncode == 0, exported.stderr[-3000:]
    llm = load(out, **OPEN)
    assert llm.n_vocab() == QWEN3_06B["vocab_size"]
    for prompt in cases:
        got = greedy(llm, prompt, 60)
        assert got[-1] == eos and len(got) <= t_half, got
