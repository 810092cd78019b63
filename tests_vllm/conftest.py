"""Tests of the vLLM integration against vLLM's real engine (CPU build), in their own virtualenv:
``.ci/run`` builds it; the main suite (``python -m pytest tests``) does not collect this folder.

One engine (offline ``LLM``) serves the whole session; ``test_server.py`` starts ``vllm serve``.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import importlib.util  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# The main suite's shared helpers (tests/helpers.py: the G-test) serve these tests too.
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))

if importlib.util.find_spec("vllm") is None:  # a virtualenv without vLLM: nothing here to run
    collect_ignore_glob = ["test_*.py"]

from hf_models import load_saved, save_served  # noqa: E402

EPS = 0.05  # t½ = 14
# max_num_batched_tokens=128: prefills of long prompts and of many requests at once run in chunks, so
# partial-prefill rows pass through the processor. vLLM-CPU 0.32 then fails on requests with their own
# seed ("CPU Generator does not use offset", when it rewinds the generator of a partial-prefill row):
# the tests draw from the engine's seed instead.
ENGINE_ARGS = dict(dtype="float32", gpu_memory_utilization=0.1, max_model_len=1024, enforce_eager=True, seed=0,
                   max_num_batched_tokens=128, max_num_seqs=128)


@pytest.fixture(scope="session")
def nmst_dir(tmp_path_factory) -> str:
    """The tiny Llama saved after apply_nmst(head="nmst", eps=0.05): the head is model-wide."""
    return save_served(str(tmp_path_factory.mktemp("nmst_model")), head="nmst", eps=EPS)


@pytest.fixture(scope="session")
def plain_dir(tmp_path_factory) -> str:
    """The same weights saved without an NMST entry."""
    return save_served(str(tmp_path_factory.mktemp("plain_model")), head=None)


@pytest.fixture(scope="session")
def reference(plain_dir):
    """The HF model (no NMST entry in its config: any head can be asked of HFDecoder)."""
    return load_saved(plain_dir)


@pytest.fixture(scope="session")
def llm(nmst_dir):
    """vLLM's offline engine on the NMST model; the processor comes in as the installed plugin."""
    from vllm import LLM

    engine = LLM(nmst_dir, **ENGINE_ARGS)
    yield engine
    del engine


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    """16 prompts of 3 to 18 random byte tokens."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for length in range(3, 19)]
