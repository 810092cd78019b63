"""WikiText with GPT-2 BPE for GPT-2 fine-tuning (the paper's WikiText-103 setup).

Each non-empty line is stripped and tokenized with the GPT-2 tokenizer (read from local files)
after one leading space, as GPT-2 sees a word inside running text (the paper's preprocessing:
strip, then a prefix space), and gets eos appended — WikiText's trailing space would otherwise put a
bare-space token before every eos; sequences of 11 to 1024 tokens are kept (the first 10 tokens are the
context, so at least one token is generated; longer lines are dropped rather than cut,
which would lose their eos). Batches are bucketed by length with at most ``max_tokens``
tokens (rows × longest row) per batch, so padding stays small and memory is bounded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

MIN_TOKENS = 11
MAX_TOKENS = 1024


def load_gpt2_tokenizer(path: str | Path):
    """A GPT-2 tokenizer from a local directory (``from_pretrained`` files, or vocab.json + merges.txt)."""
    from transformers import GPT2TokenizerFast

    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"tokenizer directory {str(root)!r} does not exist")
    has_files = (root / "tokenizer.json").is_file() or (
        (root / "vocab.json").is_file() and (root / "merges.txt").is_file())
    if not has_files:
        raise FileNotFoundError(f"no GPT-2 tokenizer in {str(root)!r}: expected tokenizer.json or "
                                "vocab.json + merges.txt")
    return GPT2TokenizerFast.from_pretrained(root)  # reads either layout, across transformers versions


def load_tokenizer(path: str | Path):
    """Any HF tokenizer from a local directory: ``from_pretrained`` files (tokenizer.json or a
    tokenizer_config.json), or GPT-2's vocab.json + merges.txt."""
    from transformers import AutoTokenizer

    root = Path(path)
    if (root / "tokenizer.json").is_file() or (root / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(root)
    return load_gpt2_tokenizer(root)


EOS_TOKEN = "<|endoftext|>"


def train_byte_level_bpe(lines: Iterable[str], *, vocab_size: int):
    """A byte-level BPE (GPT-2's scheme) trained on ``lines`` as :func:`encode_bpe_lines` feeds them
    (" " + stripped line), with ``<|endoftext|>`` as eos: a tokenizer for a corpus that comes without one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator((" " + line.strip() for line in lines if line.strip()), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                   pad_token=EOS_TOKEN)


def encode_bpe_lines(lines: Iterable[str], tokenizer, *, min_tokens: int = MIN_TOKENS,
                     max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Token ids + eos of every non-empty line whose length (eos included) is in [min_tokens, max_tokens].

    A line is tokenized as ``" " + line.strip()`` (module docstring)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos token")
    texts = [" " + line.strip() for line in lines if line.strip()]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return [seq + [eos] for seq in ids if min_tokens <= len(seq) + 1 <= max_tokens]


def bucket_batches(lengths: list[int], *, max_tokens: int = MAX_TOKENS, seed: int = 0,
                   shuffle: bool = True) -> list[list[int]]:
    """Index batches of similar length with rows × longest row <= ``max_tokens``.

    Sequences are sorted by length and cut greedily into batches; the batch order is then
    shuffled with ``seed`` (a sequence longer than ``max_tokens`` would get a batch of its own).
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches, current, longest = [], [], 0
    for i in order:
        new_longest = max(longest, lengths[i])
        if current and new_longest * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, new_longest = [], lengths[i]
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    if shuffle:
        random.Random(seed).shuffle(batches)
    return batches


@dataclass
class BPEBatch:
    input_ids: torch.Tensor  # (B, T), padded with eos
    attention_mask: torch.Tensor  # (B, T) 1 on real tokens
    labels: torch.Tensor  # (B, T) = input_ids with -100 on padding (HF convention: shifted inside)


def collate_bpe(sequences: list[list[int]], pad_id: int) -> BPEBatch:
    T = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), T), dtype=torch.long)
    for b, seq in enumerate(sequences):
        ids[b, : len(seq)] = torch.tensor(seq)
        mask[b, : len(seq)] = 1
    return BPEBatch(ids, mask, torch.where(mask.bool(), ids, -100))
