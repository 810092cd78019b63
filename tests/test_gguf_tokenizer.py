"""tools/gguf_tokenizer.py: a Hugging Face tokenizer rebuilt from llama.cpp's vocabulary-only GGUF files (in
llama-cpp-python's sdist, which .ci/run downloads and names in NMST_LLAMA_CPP_SDIST), run as a user runs it (the
command in a subprocess), read back by the project's tokenizer loader, and checked on llama.cpp's own test strings
and ids (``ggml-vocab-NAME.gguf.inp`` / ``.out`` beside each file)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from nmst_fast.data.bpe import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "gguf_tokenizer.py"
SDIST = os.environ.get("NMST_LLAMA_CPP_SDIST")
SEPARATOR = "\n__ggml_vocab_test__\n"

pytestmark = pytest.mark.skipif(not SDIST, reason="NMST_LLAMA_CPP_SDIST (llama-cpp-python's sdist) is not set")


def _run(name: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), SDIST, name, str(out)], capture_output=True, text=True)


def _llama_cpp_cases(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test strings for ggml-vocab-NAME.gguf and the ids its tokenizer gives them (no bos)."""
    files = {}
    with tarfile.open(SDIST) as archive:
        for member in archive.getmembers():
            for suffix in ("inp", "out"):
                if member.name.endswith(f"vendor/llama.cpp/models/ggml-vocab-{name}.gguf.{suffix}"):
                    files[suffix] = archive.extractfile(member).read().decode("utf-8")
    texts = files["inp"].split(SEPARATOR)
    if files["inp"].endswith(SEPARATOR.lstrip("\n")):  # the file ends with a separator: no case after it
        texts[-1] = texts[-1].removesuffix(SEPARATOR.lstrip("\n"))
        texts = texts if texts[-1] else texts[:-1]
    ids = [[int(i) for i in line.split()] for line in files["out"].splitlines()]
    assert len(texts) == len(ids) > 20
    return list(zip(texts, ids))


@pytest.mark.parametrize("name, size, eos", [
    ("gpt-2", 50257, "<|endoftext|>"),
    pytest.param("command-r", 256000, "<|END_OF_TURN_TOKEN|>", marks=pytest.mark.slow),  # 30 s: 256000 tokens
])
def test_the_tokenizer_gives_llama_cpps_ids(tmp_path, name, size, eos):
    done = _run(name, tmp_path / "tok")
    assert done.returncode == 0, done.stderr
    tok = load_tokenizer(tmp_path / "tok")
    assert len(tok) == size and tok.eos_token == eos
    for text, ids in _llama_cpp_cases(name):
        assert tok(text, add_special_tokens=False)["input_ids"] == ids, text
        assert tok.decode(ids) == text


@pytest.mark.parametrize("name, message", [
    ("llama-spm", "only byte-level BPE"),  # SentencePiece, not byte-level BPE
    pytest.param("qwen2", "tokenizer.ggml.pre 'qwen2'",  # byte-level BPE under a pre-tokenizer not rebuilt
                 marks=pytest.mark.slow),  # 20 s: reading its 151936 tokens
])
def test_a_vocabulary_it_does_not_rebuild_is_refused(tmp_path, name, message):
    done = _run(name, tmp_path / "tok")
    assert done.returncode != 0 and message in done.stderr
    assert not (tmp_path / "tok").exists()
