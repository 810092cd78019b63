"""``python -m train.post_training``: TRL SFT, one servable directory, lm-eval and greedy decoding, end to end on
the built-in corpus (a short run)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from train import post_training


@pytest.mark.slow
def test_the_walk_through_runs_and_its_numbers_are_the_heads(tmp_path):
    report = post_training.main(["--steps", "8", "--test-lines", "12", "--batch-size", "8", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert "lm-eval" in (tmp_path / "report.md").read_text()
    # lm-eval's log-likelihoods are the head's: the completions' perplexity equals the fused loss's.
    scores = report["lm_eval"]
    assert math.isclose(scores["completion_perplexity"], scores["completion_perplexity_fused_loss"], rel_tol=1e-5)
    # Greedy NMST ends with eos by t½ = 14 < max_length, trained or not.
    assert report["termination_bound"] == 14 and report["greedy"]["terminated"] == 1.0
    # One directory holds what from_pretrained, lm-eval and vLLM read.
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert model.config.nmst["head"] == "nmst" and model.config.nmst["eps"] == 0.05
    assert model.config.nmst["eos_token_id"] == tokenizer.eos_token_id == model.config.eos_token_id
    line = "river stone the water flows"
    assert tokenizer.decode(tokenizer(line)["input_ids"]) == line
    assert len(tokenizer(line)["input_ids"]) == 5  # a byte-level BPE in which each word is one token
    assert torch.isfinite(model(**tokenizer(line, return_tensors="pt")).logits).all()
