"""WikiText word-level data as in the paper: one line = one sequence, a 10-token context.

Every line of a tokens file (headings and blank lines included) becomes
``<bos> <cpad>… w_1 … w_n <eos>``: lines shorter than the context are left-padded
with ``<cpad>`` so every sequence has a full context. The model reads
``seq[:-1]`` and predicts ``seq[1:]``; the first generated position (t = 1) is the
one predicting the token after the context, and the context positions get
t = 0 (p(eos) = 0 there for the NMST/ST heads).

Files are read from a local directory holding ``wiki.{split}.tokens`` or
``{split}.txt`` (split: train / valid / test). :func:`hub_lines` reads the same
splits through the ``datasets`` library instead, when it is installed and online.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch
from torch.utils.data import Dataset

CONTEXT_LENGTH = 10
# eos last: the paper's models put it at the end of the vocabulary.
SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<cpad>", "<eos>")
_SPLIT_ALIASES = {"train": ("train",), "valid": ("valid", "validation"), "validation": ("valid", "validation"),
                  "test": ("test",)}


class Vocabulary:
    """Word ↔ id mapping built from a training split; specials come last, eos the very last."""

    def __init__(self, words: Sequence[str]) -> None:
        self.words = list(words)
        self.ids = {w: i for i, w in enumerate(self.words)}
        missing = [t for t in SPECIAL_TOKENS if t not in self.ids]
        if missing:
            raise ValueError(f"vocabulary lacks the special tokens {missing}")

    @classmethod
    def from_lines(cls, lines: Iterable[str]) -> "Vocabulary":
        words: dict[str, None] = {}
        for line in lines:
            for w in line.split():
                if w not in SPECIAL_TOKENS:
                    words.setdefault(w, None)
        return cls(list(words) + list(SPECIAL_TOKENS))

    def __len__(self) -> int:
        return len(self.words)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self.words == other.words

    def id(self, word: str) -> int:
        return self.ids.get(word, self.ids["<unk>"])

    @property
    def eos(self) -> int:
        return self.ids["<eos>"]

    @property
    def pad(self) -> int:
        return self.ids["<pad>"]

    def encode(self, words: Iterable[str]) -> list[int]:
        return [self.id(w) for w in words]

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [self.words[i] for i in ids]

    def to_json(self) -> str:
        return json.dumps(self.words)

    @classmethod
    def from_json(cls, text: str) -> "Vocabulary":
        return cls(json.loads(text))


def find_split_file(data_dir: str | Path, split: str) -> Path:
    """The file of ``split`` in ``data_dir``: ``wiki.{split}.tokens`` or ``{split}.txt``."""
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"data directory {str(root)!r} does not exist (expected WikiText files there)")
    if split not in _SPLIT_ALIASES:
        raise ValueError(f"split must be one of {tuple(_SPLIT_ALIASES)}, got {split!r}")
    names = [f"wiki.{s}.tokens" for s in _SPLIT_ALIASES[split]] + [f"{s}.txt" for s in _SPLIT_ALIASES[split]]
    for name in names:
        if (root / name).is_file():
            return root / name
    raise FileNotFoundError(f"no {split!r} split in {str(root)!r}: looked for {', '.join(names)}")


HUB_CONFIGS = {"wikitext-2": "wikitext-2-v1", "wikitext-103": "wikitext-103-v1"}


def hub_lines(name: str, split: str) -> list[str]:
    """Lines of a WikiText split from the Hugging Face hub via ``datasets`` (cached after one download).

    Raises RuntimeError with what to do instead when ``datasets`` is missing or the hub is
    unreachable (this library never needs the network: a local directory works everywhere).
    """
    if name not in HUB_CONFIGS:
        raise ValueError(f"name must be one of {tuple(HUB_CONFIGS)}, got {name!r}")
    hub_split = {"valid": "validation"}.get(split, split)
    if hub_split not in ("train", "validation", "test"):
        raise ValueError(f"split must be train, valid or test, got {split!r}")
    try:
        import datasets
    except ImportError:
        raise RuntimeError(f"{name} is not available locally and the `datasets` package is not installed: "
                           "pass a directory of WikiText files (--data-dir), or `pip install datasets` "
                           "on a machine that can reach the Hugging Face hub") from None
    try:
        rows = datasets.load_dataset("wikitext", HUB_CONFIGS[name], split=hub_split)
    except Exception as err:  # the hub's errors vary by version: offline, DNS, HTTP
        raise RuntimeError(f"could not load {name} ({hub_split}) from the Hugging Face hub ({type(err).__name__}: "
                           f"{err}); pass a directory of WikiText files (--data-dir) instead") from None
    # The hub's rows keep each line's trailing newline; the tokens files' lines do not.
    return [row["text"].rstrip("\n") for row in rows]


def read_lines(path: str | Path) -> list[str]:
    """Every line of a tokens file, blank lines included (the paper keeps them)."""
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def encode_lines(lines: Iterable[str], vocab: Vocabulary, context_length: int = CONTEXT_LENGTH) -> list[list[int]]:
    """``<bos> <cpad>×pad w_1 … w_n <eos>`` ids for every line (pad = context_length − n, if positive)."""
    cpad = vocab.ids["<cpad>"]
    bos, eos = vocab.ids["<bos>"], vocab.eos
    out = []
    for line in lines:
        ids = vocab.encode(line.split())
        out.append([bos] + [cpad] * max(0, context_length - len(ids)) + ids + [eos])
    return out


class LMSequences(Dataset):
    """Encoded sequences, one id list each (``<bos> <cpad>… words… <eos>``); :func:`collate`
    forms input = seq[:-1] and target = seq[1:]."""

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, idx: int) -> list[int]:
        return self.sequences[idx]


@dataclass
class Batch:
    """A padded batch. inputs/targets/steps: (B, T) int64; padded targets are ``ignore_index``."""

    inputs: torch.Tensor
    targets: torch.Tensor
    steps: torch.Tensor
    lengths: torch.Tensor  # (B,) number of real target positions


def collate(sequences: list[list[int]], *, pad_id: int, context_length: int = CONTEXT_LENGTH,
            ignore_index: int = -100) -> Batch:
    """Right-pad a list of encoded sequences into a :class:`Batch`.

    Target position i predicts seq[i + 1]; its step is t = max(0, i + 1 − context_length):
    t = 1 at the first token after the context, t = 0 on every context position (p(eos) = 0
    there for NMST and ST, the library's context convention).
    """
    T = max(len(s) for s in sequences) - 1
    B = len(sequences)
    inputs = torch.full((B, T), pad_id, dtype=torch.long)
    targets = torch.full((B, T), ignore_index, dtype=torch.long)
    lengths = torch.empty(B, dtype=torch.long)
    for b, seq in enumerate(sequences):
        n = len(seq) - 1
        inputs[b, :n] = torch.tensor(seq[:-1])
        targets[b, :n] = torch.tensor(seq[1:])
        lengths[b] = n
    steps = (torch.arange(T) + 1 - context_length).clamp(min=0).expand(B, T).contiguous()
    return Batch(inputs, targets, steps, lengths)


def load_wikitext_split(data_dir: str | Path, split: str, vocab: Optional[Vocabulary] = None,
                        context_length: int = CONTEXT_LENGTH) -> tuple[LMSequences, Vocabulary]:
    """Encode one split; builds the vocabulary from it when ``vocab`` is None (a training split)."""
    lines = read_lines(find_split_file(data_dir, split))
    if vocab is None:
        vocab = Vocabulary.from_lines(lines)
    return LMSequences(encode_lines(lines, vocab, context_length)), vocab
