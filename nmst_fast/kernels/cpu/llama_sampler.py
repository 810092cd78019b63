"""The Python side of ``llama_sampler.cpp``: its state structure, field for field, its error messages, the
addresses of its functions (llama.cpp's ``llama_sampler_i.apply`` and ``.name``) in the kernels' library, and its
``llama_sampler_sample`` for a chain where the head draws alone."""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Optional

from . import native_library

__all__ = ["LlamaCalls", "SamplerState", "apply_address", "make_state", "name_address", "sample_function",
           "state_error"]

HEAD_CODES = {"nmst": 0, "st": 1, "va": 2}

ERRORS = {
    1: "llama.cpp handed the head candidates that are not the model's whole row in token order (the head must be "
       "first in the sampler chain; llama.cpp's backend sampling is not supported)",
    2: "the model's logits at step t={t} hold NaN",
    3: "the model's logits at step t={t} give no distribution (no finite non-eos logit)",
    4: "llama.cpp has no logits for the output the step at t={t} samples",
}


class SamplerState(ctypes.Structure):
    """``nmst_head_sampler_state``: the head, the step t of the next apply, ST's running sum, the first error, and
    the draw where the sampler makes it (top-k, top-p's cut, min-p, its generator's state)."""

    _fields_ = [
        ("head", ctypes.c_int32),
        ("eos", ctypes.c_int32),
        ("vocabulary", ctypes.c_int64),
        ("log1m_eps", ctypes.c_double),
        ("max_gap", ctypes.c_double),
        ("temperature", ctypes.c_double),
        ("step", ctypes.c_int64),
        ("st_sum", ctypes.c_double),
        ("error", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("error_step", ctypes.c_int64),
        ("draw", ctypes.c_int32),
        ("reserved2", ctypes.c_int32),
        ("top_k", ctypes.c_int64),
        ("cut", ctypes.c_double),
        ("min_p", ctypes.c_double),
        ("rng", ctypes.c_uint64),
    ]


def make_state(head: str, eps: float, eos: int, vocabulary: int, max_gap: float) -> SamplerState:
    """A state at t = 1, temperature 1, for the head ``head`` ("nmst", "st", "va") with ε ``eps`` and eos id
    ``eos`` over ``vocabulary`` tokens; ``max_gap``: the cap of ζ_eos − L_T
    (:data:`nmst_fast.decoding.eos_column.MAX_EOS_LOGIT_GAP`)."""
    if head not in HEAD_CODES:
        raise ValueError(f"head must be one of {sorted(HEAD_CODES)}, got {head!r}")
    if not 0 <= eos < vocabulary:
        raise ValueError(f"the head's eos_token_id {eos} is outside the vocabulary of {vocabulary}")
    return SamplerState(head=HEAD_CODES[head], eos=eos, vocabulary=vocabulary,
                        log1m_eps=math.log1p(-eps) if head != "va" else 0.0, max_gap=max_gap, temperature=1.0, step=1)


def state_error(state: SamplerState) -> Optional[ValueError]:
    """The failure ``state`` keeps, if any."""
    return None if state.error == 0 else ValueError(ERRORS[state.error].format(t=state.error_step))


@functools.lru_cache(maxsize=None)
def apply_address() -> Optional[int]:
    """The address of ``nmst_head_sampler_apply(llama_sampler *, llama_token_data_array *)``, or None where the
    kernels' library could not be built."""
    library = native_library()
    if library is None:
        return None
    library.nmst_head_sampler_state_size.restype = ctypes.c_size_t
    if library.nmst_head_sampler_state_size() != ctypes.sizeof(SamplerState):
        raise RuntimeError("the llama.cpp sampler's state differs between llama_sampler.cpp and llama_sampler.py")
    return ctypes.cast(library.nmst_head_sampler_apply, ctypes.c_void_p).value


def name_address() -> Optional[int]:
    """The address of ``nmst_head_sampler_name(const llama_sampler *)`` ("nmst-head"), or None where the kernels'
    library could not be built."""
    if apply_address() is None:
        return None
    return ctypes.cast(native_library().nmst_head_sampler_name, ctypes.c_void_p).value



class LlamaCalls(ctypes.Structure):
    """``nmst_llama_calls``: the addresses of the llama.h functions ``nmst_head_sampler_sample`` calls."""

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("logits_ith", "sampled_token_ith", "sampled_logits_ith", "sampled_probs_ith", "accept")]

    @classmethod
    def of(cls, library: ctypes.CDLL) -> "LlamaCalls":
        """The functions of ``library`` (the libllama llama-cpp-python loaded)."""
        names = ("llama_get_logits_ith", "llama_get_sampled_token_ith", "llama_get_sampled_logits_ith",
                 "llama_get_sampled_probs_ith", "llama_sampler_accept")
        return cls(*(ctypes.cast(getattr(library, name), ctypes.c_void_p).value for name in names))


def sample_function() -> Optional[ctypes._CFuncPtr]:
    """``nmst_head_sampler_sample(llama_sampler *head, llama_sampler *chain, llama_context *context, int32 idx,
    LlamaCalls *calls) -> int32``: llama.cpp's ``llama_sampler_sample(chain, context, idx)`` for a chain whose only
    sampler is the drawing head ``head``, from the context's logits row; 0 after a failure, which the head's state
    keeps. None where the kernels' library could not be built."""
    if apply_address() is None:
        return None
    function = native_library().nmst_head_sampler_sample
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
                         ctypes.POINTER(LlamaCalls)]
    function.restype = ctypes.c_int32
    return function
