"""The walk-through's model (``python -m train.post_training``) in llama.cpp: exported as it is, tokenized as Hugging
Face tokenizes it, and decoded greedily as ``nmst_fast.generate`` decodes it, every test prompt ending with eos by
t½. ``.ci/run`` runs the walk-through first and names its output in ``NMST_WALKTHROUGH_DIR``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import nmst_fast
from nmst_fast.integrations.llama_cpp import export_gguf, load

from test_decoding import greedy, reference_greedy


@pytest.fixture(scope="module")
def walk_through() -> Path:
    value = os.environ.get("NMST_WALKTHROUGH_DIR")
    if not value:
        pytest.skip("set NMST_WALKTHROUGH_DIR to the --out of a `python -m train.post_training` run (.ci/run runs it)")
    return Path(value)


def test_the_walk_throughs_model_decodes_its_head_in_llama_cpp(walk_through, tmp_path):
    model_dir = walk_through / "model"
    report = json.loads((walk_through / "report.json").read_text())
    prompts = json.loads((walk_through / "test_prompts.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    llm = load(export_gguf(model_dir, tmp_path / "model.gguf", dtype="f32"), n_ctx=256, verbose=False)
    t_half = nmst_fast.termination_bound(report["eps"])
    compared = 0
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == ids
        expected, margin = reference_greedy(model_dir, ids, 100)
        got = greedy(llm, ids, 100)
        assert len(got) <= t_half and got[-1] == tokenizer.eos_token_id
        if margin >= 5e-3:  # llama.cpp's float32 logits differ from torch's: a near tie may flip
            assert got == expected, prompt
            compared += 1
    assert compared >= len(prompts) // 2
