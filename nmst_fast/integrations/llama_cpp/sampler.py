"""The head as a llama.cpp sampler, first in llama-cpp-python's sampler chain: every step's candidates become the
head's step distribution in C (``nmst_fast/kernels/cpu/llama_sampler.cpp``), with no Python on the way.

The sampler's interface is llama-cpp-python's own ctypes structure (so it matches the llama.cpp it was built with),
its ``apply`` the C function of the CPU kernels' library, its context a state this object owns. It is inserted at
the head of a chain :meth:`llama_cpp.Llama._init_sampler` built (before the processors a call gives, the penalties,
the cuts and the draw) and listed among the chain's custom samplers, which llama-cpp-python removes before freeing
the chain. A failure in a step (NaN logits, no distribution, candidates that are not the model's whole row) is kept
in the state and leaves the candidates as they are: :meth:`HeadSampler.error` returns it once llama.cpp returns.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional

import llama_cpp

from ...decoding.eos_column import MAX_EOS_LOGIT_GAP
from ...kernels.cpu.llama_sampler import apply_address, make_state, name_address, state_error
from ...settings import HeadSettings

__all__ = ["HeadSampler", "native_sampler_available"]


def native_sampler_available() -> bool:
    """Whether the CPU kernels' library, and with it the sampler, could be built here."""
    return apply_address() is not None


class HeadSampler:
    """One head's llama.cpp sampler for a model of ``vocabulary`` tokens. ``settings``: the head. Raises
    RuntimeError where the CPU kernels' library is not available (:func:`native_sampler_available`)."""

    def __init__(self, settings: HeadSettings, vocabulary: int) -> None:
        apply = apply_address()
        if apply is None:
            raise RuntimeError("the CPU kernels could not be built: the head's llama.cpp sampler is one of them")
        self.state = make_state(settings.head, settings.eps, settings.eos_index, vocabulary, MAX_EOS_LOGIT_GAP)
        self._interface = llama_cpp.llama_sampler_i()  # every other entry NULL: llama.cpp skips it
        self._interface.apply = llama_cpp.llama_sampler_i_apply(apply)
        self._interface.name = llama_cpp.llama_sampler_i_name(name_address())
        self._sampler = llama_cpp.llama_sampler(iface=ctypes.pointer(self._interface),
                                                ctx=ctypes.cast(ctypes.pointer(self.state), ctypes.c_void_p))

    def reset(self, temperature: float = 1.0) -> None:
        """Start a generation at temperature ``temperature`` (> 0; 1 for greedy): t = 1 at the next step, ST's sum
        0, no error."""
        self.state.temperature = temperature
        self.state.step = 1
        self.state.st_sum = 0.0
        self.state.error = 0
        self.state.error_step = 0

    def put_first(self, chain: Any) -> None:
        """Insert this sampler at the head of ``chain`` (a ``llama_cpp._internals.LlamaSampler``) and list it among
        its custom samplers, which llama-cpp-python removes, highest index first, before freeing the chain."""
        handle = chain.sampler
        others = [llama_cpp.llama_sampler_chain_remove(handle, 0)
                  for _ in range(llama_cpp.llama_sampler_chain_n(handle))]
        llama_cpp.llama_sampler_chain_add(handle, ctypes.pointer(self._sampler))
        for sampler in others:
            llama_cpp.llama_sampler_chain_add(handle, sampler)
        chain.custom_samplers = [(0, self)] + [(index + 1, custom) for index, custom in chain.custom_samplers]

    def error(self) -> Optional[ValueError]:
        """The failure of the generation's steps so far, if any."""
        return state_error(self.state)
