"""A built-in corpus that needs no download, built so the three heads visibly differ.

Every line is a 10-word context followed by a continuation that repeats one
three-word motif r times, r ≥ 1, and ends there. So lines are prefixes of one
another ("a b c" / "a b c a b c" — the paper's Remark 1: "I am a boy" vs "I am a
boy, and you are a girl"), and the data's p(eos) at continuation step t is
non-monotone: 0 inside a motif, the family's stop probability q at its end.

* ST's p(eos) can only grow with t, so after the first motif it must waste mass on
  eos inside every later motif: its perplexity is worse than NMST's and VA's.
* q < 1/2, so the most probable next token at a motif end is always the motif
  again: greedy (and nucleus with p ≤ 1 − q) decoding from a model that learns the
  data never stops under VA, while NMST and ST stop by their bound.
"""

from __future__ import annotations

import random

CONTEXT_WORDS = 10
_FAMILIES = (
    # (context vocabulary, motif, stop probability at each motif end)
    (("river", "stone", "reed", "mist", "bank"), ("the", "water", "flows"), 0.30),
    (("forge", "iron", "coal", "anvil", "spark"), ("hammer", "strikes", "again"), 0.40),
    (("orchard", "bloom", "bee", "branch", "leaf"), ("bees", "hum", "softly"), 0.25),
    (("harbor", "sail", "rope", "gull", "tide"), ("waves", "meet", "ships"), 0.35),
    (("market", "coin", "stall", "crowd", "bread"), ("people", "buy", "bread"), 0.45),
    (("tower", "bell", "clock", "stair", "hour"), ("bells", "ring", "out"), 0.20),
)
MAX_REPEATS = 16


def stop_probabilities() -> dict[tuple[str, ...], float]:
    """Each family's motif → its probability of ending at a motif end."""
    return {motif: q for _, motif, q in _FAMILIES}


def prefix_corpus(num_lines: int, seed: int) -> list[str]:
    """``num_lines`` lines of the corpus (whitespace-separated words), reproducible from ``seed``."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        context_words, motif, stop = _FAMILIES[rng.randrange(len(_FAMILIES))]
        context = [rng.choice(context_words) for _ in range(CONTEXT_WORDS)]
        repeats = 1
        while repeats < MAX_REPEATS and rng.random() >= stop:
            repeats += 1
        lines.append(" ".join(context + list(motif) * repeats))
    return lines


def builtin_splits(seed: int = 0, sizes: tuple[int, int, int] = (3000, 300, 300)) -> dict[str, list[str]]:
    """train / valid / test lines drawn independently (different seeds) from the same process."""
    return {split: prefix_corpus(n, seed * 1000 + i)
            for i, (split, n) in enumerate(zip(("train", "valid", "test"), sizes))}
