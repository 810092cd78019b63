"""GPT-2's tokenizer files (vocab.json + merges.txt, the layout ``GPT2TokenizerFast.from_pretrained`` reads) rebuilt
from the BPE ranks file that the openai-whisper package ships (``whisper/assets/gpt2.tiktoken``), for machines that
reach a package registry but no model hub:

    pip download --no-deps --no-binary :all: -d DIR openai-whisper==20250625
    python tools/gpt2_tokenizer.py DIR/openai_whisper-20250625.tar.gz OUT_DIR

The ranks file lists GPT-2's 50256 byte sequences with their ids (base64 bytes, then the id); id 50256 is
``<|endoftext|>``. Each id's merge is recovered by running byte-level BPE on its own bytes with only the lower ranks
allowed: the last two parts left are the pair GPT-2's merges.txt lists for it. The result tokenizes as GPT-2 does
(the test checks well-known ids and round trips).
"""

from __future__ import annotations

import argparse
import base64
import json
import tarfile
from pathlib import Path

ASSET = "whisper/assets/gpt2.tiktoken"
EOS = "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 byte values to printable characters (the text form of vocab.json and merges.txt)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def read_ranks(text: str) -> dict[bytes, int]:
    """The ranks file's lines ``<base64 bytes> <id>`` as {bytes: id}; ValueError on a malformed line."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"ranks file line {number}: expected '<base64> <id>', got {line[:60]!r}")
        ranks[base64.b64decode(parts[0])] = int(parts[1])
    return ranks


def merge_of(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The pair of parts whose merge makes ``token``: byte-level BPE on its bytes with the ranks below its own."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while True:
        best, at = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < limit and (best is None or rank < best):
                best, at = rank, i
        if best is None:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} (id {limit}) is not a merge of two lower-ranked tokens")
    return parts[0], parts[1]


def tokenizer_files(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[str]]:
    """vocab.json's {text: id} (with ``<|endoftext|>`` after the ranks) and merges.txt's lines, in id order."""
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("the ranks are not the ids 0..n-1")
    text = bytes_to_unicode()

    def spelled(b: bytes) -> str:
        return "".join(text[x] for x in b)

    vocab = {spelled(token): rank for token, rank in ranks.items()}
    vocab[EOS] = len(ranks)
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            left, right = merge_of(token, ranks)
            merges.append(f"{spelled(left)} {spelled(right)}")
    return vocab, merges


def write_tokenizer(ranks: dict[bytes, int], out_dir: Path) -> None:
    """vocab.json and merges.txt (GPT-2's layout) in ``out_dir``."""
    vocab, merges = tokenizer_files(ranks)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")


def ranks_from_sdist(sdist: Path) -> dict[bytes, int]:
    """The ranks of ``whisper/assets/gpt2.tiktoken`` inside openai-whisper's source archive."""
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            if member.name.endswith(ASSET):
                return read_ranks(archive.extractfile(member).read().decode("ascii"))
    raise FileNotFoundError(f"{str(sdist)!r} holds no {ASSET}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path, help="openai-whisper's sdist (.tar.gz), or a gpt2.tiktoken file")
    p.add_argument("out_dir", type=Path, help="where vocab.json and merges.txt go")
    args = p.parse_args(argv)
    if args.source.name.endswith(".tiktoken"):
        ranks = read_ranks(args.source.read_text(encoding="ascii"))
    else:
        ranks = ranks_from_sdist(args.source)
    write_tokenizer(ranks, args.out_dir)
    print(f"{args.out_dir}: {len(ranks) + 1} tokens")


if __name__ == "__main__":
    main()
