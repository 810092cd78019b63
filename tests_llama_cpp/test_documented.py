"""The tokenizers tokenize in llama.cpp as in Hugging Face, and the Python examples that import
nmst_fast.integrations.llama_cpp (README.md, docs/llama_cpp.md) run as written."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import export
from llama_cpp import Llama

from hf_models import bpe_tokenizer, llama3_style_tokenizer, sentencepiece_style_tokenizer
from wikitext_text import generated_lines

REPO = Path(__file__).resolve().parents[1]
TEXTS = [" " + line for line in generated_lines("test", 30)] + [
    "Hello world, it's 12345 ok", "  two  spaces\tand a tab\nnew line", "é€ ünïcödé and 日本語", "don't STOP'LL"]


@pytest.mark.parametrize("make, family", [(bpe_tokenizer, "gpt2"), (llama3_style_tokenizer, "llama"),
                                          (sentencepiece_style_tokenizer, "mistral")])
def test_llama_cpp_tokenizes_as_the_hugging_face_tokenizer(make, family, tmp_path):
    tokenizer = make()
    path = export(tmp_path, family, tokenizer)
    base = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama"}[family]
    llm = Llama(str(path), kv_overrides={"general.architecture": base}, vocab_only=True, verbose=False)
    for text in TEXTS:
        expected = tokenizer(text)["input_ids"]
        # special=True: llama.cpp then parses special tokens written in the text ("<unk>" in WikiText), as HF does
        assert llm.tokenize(text.encode(), add_bos=True, special=True) == expected, text


def test_the_documented_examples_run(tmp_path, tokenizer):
    """Each Python block that uses the integration runs in a fresh interpreter, in a directory whose
    my-model.gguf is a tiny exported model (tests/docs_commands.py: ``my-model`` is a model of the reader's)."""
    shutil.copy(export(tmp_path / "model", "llama", tokenizer, dtype="f16"), tmp_path / "my-model.gguf")
    blocks = [block for source in ("README.md", "docs/llama_cpp.md")
              for block in re.findall(r"```python\n(.*?)```", (REPO / source).read_text(), re.S)
              if "llama_cpp" in block]
    assert len(blocks) == 3
    for block in blocks:
        done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, (block, done.stderr[-3000:])
