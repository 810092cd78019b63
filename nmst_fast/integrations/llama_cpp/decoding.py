"""The head in llama-cpp-python: every step's logits become the head's step distribution before llama.cpp samples.

llama-cpp-python hands each logits processor the ids so far (prompt and generated) and the step's raw logits, in
vocabulary order, before any of its samplers; its chain then runs penalties, top-k, typical, top-p, min-p, the
temperature and the draw, in that order. :class:`NMSTLogitsProcessor` returns the head's log-distribution at
temperature T, log q_T (the eos column of :func:`nmst_fast.decoding.eos_column.write_eos_column`, then the row
divided by T), and the Llama's sampler chain is built with temperature 1 (0 stays greedy): so top-k, top-p and min-p
cut the head's tempered distribution, as everywhere in the library (temperature first, then the cuts), and greedy
decoding takes the head's argmax. t is 1 at the first generated token; ST's running sum is kept across the steps.

llama-cpp-python calls processors from a ctypes callback, which swallows exceptions and samples the plain logits.
So a failing processor keeps its error, and the Llama's ``sample`` raises it as soon as llama.cpp returns, before
the token reaches the caller: the generation stops with the error. :class:`NMSTLlama` does all of this itself; a
processor given to a ``Llama`` of your own installs the same two hooks on that instance (its ``generate``, which
builds the sampler chain, and ``sample``).

Refused before any step (ValueError): a file or ``Llama`` without the head's metadata, mirostat sampling (it
replaces the chain the head's distribution goes through), a draft model (speculative steps run the processor on
tokens that may be rejected).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from llama_cpp import Llama, LogitsProcessorList

from ...decoding.eos_column import write_eos_column
from ...settings import HeadSettings
from .metadata import ARCHITECTURE, read_head

__all__ = ["NMSTLlama", "NMSTLogitsProcessor", "load", "read_file_head"]


def read_file_head(path: str | os.PathLike) -> tuple[HeadSettings, str]:
    """The head and the base architecture a GGUF file records (read with the ``gguf`` package, before llama.cpp
    opens it: the base architecture is what it must be told to load)."""
    import gguf

    fields = gguf.GGUFReader(path).fields
    metadata = {key: field.contents() for key, field in fields.items() if key.startswith(("nmst.", ARCHITECTURE))}
    return read_head(metadata, where=str(path))


class NMSTLogitsProcessor:
    """llama-cpp-python logits processor ``(input_ids, scores) -> scores`` of one NMST file's head.

    ``llm``: the ``Llama`` it serves, opened on an NMST GGUF file with ``kv_overrides={"general.architecture":
    <base>}`` (:func:`load` does that); its head is read from ``llm.metadata`` unless ``settings`` is given.
    Making the processor installs two hooks on ``llm``: its ``generate`` restarts t at each generation and moves the
    call's temperature into the processor (sampling the head's tempered distribution), and its ``sample`` raises the
    processor's error, if any, once llama.cpp returns. ``scores``: (V,) float32 raw logits; returns (V,) float32
    log q_T (up to a constant per step)."""

    def __init__(self, llm: Llama, *, settings: Optional[HeadSettings] = None) -> None:
        if settings is None:
            settings, _ = read_head(llm.metadata, where=f"the Llama of {llm.model_path!r}")
        vocabulary = llm.n_vocab()
        if settings.eos_index >= vocabulary:
            raise ValueError(f"the head's eos_token_id {settings.eos_index} is outside the vocabulary of {vocabulary}")
        if getattr(llm, "draft_model", None) is not None:
            raise ValueError("the head cannot follow a draft model's speculative steps (the processor would see "
                             "tokens that are then rejected): open the Llama without draft_model")
        self.settings = settings
        self.temperature = 1.0
        self.error: Optional[BaseException] = None
        self.reset()
        if not isinstance(llm, NMSTLlama):
            _install_hooks(llm)

    def reset(self) -> None:
        """Start a generation: t = 1 at the next call, ST's sum 0, no error."""
        self.prompt_length: Optional[int] = None
        self.length = 0
        self.state: Optional[torch.Tensor] = None
        self.error = None

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        try:
            return self._step(len(input_ids), scores)
        except BaseException as error:  # a ctypes callback swallows it: kept for the hooked sample() to raise
            self.error = error
            raise

    def _step(self, length: int, scores: np.ndarray) -> np.ndarray:
        if self.prompt_length is None:
            self.prompt_length = length
        elif length != self.length + 1:
            raise RuntimeError(f"the processor saw {self.length} tokens, then {length}: one processor follows one "
                               "generation at a time (make one per generation, or let the Llama's generate restart "
                               "it)")
        self.length = length
        t = length - self.prompt_length + 1
        values = np.array(scores, dtype=np.float32)  # the step's copy of the logits (scores: a strided view)
        if values.shape[0] <= self.settings.eos_index:
            raise ValueError(f"a step's logits have {values.shape[0]} entries; the head's eos is "
                             f"{self.settings.eos_index}")
        if np.isnan(values).any():  # numpy's check: torch's would wake its thread pool beside llama.cpp's threads
            raise ValueError(f"the model's logits at step t={t} hold NaN")
        row = torch.from_numpy(values).view(1, -1)
        if self.settings.head != "va":  # VA is the softmax of the logits as they are
            self.state = write_eos_column(row, self.settings, t, self.temperature, self.state)
        if not math.isfinite(float(row[0, self.settings.eos_index] if self.settings.head != "va" else row.max())):
            raise ValueError(f"the model's logits at step t={t} give no distribution (no finite non-eos logit)")
        if self.temperature != 1.0:
            row.mul_(1.0 / self.temperature)
        return row.view(-1).numpy()


