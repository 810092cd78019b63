"""Every shell command the README and the documentation show runs as written (by the rules of
``tests/docs_commands.py``: sizes shrink, the WikiText-2 directory and a hub task are local), so none drifts from
the code. The vLLM commands run in vLLM's environment (``tests_vllm/test_walk_through.py``)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from docs_commands import MY_MODEL, REPO, RULES, WALK_THROUGH, WIKITEXT, commands, documented_commands, small
from wikitext_text import WIKITEXT_ENV, generated_lines


def test_every_documented_command_has_a_rule_and_every_rule_a_command():
    documented = {command for _, command in documented_commands()}
    unruled = sorted(documented - set(RULES))
    assert not unruled, f"add a rule to tests/docs_commands.py for: {unruled}"
    stale = sorted(set(RULES) - documented)
    assert not stale, f"rules for commands no document shows any more: {stale}"
    assert {"run", "install", "ci", "vllm"} == set(RULES.values())


def test_the_test_commands_are_what_ci_runs():
    lines = [re.sub(r"^(\w+=\S+ )+", "", line.strip()) for line in (REPO / ".ci" / "run").read_text().splitlines()]
    for command in commands("ci"):
        assert any(line == command or line.startswith(command + " ") for line in lines), command


def _environment() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")


def _run(words: list[str], cwd: Path, timeout: int = 1200) -> subprocess.CompletedProcess:
    executable = shutil.which(words[0], path=os.pathsep.join([str(Path(sys.executable).parent),
                                                               os.environ.get("PATH", "")]))
    done = subprocess.run([executable or words[0], *words[1:]], cwd=cwd, env=_environment(), capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, (shlex.join(words), done.stdout[-2000:], done.stderr[-4000:])
    return done


def _with_local_data(words: list[str], cwd: Path) -> list[str]:
    """The WikiText-2 directory from NMST_WIKITEXT_DIR; a hub task swapped for a local one."""
    if WIKITEXT in words:
        directory = os.environ.get(WIKITEXT_ENV)
        if not directory:
            pytest.skip(f"{WIKITEXT} stands for the real WikiText-2 files: set {WIKITEXT_ENV} (.ci/run does)")
        words = [directory if w == WIKITEXT else w for w in words]
    if "--tasks" in words and words[words.index("--tasks") + 1] == "wikitext":
        from test_lm_eval import TASK, line_document, write_task

        include = write_task(cwd / "tasks", [line_document(line) for line in generated_lines("test", 4)])
        words[words.index("--tasks") + 1] = TASK
        words += ["--include_path", str(include)]
    return words


def save_my_model(directory: Path) -> None:
    """What ``my-model`` stands for: a tiny Llama over the project's byte-level BPE, saved with an NMST head."""
    import torch

    from nmst_fast.integrations.hf import apply_nmst

    from hf_models import bpe_tokenizer, tiny_llama

    tokenizer = bpe_tokenizer()
    model = apply_nmst(tiny_llama(tokenizer, seed=0, eos_offset=-4.0, dtype=torch.float32), head="nmst", eps=0.05)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


@pytest.fixture(scope="module")
def walk_through(tmp_path_factory) -> Path:
    """A scratch directory in which the walk-through command has run: ``runs/walk-through`` is its output."""
    cwd = tmp_path_factory.mktemp("docs")
    (command,) = [c for c in commands("run") if c.startswith("python -m train.post_training")]
    _run(small(command), cwd)
    report = json.loads((cwd / WALK_THROUGH / "report.json").read_text())
    assert report["greedy"]["terminated"] == 1.0
    return cwd


@pytest.mark.slow
@pytest.mark.parametrize("command", commands("run"))
def test_the_documented_command_runs(command, request, tmp_path):
    cwd = request.getfixturevalue("walk_through") if WALK_THROUGH in command else tmp_path
    if MY_MODEL in shlex.split(command):
        save_my_model(cwd / MY_MODEL)
    words = _with_local_data(small(command), cwd)
    done = _run(words, cwd)
    if command.startswith("nmst-fast export-plain"):
        assert "NOT the head's distribution" in done.stdout
        shutil.rmtree(cwd / WALK_THROUGH / "plain")  # the command writes a new directory: ready to run again


@pytest.mark.slow
@pytest.mark.parametrize("command", commands("install"))
def test_the_documented_install_resolves(command, tmp_path):
    """In a fresh virtualenv (the command's own, where it creates one), pip's --dry-run of each ``pip install``."""
    environment = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(environment)
    for part in command.split("&&"):
        words = shlex.split(part.strip())
        if words[:2] == ["pip", "install"]:
            words = [str(environment / "bin" / "python"), "-m", "pip", "install", "--dry-run", "-q", *words[2:]]
            done = subprocess.run(words, cwd=REPO, capture_output=True, text=True, timeout=1200)
            assert done.returncode == 0, (command, done.stderr[-4000:])


@pytest.mark.slow
def test_the_readme_python_examples_run(tmp_path):
    """The README's Python examples are complete programs: each runs as written in a fresh interpreter (the
    llama.cpp one in its own environment: tests_llama_cpp/test_documented.py)."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    blocks = [block for block in blocks if "llama_cpp" not in block]
    assert len(blocks) == 2
    for block in blocks:
        done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=_environment(), capture_output=True,
                              text=True, timeout=600, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, (block, done.stderr[-4000:])
