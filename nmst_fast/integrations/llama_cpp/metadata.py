"""The head in a GGUF file's metadata: the keys the exporter writes and the decoder reads back.

A GGUF file of an NMST model names its architecture ``nmst-<base>`` (``general.architecture``), which llama.cpp,
Ollama and LM Studio do not know: they refuse the file instead of decoding the base model's softmax. Every other key
is the base architecture's own (``llama.block_count``, …), so llama.cpp loads it once the architecture is overridden
back to the base (:mod:`nmst_fast.integrations.llama_cpp.decoding` does that). The head rides in ``nmst.*`` keys,
which llama.cpp ignores and llama-cpp-python shows in ``Llama.metadata`` (as strings, so ε is written as the shortest
decimal string that reads back as the same float: a float key would print rounded).
"""

from __future__ import annotations

from typing import Any, Mapping

from ...settings import HeadSettings

PREFIX = "nmst-"
ARCHITECTURE = "general.architecture"
VERSION = 1
# t counts 1 at the first generated token (the step after the prompt), as in every decoder of the library.
T_CONVENTION = "t = 1 at the first generated token"
KEYS = {
    "version": "nmst.version",
    "head": "nmst.head",
    "eps": "nmst.eps",
    "eos_token_id": "nmst.eos_token_id",
    "context_length": "nmst.context_length",
    "base_architecture": "nmst.base_architecture",
    "t": "nmst.t",
}


def nmst_architecture(base: str) -> str:
    """The ``general.architecture`` of an NMST file of the base architecture ``base`` (e.g. "nmst-llama")."""
    return PREFIX + base


def head_entries(settings: HeadSettings, base: str) -> dict[str, str]:
    """The ``nmst.*`` keys of a file, all strings (llama-cpp-python's ``Llama.metadata`` gives strings)."""
    entries = {
        KEYS["version"]: str(VERSION),
        KEYS["head"]: settings.head,
        KEYS["eps"]: repr(settings.eps),
        KEYS["eos_token_id"]: str(settings.eos_index),
        KEYS["base_architecture"]: base,
        KEYS["t"]: T_CONVENTION,
    }
    if settings.context_length is not None:
        entries[KEYS["context_length"]] = str(settings.context_length)
    return entries


def read_head(metadata: Mapping[str, Any], where: str = "the GGUF file") -> tuple[HeadSettings, str]:
    """The head and the base architecture a file's metadata records (``Llama.metadata``: strings). A file without
    them, or of another version, is refused with a ValueError saying what to do."""
    architecture = str(metadata.get(ARCHITECTURE, ""))
    if KEYS["head"] not in metadata or not architecture.startswith(PREFIX):
        raise ValueError(f"{where} carries no NMST head (general.architecture {architecture!r}, no nmst.head key): "
                         "write one with `nmst-fast export-gguf DIR OUT.gguf` from a saved NMST model")
    version = int(metadata.get(KEYS["version"], -1))
    if version != VERSION:
        raise ValueError(f"{where} records an NMST head of format version {version}; this nmst-fast reads version "
                         f"{VERSION}: export it again with this release's `nmst-fast export-gguf`")
    base = str(metadata[KEYS["base_architecture"]])
    if architecture != nmst_architecture(base):
        raise ValueError(f"{where}: general.architecture {architecture!r} does not match nmst.base_architecture "
                         f"{base!r}")
    context = metadata.get(KEYS["context_length"])
    settings = HeadSettings(head=str(metadata[KEYS["head"]]), eps=float(metadata[KEYS["eps"]]),
                            eos_token_id=int(metadata[KEYS["eos_token_id"]]),
                            context_length=None if context is None else int(context))
    return settings, base
