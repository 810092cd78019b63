"""A Hugging Face tokenizer as llama.cpp reads it from a GGUF file (``tokenizer.ggml.*``).

Two kinds, read from the fast tokenizer's own description (``tokenizer.json``):

* **byte-level BPE** (GPT-2, Llama 3, Qwen2, the project's own BPE): llama.cpp's "gpt2" model with the vocabulary
  in its byte-level form, the merges, and the pre-tokenizer's name (``tokenizer.ggml.pre``), which selects
  llama.cpp's split regex. Only splits whose regex llama.cpp has are written: GPT-2's (the ``ByteLevel``
  pre-tokenizer's own), Llama 3's and Qwen2's; any other is refused, since llama.cpp would split text differently.
* **SentencePiece-style BPE** (byte fallback and "▁" for spaces: Llama 2, Mistral): llama.cpp's "llama" model,
  whose merge order is each token's score, highest first. A token made by the merge of rank r scores −(r + 1), so
  llama.cpp merges in the tokenizer's order; ``<0xNN>`` tokens are its byte tokens.

Special tokens added to the tokenizer are control tokens (llama.cpp does not split them out of plain text); other
added tokens are user-defined. Ids the tokenizer does not use, up to the model's vocabulary size, are written as
unused ``[PAD<id>]`` tokens (the embedding has those rows).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The split regexes of Llama 3's and Qwen2's tokenizer.json, and llama.cpp's name for each. llama.cpp's "llama-bpe"
# also looks a whole split word up before any merge (Llama 3's BPE has ignore_merges); its "gpt-2" and "qwen2" do not.
SPLITS = {
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": "llama-bpe",
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": "qwen2",
}
SPACE = "▁"


def write_vocabulary(writer: Any, directory: str | Path, vocab_size: int) -> str:
    """Write the tokenizer saved in ``directory`` into ``writer`` (a ``gguf.GGUFWriter``) with ``vocab_size``
    tokens; returns llama.cpp's tokenizer model ("gpt2" or "llama"). A tokenizer llama.cpp would not reproduce is
    refused with a ValueError naming what it has."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"the tokenizer in {directory} has no tokenizer.json (a fast tokenizer): the GGUF export "
                         "reads the tokenizer's description from it")
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model["type"] != "BPE":
        raise ValueError(f"the tokenizer in {directory} is a {model['type']} model: the GGUF export writes BPE "
                         "tokenizers (byte-level, as GPT-2 / Llama 3 / Qwen2, or SentencePiece-style with byte "
                         "fallback, as Llama 2 / Mistral)")
    ids = tokenizer.get_vocab()
    if max(ids.values()) >= vocab_size:
        raise ValueError(f"the tokenizer has ids up to {max(ids.values())}, beyond the model's vocabulary of "
                         f"{vocab_size}")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for text, i in ids.items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for i, added in tokenizer.added_tokens_decoder.items():
        types[i] = gguf.TokenType.CONTROL if added.special else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    if model.get("byte_fallback"):
        kind = "llama"
        _check_sentencepiece_style(spec, directory)
        scores = [0.0] * vocab_size
        for rank, merge in enumerate(merges):
            merged = merge.replace(" ", "", 1)
            if merged in ids and scores[ids[merged]] == 0.0:
                scores[ids[merged]] = -(rank + 1.0)
        for i, text in enumerate(tokens):
            if types[i] == gguf.TokenType.NORMAL and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                types[i] = gguf.TokenType.BYTE
        if tokenizer.unk_token_id is not None:
            types[tokenizer.unk_token_id] = gguf.TokenType.UNKNOWN
            writer.add_unk_token_id(tokenizer.unk_token_id)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_add_space_prefix(_prepends_space(spec))
        writer.add_token_scores(scores)
    else:
        kind = "gpt2"
        writer.add_tokenizer_model("gpt2")
        split = _byte_level_split(spec, directory)
        if bool(model.get("ignore_merges")) != (split == "llama-bpe"):
            raise ValueError(f"the tokenizer in {directory} has ignore_merges={bool(model.get('ignore_merges'))}, "
                             f"which llama.cpp's {split!r} split does not follow")
        writer.add_tokenizer_pre(split)
        writer.add_token_merges(merges)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    for name in ("bos", "eos", "pad"):
        token_id = getattr(tokenizer, f"{name}_token_id")
        if token_id is not None:
            getattr(writer, f"add_{name}_token_id")(token_id)
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    special = tokenizer("a")["input_ids"]
    writer.add_add_bos_token(len(special) > len(plain) and special[0] == tokenizer.bos_token_id)
    writer.add_add_eos_token(len(special) > len(plain) and special[-1] == tokenizer.eos_token_id)
    return kind


def _byte_level_split(spec: dict, directory: Any) -> str:
    """llama.cpp's name for a byte-level tokenizer's split, or a ValueError naming the split."""
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True) and not parts[0].get("add_prefix_space"):
        return "gpt-2"
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True) \
            and not parts[1].get("add_prefix_space") and parts[0].get("behavior") == "Isolated" \
            and not parts[0].get("invert"):
        name = SPLITS.get(parts[0].get("pattern", {}).get("Regex"))
        if name is not None:
            return name
    raise ValueError(f"the tokenizer in {directory} splits text with {json.dumps(pre)[:300]}: llama.cpp has no "
                     "split known to equal it (the export knows GPT-2's, Llama 3's and Qwen2's)")


def _check_sentencepiece_style(spec: dict, directory: Any) -> None:
    """A byte-fallback BPE must write spaces as "▁" (a normalizer's Replace or a Metaspace pre-tokenizer), as
    llama.cpp's SentencePiece tokenizer does."""
    text = json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer")], ensure_ascii=False)
    if SPACE not in text:
        raise ValueError(f"the byte-fallback tokenizer in {directory} does not write spaces as {SPACE!r}: llama.cpp's "
                         "SentencePiece tokenizer would split its text differently")


def _prepends_space(spec: dict) -> bool:
    """Whether the tokenizer puts "▁" before the text (a Prepend normalizer, or Metaspace's prepend scheme)."""
    def walk(node: Any):
        if isinstance(node, dict):
            yield node
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    for node in walk([spec.get("normalizer"), spec.get("pre_tokenizer")]):
        if node.get("type") == "Prepend" and node.get("prepend") == SPACE:
            return True
        if node.get("type") == "Metaspace" and node.get("prepend_scheme", "always") in ("always", "first") \
                and node.get("add_prefix_space", True):
            return True
    return False
