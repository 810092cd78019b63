"""The head in a GGUF file's metadata: the keys the exporter writes and the decoder reads back.

A GGUF file of an NMST model names its architecture ``nmst-<base>`` (``general.architecture``), which llama.cpp,
Ollama and LM Studio do not know: they refuse the file instead of decoding the base model's softmax. Every other key
is the base architecture's own (``llama.block_count``, …), so llama.cpp loads it once the architecture is overridden
back to the base (:mod:`nmst_fast.integrations.llama_cpp.decoding` does that). The head rides in ``nmst.*`` keys,
which llama.cpp ignores and llama-cpp-python shows in ``Llama.metadata`` (as strings, so ε is written as the shortest
decimal string that reads back as the same float: a float key would print rounded).
"""

from __future__ import annotations

import mmap
import os
import struct
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
    }
    if settings.context_length is not None:
        entries[KEYS["context_length"]] = str(settings.context_length)
    entries[KEYS["t"]] = T_CONVENTION  # last: a reader has every key of the head once it reads this one
    return entries


# GGUF value types (gguf.GGUFValueType) and the struct format of each fixed-size one.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_file_keys(path: str | os.PathLike) -> dict[str, Any]:
    """The ``general.architecture`` and ``nmst.*`` keys of a GGUF file, read from its header alone.

    The exporter writes the head's keys before the tokenizer's arrays, and ``nmst.t`` last of them: reading stops
    there, so a file of any vocabulary opens in about a millisecond (``gguf.GGUFReader`` parses every token string
    first: seconds at V = 151936). A file written otherwise is read through to its last key. A file that is not
    GGUF gets a ValueError."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, = struct.unpack_from("<I", data, 4)
        if version < 2:
            raise ValueError(f"{path} is a GGUF file of version {version}; this reader takes versions 2 and up")
        count, = struct.unpack_from("<Q", data, 16)
        offset, found = 24, {}

        def string(at: int) -> tuple[str, int]:
            n, = struct.unpack_from("<Q", data, at)
            return bytes(data[at + 8:at + 8 + n]).decode("utf-8"), at + 8 + n

        for _ in range(count):
            key, offset = string(offset)
            kind, = struct.unpack_from("<I", data, offset)
            offset += 4
            wanted = key == ARCHITECTURE or key.startswith("nmst.")
            if kind == _STRING:
                value, offset = string(offset)
            elif kind in _SCALARS:
                value, = struct.unpack_from("<" + _SCALARS[kind], data, offset)
                offset += struct.calcsize(_SCALARS[kind])
            elif kind == _ARRAY:
                element, n = struct.unpack_from("<IQ", data, offset)
                offset += 12
                if element == _STRING:
                    for _ in range(n):
                        offset += 8 + struct.unpack_from("<Q", data, offset)[0]
                elif element in _SCALARS:
                    offset += n * struct.calcsize(_SCALARS[element])
                else:
                    raise ValueError(f"{path}: key {key!r} holds arrays of arrays, which this reader does not read")
                value = None
            else:
                raise ValueError(f"{path}: key {key!r} has the unknown GGUF value type {kind}")
            if wanted:
                found[key] = value
            if key == KEYS["t"]:
                break
    return found


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
