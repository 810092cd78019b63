"""The head as a llama.cpp sampler, first in llama-cpp-python's sampler chain: every step's candidates become the
head's step distribution in C (``nmst_fast/kernels/cpu/llama_sampler.cpp``), with no Python on the way. Where the
rest of the chain is one the CPU selection kernel covers (greedy; or top-k, typical 1, top-p, min-p, temperature, the
draw; no penalties, grammar or processors), the sampler draws the token itself (:class:`Draw`) and is the chain's only
one.

The sampler's interface is llama-cpp-python's own ctypes structure (so it matches the llama.cpp it was built with),
its ``apply`` the C function of the CPU kernels' library, its context a state this object owns. It is inserted at
the head of a chain :meth:`llama_cpp.Llama._init_sampler` built (before the processors a call gives, the penalties,
the cuts and the draw) and listed among the chain's custom samplers, which llama-cpp-python removes before freeing
the chain. A failure in a step (NaN logits, no distribution, candidates that are not the model's whole row) is kept
in the state and leaves the candidates as they are: :meth:`HeadSampler.error` returns it once llama.cpp returns.
Where the sampler draws alone, the chain's ``sample`` calls the C sampler on the context's logits row directly
(``nmst_head_sampler_sample``), without the V candidate records llama.cpp's ``llama_sampler_sample`` would write and
the sampler would read the logits back out of.
"""

from __future__ import annotations

import ctypes
import random
from dataclasses import dataclass
from typing import Any, Optional

import llama_cpp

from ...decoding.eos_column import MAX_EOS_LOGIT_GAP
from ...decoding.truncation import TOP_P_SLACK
from ...kernels.cpu.llama_sampler import (
    LlamaCalls,
    apply_address,
    make_state,
    name_address,
    sample_function,
    state_error,
)
from ...settings import HeadSettings

__all__ = ["Draw", "HeadSampler", "native_sampler_available"]

# llama.cpp's seed that asks for a random one (LLAMA_DEFAULT_SEED)
RANDOM_SEED = 0xFFFFFFFF


@dataclass(frozen=True)
class Draw:
    """The cuts of a step the head's sampler draws itself: ``top_k`` (0: none; 1: greedy), ``top_p`` (>= 1: none),
    ``min_p`` (<= 0: none), as llama.cpp's samplers of those names take them, and llama.cpp's ``seed``."""

    top_k: int
    top_p: float
    min_p: float
    seed: int

    @classmethod
    def of_chain(cls, arguments: dict, seed: int) -> Optional["Draw"]:
        """The draw of a chain ``Llama._init_sampler`` builds from ``arguments`` (all of its parameters), where the
        head's kernel covers it: no penalties, grammar or processors, and then greedy (temperature 0), the draw
        without cuts (a negative temperature) or a sampled chain (temperature 1: the head holds the call's) with no
        mirostat and typical_p >= 1. None otherwise (the chain keeps llama.cpp's samplers)."""
        plain = (arguments["grammar"] is None and not arguments["logits_processor"]
                 and arguments["repeat_penalty"] == 1.0 and arguments["frequency_penalty"] == 0.0
                 and arguments["presence_penalty"] == 0.0)
        if not plain:
            return None
        temperature = arguments["temp"]
        if temperature == 0.0:  # llama.cpp's greedy sampler alone
            return cls(top_k=1, top_p=1.0, min_p=0.0, seed=int(seed))
        if temperature < 0.0:  # llama.cpp's dist sampler alone
            return cls(top_k=0, top_p=1.0, min_p=0.0, seed=int(seed))
        if temperature != 1.0 or arguments["mirostat_mode"] or arguments["typical_p"] < 1.0:
            return None
        return cls(top_k=max(int(arguments["top_k"]), 0), top_p=float(arguments["top_p"]),
                   min_p=float(arguments["min_p"]), seed=int(seed))


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
        self._calls = LlamaCalls.of(llama_cpp.llama_cpp._lib)

    def reset(self, temperature: float = 1.0) -> None:
        """Start a generation at temperature ``temperature`` (> 0; 1 for greedy): t = 1 at the next step, ST's sum
        0, no error."""
        self.state.temperature = temperature
        self.state.step = 1
        self.state.st_sum = 0.0
        self.state.error = 0
        self.state.error_step = 0

    def put_first(self, chain: Any, draw: Optional[Draw] = None) -> None:
        """Insert this sampler at the head of ``chain`` (a ``llama_cpp._internals.LlamaSampler``) and list it among
        its custom samplers, which llama-cpp-python removes, highest index first, before freeing the chain. With a
        ``draw`` (a chain of llama.cpp's own samplers only, :meth:`Draw.of_chain`) those are freed instead and this
        sampler draws each step's token itself, from the context's logits row (the chain's ``sample``)."""
        handle = chain.sampler
        others = [llama_cpp.llama_sampler_chain_remove(handle, 0)
                  for _ in range(llama_cpp.llama_sampler_chain_n(handle))]
        llama_cpp.llama_sampler_chain_add(handle, ctypes.pointer(self._sampler))
        self.state.draw = int(draw is not None)
        if draw is not None:
            self.state.top_k = draw.top_k
            self.state.cut = draw.top_p - TOP_P_SLACK if draw.top_p < 1.0 else 2.0
            self.state.min_p = draw.min_p if draw.min_p > 0.0 else 0.0
            self.state.rng = random.SystemRandom().getrandbits(64) if draw.seed == RANDOM_SEED else draw.seed
            for sampler in others:  # llama.cpp's own: the chain owned them
                llama_cpp.llama_sampler_free(sampler)
            chain.custom_samplers = [(0, self)]
            chain.sample = self._draw_for(handle)
            return
        for sampler in others:
            llama_cpp.llama_sampler_chain_add(handle, sampler)
        chain.custom_samplers = [(0, self)] + [(index + 1, custom) for index, custom in chain.custom_samplers]

    def _draw_for(self, handle: Any) -> Any:
        """``LlamaSampler.sample(ctx, idx)`` for the chain ``handle`` where this sampler is its only one, drawing: the
        draw llama.cpp's ``llama_sampler_sample`` makes through the chain, from the context's logits row."""
        draw, head = sample_function(), ctypes.addressof(self._sampler)
        calls = ctypes.byref(self._calls)

        def sample(ctx: Any, idx: int = -1) -> int:
            return draw(head, handle, ctx.ctx, idx, calls)

        return sample

    def error(self) -> Optional[ValueError]:
        """The failure of the generation's steps so far, if any."""
        return state_error(self.state)
