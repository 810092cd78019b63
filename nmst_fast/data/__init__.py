"""Datasets for the paper's experiments."""

from .wikitext import (
    CONTEXT_LENGTH,
    SPECIAL_TOKENS,
    LMSequences,
    Vocabulary,
    collate,
    encode_lines,
    find_split_file,
    hub_lines,
    load_wikitext_split,
    read_lines,
)

__all__ = ["CONTEXT_LENGTH", "SPECIAL_TOKENS", "LMSequences", "Vocabulary", "collate", "encode_lines",
           "find_split_file", "hub_lines", "load_wikitext_split", "read_lines"]
