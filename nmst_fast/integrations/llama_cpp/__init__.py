"""NMST models in llama.cpp: a GGUF export that keeps the head, and exact decoding through llama-cpp-python.

* :func:`export_gguf` (``nmst-fast export-gguf DIR OUT.gguf``) — a saved NMST model as a GGUF file that plain
  llama.cpp refuses (:mod:`.export`; needs the ``gguf`` extra);
* :func:`load` / :class:`NMSTLlama` — open such a file with llama-cpp-python and decode the head;
  :class:`NMSTLogitsProcessor` — the same head for a ``Llama`` of your own (:mod:`.decoding`; needs the
  ``llama-cpp`` extra). Either runs the head as a llama.cpp sampler written in C, first in the sampler chain
  (:mod:`.sampler`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["NMSTLlama", "NMSTLogitsProcessor", "export_gguf", "load"]


def __getattr__(name: str) -> Any:
    # Each part imports only what it needs: the export runs without llama-cpp-python, decoding without gguf.
    if name == "export_gguf":
        from .export import export_gguf

        return export_gguf
    if name in ("NMSTLlama", "NMSTLogitsProcessor", "load"):
        from . import decoding

        return getattr(decoding, name)
    raise AttributeError(name)