def _head_processors(kwargs: dict) -> list[NMSTLogitsProcessor]:
    return [p for p in (kwargs.get("logits_processor") or ()) if isinstance(p, NMSTLogitsProcessor)]


def _generate_with_head(generate: Callable[..., Iterator[int]], *args: Any, **kwargs: Any) -> Iterator[int]:
    """``Llama.generate`` (which builds the step's sampler chain once) with each head processor of the call
    restarted, and the call's temperature moved into them: llama.cpp then samples at temperature 1 (0 stays
    greedy, and a negative one, llama.cpp's draw without cuts, stays as it is)."""
    processors = _head_processors(kwargs)
    if processors:
        if kwargs.get("mirostat_mode", 0):
            raise ValueError("mirostat sampling replaces the sampler chain the head's distribution goes through: "
                             "decode an NMST model with mirostat_mode=0")
        temperature = kwargs.get("temp", 0.8)
        for processor in processors:
            processor.reset()
            processor.temperature = temperature if temperature > 0 else 1.0
        if temperature > 0:
            kwargs["temp"] = 1.0
    return (yield from generate(*args, **kwargs))


def _sample_with_head(sample: Callable[..., int], *args: Any, **kwargs: Any) -> int:
    """``Llama.sample`` with a head processor's error raised once llama.cpp returns (before its token, drawn from
    the plain logits, reaches the caller)."""
    token = sample(*args, **kwargs)
    for processor in _head_processors(kwargs):
        if processor.error is not None:
            error, processor.error = processor.error, None
            raise RuntimeError(f"the NMST head's logits processor failed ({type(error).__name__}: {error}); the "
                               "generation is stopped before llama.cpp's token from the plain logits") from error
    return token


def _install_hooks(llm: Llama) -> None:
    """The hooks of :class:`NMSTLlama` on a ``Llama`` instance of the user's (once)."""
    if getattr(llm, "_nmst_hooks", False):
        return
    generate, sample = llm.generate, llm.sample
    llm.generate = lambda *args, **kwargs: _generate_with_head(generate, *args, **kwargs)
    llm.sample = lambda *args, **kwargs: _sample_with_head(sample, *args, **kwargs)
    llm._nmst_hooks = True


class NMSTLlama(Llama):
    """A ``Llama`` of an NMST GGUF file (``nmst-fast export-gguf``) that decodes its head in every completion.

    ``model_path``: the file; the base architecture it records is passed to llama.cpp as an override of
    ``general.architecture`` (other ``kv_overrides`` are kept); every other argument is ``Llama``'s. ``head``: the
    file's :class:`~nmst_fast.settings.HeadSettings`. ``create_completion``, ``__call__``, the chat completions and
    ``generate`` decode the head (an :class:`NMSTLogitsProcessor` first in the processor list, unless one is
    given), at the temperature, top-k, top-p and min-p of the call."""

    def __init__(self, model_path: str, *args: Any, kv_overrides: Optional[dict] = None, **kwargs: Any) -> None:
        self.head, base = read_file_head(model_path)
        super().__init__(model_path, *args, kv_overrides={ARCHITECTURE: base, **(kv_overrides or {})}, **kwargs)

    def generate(self, tokens: Any, *args: Any, logits_processor: Any = None, **kwargs: Any) -> Iterator[int]:
        processors = LogitsProcessorList(logits_processor or [])
        if not _head_processors({"logits_processor": processors}):
            processors.insert(0, NMSTLogitsProcessor(self, settings=self.head))
        return _generate_with_head(super().generate, tokens, *args, logits_processor=processors, **kwargs)

    def sample(self, *args: Any, **kwargs: Any) -> int:
        return _sample_with_head(super().sample, *args, **kwargs)


def load(model_path: str | os.PathLike, **kwargs: Any) -> NMSTLlama:
    """Open an NMST GGUF file with llama-cpp-python: ``NMSTLlama(model_path, **kwargs)``."""
    return NMSTLlama(str(model_path), **kwargs)
