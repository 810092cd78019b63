"""Tests of the llama.cpp integration against llama-cpp-python (built from source), in their own virtualenv:
``.ci/run`` builds it (tools/environments.py install llama_cpp); the main suite does not collect this folder.

Models: tiny random models of each exported family (tests/hf_models.py), saved with a head, exported with
``nmst-fast export-gguf``'s function, opened in llama.cpp."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))

if importlib.util.find_spec("llama_cpp") is None:  # a virtualenv without llama-cpp-python: nothing here to run
    collect_ignore_glob = ["test_*.py"]

from hf_models import bpe_tokenizer, late_eos_model  # noqa: E402

EPS = 0.05  # t½ = 14


@pytest.fixture(scope="session")
def tokenizer():
    return bpe_tokenizer()


def export(directory: Path, family: str, tokenizer, *, head: str = "nmst", eps: float = EPS, seed: int = 0,
           dtype: str = "f32") -> Path:
    """A tiny ``family`` model over ``tokenizer`` with the head, saved in ``directory`` and exported beside it."""
    from nmst_fast.integrations.hf import apply_nmst
    from nmst_fast.integrations.llama_cpp import export_gguf

    if not (directory / "config.json").exists():
        # eos about 6 below the other logits: NMST greedy runs several tokens, then stops by t½
        model = late_eos_model(family, tokenizer, seed=seed, eos_offset=-6.0 if head != "st" else 6.0)
        apply_nmst(model, head=head, eps=eps)
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return export_gguf(directory, directory / f"model-{dtype}.gguf", dtype=dtype)


@pytest.fixture(scope="session")
def exported(tmp_path_factory, tokenizer):
    """(family, head) -> (saved directory, f32 GGUF file), made once per session."""
    made = {}

    def get(family: str, head: str = "nmst", dtype: str = "f32", eps: float = EPS):
        key = (family, head, eps)
        if key not in made:
            made[key] = tmp_path_factory.mktemp(f"{family}-{head}")
        directory = made[key]
        return directory, export(directory, family, tokenizer, head=head, eps=eps, dtype=dtype)

    return get
