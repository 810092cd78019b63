"""vLLM and the NMST checkpoint type: what ``save_pretrained`` writes is served with no flag where nmst-fast is
installed, and refused where its plugin does not run; the walk-through's last step (``vllm serve OUT/model`` of what
``python -m train.post_training`` wrote) decodes the head."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import torch
from server import vllm_server

from nmst_fast import nmst_log_probs

from docs_commands import WALK_THROUGH, commands


def test_without_the_plugin_vllm_refuses_the_checkpoint(nmst_dir, plain_dir):
    """``VLLM_PLUGINS`` naming another plugin keeps nmst-fast's general plugin from running: vLLM knows neither the
    type nor the architecture and refuses the directory (the plain model still loads there)."""
    code = ("import sys\nfrom vllm import LLM\n"
            "LLM(sys.argv[1], dtype='float32', gpu_memory_utilization=0.1, max_model_len=256, enforce_eager=True)\n"
            "print('loaded')")
    env = dict(os.environ, VLLM_PLUGINS="lora_filesystem_resolver", VLLM_CPU_KVCACHE_SPACE="1")
    refused = subprocess.run([sys.executable, "-c", code, nmst_dir], capture_output=True, text=True, timeout=600,
                             env=env)
    assert refused.returncode != 0 and "nmst" in refused.stdout + refused.stderr, refused.stderr[-3000:]
    assert "loaded" not in refused.stdout


@pytest.fixture(scope="module")
def walk_through() -> tuple[Path, dict]:
    value = os.environ.get("NMST_WALKTHROUGH_DIR")
    if not value:
        pytest.skip("set NMST_WALKTHROUGH_DIR to the --out of a `python -m train.post_training` run (.ci/run runs it)")
    out = Path(value)
    return out, json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("command", commands("vllm"))
def test_vllm_serves_the_walk_throughs_model_and_decodes_its_head(command, walk_through, tmp_path):
    """Each ``vllm serve`` command the README and the documentation show (``runs/walk-through`` standing for the
    walk-through's output; the test machine's flags and processed log-probs added): every test prompt's greedy
    completion through the server ends with eos by t½, and its log-probs are the head's (the project's own float64
    reference on the saved model, t = 1 at the first completion token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, report = walk_through
    model_dir = out / "model"
    assert report["serve"] == f"vllm serve {report['model_dir']} --host 127.0.0.1 --port 8000"
    assert Path(report["model_dir"]).name == "model" and (model_dir / "config.json").is_file()
    words = [str(out) + w[len(WALK_THROUGH):] if w.startswith(WALK_THROUGH) else w for w in shlex.split(command)]
    assert words[:3] == ["vllm", "serve", str(model_dir)], words
    flags = words[3:]
    for name in ("--host", "--port"):  # the test's own server address
        if name in flags:
            del flags[flags.index(name):flags.index(name) + 2]
    prompts = json.loads((out / "test_prompts.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    settings = model.config.nmst
    eos, t_half = tokenizer.eos_token_id, report["termination_bound"]
    with vllm_server(model_dir, tmp_path / "serve.log", *flags, "--logprobs-mode", "processed_logprobs",
                     max_model_len=None) as url:
        for prompt in prompts:
            r = requests.post(f"{url}/v1/completions", timeout=120,
                              json={"model": str(model_dir), "prompt": prompt, "temperature": 0.0, "max_tokens": 100,
                                    "logprobs": 0, "return_token_ids": True})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            tokens = choice["token_ids"]
            assert choice["finish_reason"] == "stop" and tokens[-1] == eos and len(tokens) <= t_half, (prompt, tokens)
            ids = tokenizer(prompt)["input_ids"]
            with torch.no_grad():
                out = model(input_ids=torch.tensor([ids + tokens[:-1]]), nmst_logits=False)
            logits = out.logits[:, len(ids) - 1:].double()
            steps = torch.arange(1, len(tokens) + 1)[None]
            log_p = nmst_log_probs(logits, eos_index=eos, eps=settings["eps"], head=settings["head"], steps=steps)[0]
            want = log_p.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
            got = torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64)
            torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
