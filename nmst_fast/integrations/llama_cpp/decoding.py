"""The head in llama-cpp-python: every step's logits become the head's step distribution before llama.cpp samples.

llama-cpp-python samples each step with a chain built once per ``generate``: the logits processors the call gives
(run in a ctypes callback on a copy of the step's logits), penalties, top-k, typical, top-p, min-p, the temperature
and the draw, in that order. The head's row is log q_T, its log-distribution at temperature T (the eos column of
:func:`nmst_fast.decoding.eos_column.write_eos_column`, then the row divided by T), and the chain is built with
temperature 1 (0 stays greedy): so top-k, top-p and min-p cut the head's tempered distribution, as everywhere in the
library (temperature first, then the cuts), and greedy decoding takes the head's argmax. t is 1 at the first
generated token; ST's running sum is kept across the steps.

The head runs first in that chain as a sampler written in C (:mod:`.sampler`): no Python runs in a step, and a
step's failure is kept and raised from ``sample`` as soon as llama.cpp returns, before its token reaches the caller.
Where the rest of the chain is greedy, or top-k, top-p, min-p and the draw alone (no penalties, grammar or other
processors), the C sampler draws the token itself from the context's logits row, with the library's CPU selection
kernel and a generator seeded by the ``Llama``'s seed, and is the chain's only sampler.
:class:`NMSTLlama` does so in every call; an :class:`NMSTLogitsProcessor` given first among a call's processors (a
``Llama`` of one's own) is run that way too, its hooks on that instance standing for the subclass's overrides.
Where the CPU kernels cannot be built, or the call puts another processor before it, the head runs as a processor in
llama-cpp-python's callback, which swallows exceptions and samples the plain logits: the processor keeps its error,
and ``sample`` raises it in the same way.

On a CPU where llama.cpp runs AMX kernels, :class:`NMSTLlama` opens files without llama.cpp's extra buffer types
(:mod:`.buffers`: its AMX matmul crashes decoding quantized files there); ``use_extra_bufts=True`` turns them back on.

Refused before any step (ValueError): a file or ``Llama`` without the head's metadata, a ``Llama`` of one's own
holding a quantized file in llama.cpp's AMX buffers (it would crash), mirostat sampling (it
replaces the chain the head's distribution goes through), a draft model (speculative steps run the head on tokens
that may be rejected), ``logprobs`` in a completion (llama-cpp-python computes them from the raw logits, the base
model's softmax).
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from llama_cpp import Llama, LogitsProcessorList

from ...decoding.eos_column import write_eos_column
from ...settings import HeadSettings
from .buffers import AMX_CRASH, default_extra_buffer_types, risks_the_amx_crash
from .metadata import ARCHITECTURE, read_file_keys, read_head
from .sampler import Draw, HeadSampler, native_sampler_available

__all__ = ["NMSTLlama", "NMSTLogitsProcessor", "load", "read_file_head"]


def read_file_head(path: str | os.PathLike) -> tuple[HeadSettings, str]:
    """The head and the base architecture a GGUF file records (read from its header before llama.cpp opens it: the
    base architecture is what llama.cpp must be told to load; :func:`.metadata.read_file_keys`)."""
    return read_head(read_file_keys(path), where=str(path))


class NMSTLogitsProcessor:
    """llama-cpp-python logits processor ``(input_ids, scores) -> scores`` of one NMST file's head.

    ``llm``: the ``Llama`` it serves, opened on an NMST GGUF file with ``kv_overrides={"general.architecture":
    <base>}`` (:func:`load` does that); its head is read from ``llm.metadata`` unless ``settings`` is given.
    Making the processor installs hooks on ``llm`` (an :class:`NMSTLlama` has them as methods): its ``generate``
    restarts the head at each generation and moves the call's temperature into it (sampling the head's tempered
    distribution); where the processor comes first among the call's processors and the CPU kernels are built, the
    call runs it as its C sampler (``sampler``), first in llama.cpp's chain, and not as a callback; ``sample``
    raises the head's error, if any, once llama.cpp returns. Called as a processor: ``scores`` (V,) float32 raw
    logits; returns (V,) float32 log q_T (up to a constant per step)."""

    def __init__(self, llm: Llama, *, settings: Optional[HeadSettings] = None) -> None:
        if settings is None:
            settings, _ = read_head(llm.metadata, where=f"the Llama of {llm.model_path!r}")
        vocabulary = llm.n_vocab()
        if settings.eos_index >= vocabulary:
            raise ValueError(f"the head's eos_token_id {settings.eos_index} is outside the vocabulary of {vocabulary}")
        if not isinstance(llm, NMSTLlama) and risks_the_amx_crash(llm):
            raise ValueError(f"{AMX_CRASH}, and this Llama holds a quantized file in llama.cpp's extra buffer types "
                             "on such a CPU: open the file with nmst_fast.integrations.llama_cpp.load(path, ...), "
                             "which keeps the weights out of them here (your processors apply as with any Llama), or "
                             "with load(path, use_extra_bufts=True) to keep them")
        if getattr(llm, "draft_model", None) is not None:
            raise ValueError("the head cannot follow a draft model's speculative steps (the processor would see "
                             "tokens that are then rejected): open the Llama without draft_model")
        self.settings = settings
        self.temperature = 1.0
        self.error: Optional[BaseException] = None
        self._buffer: Optional[np.ndarray] = None
        # the same head as a C sampler, which a generate call runs where the processor comes first in its list
        self.sampler = HeadSampler(settings, vocabulary) if native_sampler_available() else None
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
            self.state = write_eos_column(torch.from_numpy(logits).view(1, -1), self.settings, t, self.temperature,
                                          self.state)
        if not math.isfinite(logits[eos] if self.settings.head != "va" else logits.max()):
            raise ValueError(f"the model's logits at step t={t} give no distribution (no finite non-eos logit)")
        if self.temperature != 1.0:
            np.multiply(logits, np.float32(1.0 / self.temperature), out=logits)


def _head_processors(kwargs: dict) -> list[NMSTLogitsProcessor]:
    return [p for p in (kwargs.get("logits_processor") or ()) if isinstance(p, NMSTLogitsProcessor)]


def _head_temperature(kwargs: dict) -> float:
    """The temperature of a ``generate`` call for the head, the call's own set to 1 (llama.cpp then samples the head's
    tempered distribution; 0 stays greedy and a negative one, llama.cpp's draw without cuts, stays as it is).
    Mirostat is refused."""
    if kwargs.get("mirostat_mode", 0):
        raise ValueError("mirostat sampling replaces the sampler chain the head's distribution goes through: "
                         "decode an NMST model with mirostat_mode=0")
    temperature = kwargs.get("temp", 0.8)
    if temperature > 0:
        kwargs["temp"] = 1.0
    return temperature if temperature > 0 else 1.0


def _start_generation(llm: Llama, kwargs: dict, default: Optional[NMSTLogitsProcessor]) -> None:
    """Choose and restart the head of a ``generate`` call (its keyword arguments ``kwargs``, changed in place).

    The head is the call's :class:`NMSTLogitsProcessor`, or ``default`` (an :class:`NMSTLlama`'s own) when the call
    gives none. It runs as its C sampler, first in the chain (``llm._nmst_sampler``, which the hooked
    ``_init_sampler`` puts there), where the kernels are built and the call gives no other processor before it (the
    processor leaves the call's list); otherwise as a processor in llama-cpp-python's callback, first in the list
    (``default``) or where the call put it."""
    given = list(kwargs.get("logits_processor") or ())
    heads = [p for p in given if isinstance(p, NMSTLogitsProcessor)]
    llm._nmst_sampler = None
    if not heads and default is None:
        return  # a hooked Llama called without its head
    temperature = _head_temperature(kwargs)
    if not heads:
        if default.sampler is None:
            heads = [default]
            kwargs["logits_processor"] = LogitsProcessorList([default, *given])
        else:
            llm._nmst_sampler = default.sampler
    elif len(heads) == 1 and given[0] is heads[0] and heads[0].sampler is not None:
        llm._nmst_sampler = heads[0].sampler
        kwargs["logits_processor"] = LogitsProcessorList(given[1:]) if len(given) > 1 else None
    if llm._nmst_sampler is not None:
        llm._nmst_sampler.reset(temperature)
        return
    for head in heads:
        head.reset()
        head.temperature = temperature


def _head_first(llm: Llama, init_sampler: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The chain ``init_sampler`` (``Llama._init_sampler``) builds from ``args`` and ``kwargs``, with the generation's
    C sampler put first, if it has one; alone, drawing the token itself, where the chain is one it covers."""
    chain = init_sampler(*args, **kwargs)
    if llm._nmst_sampler is not None:
        bound = inspect.signature(init_sampler).bind(*args, **kwargs)
        bound.apply_defaults()
        llm._nmst_sampler.put_first(chain, Draw.of_chain(bound.arguments, llm._seed))
    return chain


def _failed(error: BaseException) -> RuntimeError:
    return RuntimeError(f"the NMST head failed at a step ({type(error).__name__}: {error}); the generation is "
                        "stopped")


def _checked(llm: Llama, token: int, kwargs: dict) -> int:
    """``token``, drawn by ``Llama.sample`` (called with ``kwargs``), once the head's step is known to have
    succeeded: a failure the C sampler or a processor kept (llama.cpp then drew from the plain logits) is raised
    before the token reaches the caller."""
    if llm._nmst_sampler is not None:
        if (error := llm._nmst_sampler.error()) is not None:
            raise _failed(error) from error
        return token
    for processor in _head_processors(kwargs):
        if processor.error is not None:
            error, processor.error = processor.error, None
            raise _failed(error) from error
    return token


def _restart(llm: Llama) -> None:
    """``Llama.reset``: the C sampler's next step is t = 1 again."""
    if getattr(llm, "_nmst_sampler", None) is not None:  # Llama.__init__ may reset before the head is made
        llm._nmst_sampler.reset(llm._nmst_sampler.state.temperature)


def _refuse_logprobs(create: Callable[..., Any], args: tuple, kwargs: dict, head: bool) -> None:
    """A ``create_completion`` call (``args``, ``kwargs``) that asks for logprobs where the head decodes (``head``,
    or an :class:`NMSTLogitsProcessor` among the call's processors) is refused: llama-cpp-python computes them from
    the raw logits, the base model's softmax, whatever the sampler chain draws from."""
    arguments = inspect.signature(create).bind(*args, **kwargs).arguments
    if arguments.get("logprobs") is None:
        return
    if head or any(isinstance(p, NMSTLogitsProcessor) for p in arguments.get("logits_processor") or ()):
        raise ValueError("logprobs: llama-cpp-python computes them from the raw logits (the base model's softmax), "
                         "not from the NMST head's distribution; call without logprobs (the head's log-probabilities "
                         "of a step: nmst_fast.decoding.step_log_probs on that step's row of Llama.scores)")


def _install_hooks(llm: Llama) -> None:
    """:class:`NMSTLlama`'s overrides (``generate``, ``_init_sampler``, ``sample``, ``reset``,
    ``create_completion``) as hooks on a ``Llama`` instance of the user's, once."""
    if getattr(llm, "_nmst_hooks", False):
        return
    generate, init_sampler, sample, reset = llm.generate, llm._init_sampler, llm.sample, llm.reset
    create_completion = llm.create_completion
    llm._nmst_sampler = None

    def hooked_generate(*args: Any, **kwargs: Any) -> Iterator[int]:
        _start_generation(llm, kwargs, None)
        return generate(*args, **kwargs)

    def hooked_reset() -> None:
        reset()
        _restart(llm)

    def hooked_create_completion(*args: Any, **kwargs: Any) -> Any:
        _refuse_logprobs(create_completion, args, kwargs, head=False)
        return create_completion(*args, **kwargs)

    llm.generate = hooked_generate
    llm._init_sampler = lambda *args, **kwargs: _head_first(llm, init_sampler, args, kwargs)
    llm.sample = lambda *args, **kwargs: _checked(llm, sample(*args, **kwargs), kwargs)
    llm.reset = hooked_reset
    llm.create_completion = hooked_create_completion
    llm._nmst_hooks = True


class NMSTLlama(Llama):
    """A ``Llama`` of an NMST GGUF file (``nmst-fast export-gguf``) that decodes its head in every completion.

    ``model_path``: the file; the base architecture it records is passed to llama.cpp as an override of
    ``general.architecture`` (other ``kv_overrides`` are kept); every other argument is ``Llama``'s. ``head``: the
    file's :class:`~nmst_fast.settings.HeadSettings`. ``create_completion``, ``__call__``, the chat completions,
    ``generate`` and ``sample`` decode the head at the temperature, top-k, top-p and min-p of the call.
    ``use_extra_bufts``: whether llama.cpp may repack the weights into its extra CPU buffer types (llama.cpp's model
    parameter of that name, which ``Llama`` has no argument for); by default off where this llama.cpp build runs AMX
    kernels, which crash decoding quantized files on such CPUs (llama.cpp issue 20824), and on elsewhere.

    The head is a llama.cpp sampler written in C (:class:`~nmst_fast.integrations.llama_cpp.sampler.HeadSampler`),
    first in the chain each ``generate`` builds: no Python runs in a step, and a step's failure is raised as soon
    as llama.cpp returns, before its token reaches the caller. Where the CPU kernels cannot be built, the head runs
    as an :class:`NMSTLogitsProcessor` in the call instead (llama-cpp-python's callback: slower). A call that gives
    an :class:`NMSTLogitsProcessor` itself is decoded by that one."""

    def __init__(self, model_path: str, *args: Any, kv_overrides: Optional[dict] = None,
                 use_extra_bufts: Optional[bool] = None, **kwargs: Any) -> None:
        self.head, base = read_file_head(model_path)
        self._use_extra_bufts = default_extra_buffer_types() if use_extra_bufts is None else bool(use_extra_bufts)
        super().__init__(model_path, *args, kv_overrides={ARCHITECTURE: base, **(kv_overrides or {})}, **kwargs)
        self._steps = NMSTLogitsProcessor(self, settings=self.head)  # checks the head against the model
        self._nmst_sampler = self._steps.sampler  # a sample() before any generate decodes the head too

    @property
    def model_params(self) -> Any:
        """llama.cpp's model parameters (``Llama``'s attribute), with ``use_extra_bufts`` as this file is opened."""
        return self._model_params

    @model_params.setter
    def model_params(self, params: Any) -> None:
        # Llama.__init__ assigns llama.cpp's defaults here, fills them and loads the model with them
        params.use_extra_bufts = self._use_extra_bufts
        self._model_params = params

    def generate(self, tokens: Any, *args: Any, **kwargs: Any) -> Iterator[int]:
        _start_generation(self, kwargs, self._steps)
        return super().generate(tokens, *args, **kwargs)

    def _init_sampler(self, *args: Any, **kwargs: Any) -> Any:
        return _head_first(self, super()._init_sampler, args, kwargs)

    def sample(self, *args: Any, **kwargs: Any) -> int:
        return _checked(self, super().sample(*args, **kwargs), kwargs)

    def reset(self) -> None:
        super().reset()
        _restart(self)

    def create_completion(self, *args: Any, **kwargs: Any) -> Any:
        _refuse_logprobs(super().create_completion, args, kwargs, head=True)
        return super().create_completion(*args, **kwargs)

    def __del__(self) -> None:
        if hasattr(self, "_stack"):  # the file was refused before llama.cpp opened it: nothing to free
            super().__del__()


def load(model_path: str | os.PathLike, **kwargs: Any) -> NMSTLlama:
    """Open an NMST GGUF file with llama-cpp-python: ``NMSTLlama(model_path, **kwargs)``."""
    return NMSTLlama(str(model_path), **kwargs)
