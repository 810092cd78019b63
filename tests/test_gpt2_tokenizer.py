"""tools/gpt2_tokenizer.py: GPT-2's vocab.json + merges.txt rebuilt from a BPE ranks file, read back by the
project's GPT-2 tokenizer loader as a user runs it (the command in a subprocess)."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nmst_fast.data.bpe import load_gpt2_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "gpt2_tokenizer.py"


def _run(source: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), str(source), str(out)], capture_output=True, text=True)


def _ranks_file(path: Path, merged: list[bytes]) -> Path:
    """A ranks file: the 256 bytes (ids 0..255 in a shuffled order, as GPT-2's are not in byte order), then
    ``merged`` with the next ids."""
    order = list(range(128, 256)) + list(range(128))
    tokens = [bytes([b]) for b in order] + merged
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)), encoding="ascii")
    return path


def test_the_merges_are_recovered_and_tokenize_by_rank(tmp_path):
    # "he" before "ll"; "hell" = he + ll; "hello" = hell + o; " w" and " wo"; "lo" ranks after "hell", so
    # "hello" keeps the merge order (he, ll, hell, hello) rather than taking "lo" first.
    merged = [b"he", b"ll", b"hell", b"hello", b" w", b" wo", b"lo"]
    source = _ranks_file(tmp_path / "toy.tiktoken", merged)
    done = _run(source, tmp_path / "tok")
    assert done.returncode == 0, done.stderr
    merges = (tmp_path / "tok" / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert merges == ["#version: 0.2", "h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "l o"]
    tok = load_gpt2_tokenizer(tmp_path / "tok")
    assert len(tok) == 256 + len(merged) + 1
    assert tok.convert_tokens_to_ids("<|endoftext|>") == 256 + len(merged)
    byte_id = {b: 128 + b for b in range(128)}  # the order _ranks_file lists the bytes in
    ids = tok("hello wo hel", add_special_tokens=False)["input_ids"]
    assert ids == [256 + 3, 256 + 5, byte_id[ord(" ")], 256 + 0, byte_id[ord("l")]]
    text = "Byte-level: é ∑ 😀 and\ttabs"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_a_ranks_file_that_is_not_a_bpe_is_refused(tmp_path):
    # "abc" is not a merge of two lower-ranked tokens (neither "ab" nor "bc" is listed).
    source = _ranks_file(tmp_path / "bad.tiktoken", [b"abc"])
    done = _run(source, tmp_path / "tok")
    assert done.returncode != 0
    assert "is not a merge of two lower-ranked tokens" in done.stderr


@pytest.mark.skipif(not os.environ.get("NMST_WHISPER_SDIST"),
                    reason="NMST_WHISPER_SDIST (openai-whisper's sdist, which .ci/run downloads) is unset")
def test_gpt2s_own_ranks_give_gpt2s_ids(tmp_path):
    done = _run(Path(os.environ["NMST_WHISPER_SDIST"]), tmp_path / "gpt2")
    assert done.returncode == 0, done.stderr
    tok = load_gpt2_tokenizer(tmp_path / "gpt2")
    assert len(tok) == 50257 and tok.eos_token_id == 50256
    # Ids any GPT-2 user knows.
    assert tok("Hello world", add_special_tokens=False)["input_ids"] == [15496, 995]
    assert tok(" the", add_special_tokens=False)["input_ids"] == [262]
    assert tok("The", add_special_tokens=False)["input_ids"] == [464]
    text = (" = Valkyria Chronicles III = \n Senjō no Valkyria 3 : Unrecorded Chronicles "
            "( Japanese : 戦場のヴァルキュリア3 )")
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
