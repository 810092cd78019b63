"""The head in llama-cpp-python: every step's logits become the head's step distribution before llama.cpp samples.

llama-cpp-python samples each step with a chain built once per ``generate``: the logits processors the call gives
(run in a ctypes callback on a copy of the step's logits), penalties, top-k, typical, top-p, min-p, the temperature
and the draw, in that order. The head's row is log q_T, its log-distribution at temperature T (the eos column of
:class:`nmst_fast.decoding.eos_column.EosColumnWriter`, then the row divided by T), and the chain is built with
temperature 1 (0 stays greedy): so top-k, top-p and min-p cut the head's tempered distribution, as everywhere in the
library (temperature first, then the cuts), and greedy decoding takes the head's argmax. t is 1 at the first
generated token; ST's running sum is kept across the steps.

:class:`NMSTLlama` writes the head's row into llama.cpp's own logits buffer before each sample and puts the row back
once drawn: no callback, no copy at temperature 1, and an error raised where it happens. :class:`NMSTLogitsProcessor`
serves a ``Llama`` of one's own through the callback, which swallows exceptions and samples the plain logits: it
keeps its error, and the hooks it installs on that instance raise it from ``sample`` as soon as llama.cpp returns,
before the token reaches the caller (and restart t and move the temperature in ``generate``).

Refused before any step (ValueError): a file or ``Llama`` without the head's metadata, mirostat sampling (it
replaces the chain the head's distribution goes through), a draft model (speculative steps run the head on tokens
that may be rejected).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from llama_cpp import Llama

from ...decoding.eos_column import EosColumnWriter
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
        self._buffer: Optional[np.ndarray] = None
        self._writer = EosColumnWriter(settings, 1)
        self._tensor: Optional[torch.Tensor] = None
        self._tensor_key: Optional[tuple[int, int]] = None
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
            if self._buffer is None or self._buffer.shape != scores.shape:
                self._buffer = np.empty(scores.shape, dtype=np.float32)
            np.copyto(self._buffer, scores)  # the step's copy of the logits (scores: a strided view)
            self.apply(self._buffer, len(input_ids))
            return self._buffer
        except BaseException as error:  # a ctypes callback swallows it: kept for the hooked sample() to raise
            self.error = error
            raise

    def apply(self, logits: np.ndarray, length: int) -> None:
        """One step, in place: ``logits`` (V,) float32, contiguous, the step's raw logits, become log q_T (up to a
        constant); ``length`` is the number of tokens so far (prompt and generated), which gives t."""
        if self.prompt_length is None:
            self.prompt_length = length
        elif length != self.length + 1:
            raise RuntimeError(f"the head saw {self.length} tokens, then {length}: one processor follows one "
                               "generation at a time (make one per generation, or let the Llama's generate restart "
                               "it)")
        self.length = length
        t = length - self.prompt_length + 1
        eos = self.settings.eos_index
        if logits.shape[0] <= eos:
            raise ValueError(f"a step's logits have {logits.shape[0]} entries; the head's eos is {eos}")
        if np.isnan(logits).any():  # numpy's check: torch's would wake its thread pool beside llama.cpp's threads
            raise ValueError(f"the model's logits at step t={t} hold NaN")
        if self.settings.head != "va":  # VA is the softmax of the logits as they are
            self.state = self._writer(self._tensor_of(logits), t, self.temperature, self.state)
        if not math.isfinite(logits[eos] if self.settings.head != "va" else logits.max()):
            raise ValueError(f"the model's logits at step t={t} give no distribution (no finite non-eos logit)")
        if self.temperature != 1.0:
            np.multiply(logits, np.float32(1.0 / self.temperature), out=logits)

    def _tensor_of(self, logits: np.ndarray) -> torch.Tensor:
        """``logits`` as a (1, V) tensor sharing its memory; the same tensor while the buffer stays (llama.cpp's
        logits buffer and this processor's own copy stay from step to step)."""
        key = (logits.ctypes.data, logits.shape[0])
        if self._tensor_key != key:
            self._tensor, self._tensor_key = torch.from_numpy(logits).view(1, -1), key
        return self._tensor


def _head_processors(kwargs: dict) -> list[NMSTLogitsProcessor]:
    return [p for p in (kwargs.get("logits_processor") or ()) if isinstance(p, NMSTLogitsProcessor)]


def _generate_with_head(generate: Callable[..., Iterator[int]], heads: list[NMSTLogitsProcessor], *args: Any,
                        **kwargs: Any) -> Iterator[int]:
    """``Llama.generate`` (which builds the step's sampler chain once) with each head restarted and the call's
    temperature moved into it: llama.cpp then samples at temperature 1 (0 stays greedy, and a negative one,
    llama.cpp's draw without cuts, stays as it is)."""
    if heads:
        if kwargs.get("mirostat_mode", 0):
            raise ValueError("mirostat sampling replaces the sampler chain the head's distribution goes through: "
                             "decode an NMST model with mirostat_mode=0")
        temperature = kwargs.get("temp", 0.8)
        for head in heads:
            head.reset()
            head.temperature = temperature if temperature > 0 else 1.0
        if temperature > 0:
            kwargs["temp"] = 1.0
    return (yield from generate(*args, **kwargs))


def _failed(error: BaseException) -> RuntimeError:
    return RuntimeError(f"the NMST head failed at a step ({type(error).__name__}: {error}); the generation is "
                        "stopped")


def _sample_with_head(sample: Callable[..., int], *args: Any, **kwargs: Any) -> int:
    """``Llama.sample`` with a head processor's error raised once llama.cpp returns (before its token, drawn from
    the plain logits, reaches the caller)."""
    token = sample(*args, **kwargs)
    for processor in _head_processors(kwargs):
        if processor.error is not None:
            error, processor.error = processor.error, None
            raise _failed(error) from error
    return token


def _install_hooks(llm: Llama) -> None:
    """The processor path's two hooks (restart and temperature in ``generate``, the error in ``sample``) on a
    ``Llama`` instance of the user's, once."""
    if getattr(llm, "_nmst_hooks", False):
        return
    generate, sample = llm.generate, llm.sample
    llm.generate = lambda *args, **kwargs: _generate_with_head(generate, _head_processors(kwargs), *args, **kwargs)
    llm.sample = lambda *args, **kwargs: _sample_with_head(sample, *args, **kwargs)
    llm._nmst_hooks = True


class NMSTLlama(Llama):
    """A ``Llama`` of an NMST GGUF file (``nmst-fast export-gguf``) that decodes its head in every completion.

    ``model_path``: the file; the base architecture it records is passed to llama.cpp as an override of
    ``general.architecture`` (other ``kv_overrides`` are kept); every other argument is ``Llama``'s. ``head``: the
    file's :class:`~nmst_fast.settings.HeadSettings`. ``create_completion``, ``__call__``, the chat completions and
    ``generate`` decode the head at the temperature, top-k, top-p and min-p of the call.

    Each step's logits become the head's in llama.cpp's own buffer (contiguous: no callback, and at temperature 1 no
    copy: only the eos entry is kept and put back) before the sampler chain reads them, and are restored once it has
    drawn; an error is raised where it happens, and a processor the call adds sees the head's distribution. A
    call that gives an :class:`NMSTLogitsProcessor` itself is decoded by that one instead."""

    def __init__(self, model_path: str, *args: Any, kv_overrides: Optional[dict] = None, **kwargs: Any) -> None:
        self.head, base = read_file_head(model_path)
        super().__init__(model_path, *args, kv_overrides={ARCHITECTURE: base, **(kv_overrides or {})}, **kwargs)
        self._steps = NMSTLogitsProcessor(self, settings=self.head)
        self._own_steps = False  # whether the running generation's steps are this Llama's (no processor given)

    def generate(self, tokens: Any, *args: Any, **kwargs: Any) -> Iterator[int]:
        given = _head_processors(kwargs)
        self._own_steps = not given
        return _generate_with_head(super().generate, given or [self._steps], tokens, *args, **kwargs)

    def sample(self, *args: Any, idx: Optional[int] = None, **kwargs: Any) -> int:
        if not self._own_steps:
            return _sample_with_head(super().sample, *args, idx=idx, **kwargs)
        row = -1 if idx is None else idx - self.n_tokens
        logits = np.ctypeslib.as_array(self._ctx.get_logits_ith(row), shape=(self._n_vocab,))
        # The row is restored once sampled: a later generate of the same prompt samples from it again.
        eos = self.head.eos_index
        kept = logits.copy() if self._steps.temperature != 1.0 else logits[eos]
        try:
            try:
                self._steps.apply(logits, self.n_tokens)
            except Exception as error:
                raise _failed(error) from error
            return super().sample(*args, idx=idx, **kwargs)
        finally:
            if isinstance(kept, np.ndarray):
                np.copyto(logits, kept)
            else:
                logits[eos] = kept

    def __del__(self) -> None:
        if hasattr(self, "_stack"):  # the file was refused before llama.cpp opened it: nothing to free
            super().__del__()


def load(model_path: str | os.PathLike, **kwargs: Any) -> NMSTLlama:
    """Open an NMST GGUF file with llama-cpp-python: ``NMSTLlama(model_path, **kwargs)``."""
    return NMSTLlama(str(model_path), **kwargs)
