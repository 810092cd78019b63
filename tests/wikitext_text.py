"""Text for the tests that read WikiText: generated WikiText-shaped lines, and the real files where a path is given.

The fast tests need text with WikiText's shape, not its content: headings (`` = Title = ``), paragraphs of
tens to hundreds of words, WikiText's tokenization (`` @-@ ``, `` @,@ ``, `` , ``, `` . ``, ``<unk>``), blank
lines. :func:`generated_lines` writes such lines from a fixed seed, so no test depends on a file outside the
repository. The tests that check something on the real files (:func:`real_wikitext_dir`) read them from the
directory named by ``NMST_WIKITEXT_DIR`` (``valid.txt`` / ``test.txt`` or ``wiki.*.tokens``) and skip without it.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

WIKITEXT_ENV = "NMST_WIKITEXT_DIR"

_ONSETS = ("b", "br", "c", "ch", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "th", "v", "w")
_NUCLEI = ("a", "e", "i", "o", "u", "ea", "ou", "ai")
_CODAS = ("", "", "n", "r", "s", "t", "l", "nd", "rk")
_FUNCTION_WORDS = ("the", "of", "and", "in", "to", "a", "was", "is", "for", "on", "as", "with", "by", "his", "her",
                   "at", "that", "from", "it", "were")
_SPLIT_SEEDS = {"train": 0, "valid": 1, "test": 2}


def _vocabulary(rng: random.Random, size: int) -> list[str]:
    words = set()
    while len(words) < size:
        words.add("".join(rng.choice(part) for part in (_ONSETS, _NUCLEI, _CODAS) * rng.randint(1, 2)))
    return sorted(words)


def _sentence(rng: random.Random, content: list[str]) -> list[str]:
    words = []
    for _ in range(rng.randint(6, 24)):
        roll = rng.random()
        if roll < 0.40:
            words.append(rng.choice(_FUNCTION_WORDS))
        elif roll < 0.93:
            word = rng.choice(content)
            words.append(word.capitalize() if rng.random() < 0.1 else word)
        elif roll < 0.96:
            words.append("<unk>")
        else:
            words += [str(rng.randint(1, 99)), rng.choice(("@-@", "@,@", "@.@")), str(rng.randint(100, 999))]
        if rng.random() < 0.08:
            words.append(",")
    words[0] = words[0].capitalize()
    return words + ["."]


def generated_lines(split: str, count: int) -> list[str]:
    """The first ``count`` non-empty lines of a generated WikiText-shaped split (``train``, ``valid`` or ``test``),
    stripped: an article is a heading (``= Name Name =``), then 2-4 paragraphs of 3-12 sentences, then a
    subheading (``= = Name = =``) and more paragraphs. The same arguments give the same lines."""
    rng = random.Random(f"wikitext-shaped/{_SPLIT_SEEDS[split]}")
    content = _vocabulary(random.Random("wikitext-shaped/vocabulary"), 600)
    lines: list[str] = []
    while len(lines) < count:
        title = " ".join(rng.choice(content).capitalize() for _ in range(rng.randint(1, 3)))
        lines.append(f"= {title} =")
        for section in range(rng.randint(1, 3)):
            if section:
                lines.append(f"= = {rng.choice(content).capitalize()} = =")
            for _ in range(rng.randint(2, 4)):
                lines.append(" ".join(w for _ in range(rng.randint(3, 12)) for w in _sentence(rng, content)))
    return lines[:count]


def real_wikitext_dir() -> Path:
    """The real WikiText-2 directory named by ``NMST_WIKITEXT_DIR``; the calling test skips without it."""
    value = os.environ.get(WIKITEXT_ENV)
    if not value:
        pytest.skip(f"needs the real WikiText-2 valid/test files: set {WIKITEXT_ENV} to their directory "
                    f"(.ci/run sets it to ../shared/data/wikitext-2)")
    path = Path(value)
    if not path.is_dir():
        raise FileNotFoundError(f"{WIKITEXT_ENV}={value!r} is not a directory")
    return path
