"""Token selection of a decoding step on CPU rows by the C++ kernel ``select_rows`` (``kernels/cpu/select_rows.cpp``):
greedy, sampling, top-k, top-p, min-p and their combinations for the NMST, ST and VA heads, each row in a few vectorized
passes over its logits (no sort of the vocabulary), the head's scalars in float64.

The draws take one float64 uniform per row from the caller's CPU generator (the kernel draws them as ``torch.rand``
would), so seeded runs reproduce; greedy draws none. float32, bfloat16 and float16 logits are served (the latter two
read as float32); float64 logits, and every row where the kernels are not built, go the torch path.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .distribution import Steps, check_state, no_distribution_message, step_values
from .truncation import TOP_P_SLACK, active_min_p

_HEADS = {"nmst": 0, "st": 1, "va": 2}
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CPURows:
    """One strategy's selection on CPU rows; ``select``: the extension module's ``select_rows``
    (:func:`nmst_fast.kernels.cpu.native_module`); the other arguments as :class:`nmst_fast.decoding.DecodingStep`'s."""

    def __init__(self, select: Callable[..., Any], *, head: str, eos_index: int, vocab_size: int, eps: float,
                 temperature: float, top_k: Optional[int], top_p: Optional[float], min_p: Optional[float] = None):
        self.select, self.head, self.eos_index, self.vocab_size = select, head, eos_index, vocab_size
        self.eps, self.temperature = eps, temperature
        self.top_k = 0 if top_k is None else int(top_k)
        self.cut = 2.0 if top_p is None or top_p >= 1.0 else float(top_p) - TOP_P_SLACK
        self.min_p = active_min_p(min_p) or 0.0

    def unchecked(self, logits: object, step: int, state: object,
                  generator: object) -> Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
        """:meth:`__call__`'s result at one int ``step`` for every row, or None where ``logits`` is not a 2-D CPU
        float32, bfloat16 or float16 tensor of V columns, ST's ``state`` is neither None nor a contiguous (B,) float64
        CPU tensor of values <= 0, or ``generator`` is neither None nor a torch.Generator: the kernel checks its
        arguments itself, so a decoding loop's call reads none of the tensors' attributes from Python (each such read
        cost microseconds where a forward pass had evicted the caches); the caller's checks then name what is wrong."""
        return self._select(logits, None, step, state, generator)

    def __call__(self, logits: torch.Tensor, steps: Steps, state: Optional[torch.Tensor],
                 generator: Optional[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(tokens (B,) int64, log p (B,) float64 of each under the untruncated step distribution, ST's next state
        (B,) float64 or None) for ``logits`` (B, V) on the CPU, of a dtype in KERNEL_DTYPES (checked by the caller)."""
        B = logits.shape[0]
        t = step_values(steps, B, logits.device) if self.head != "va" else 1
        per_row, step = (None, t) if isinstance(t, int) else (t.contiguous(), 0)
        before = None
        if self.head == "st" and state is not None:
            before = check_state(state, B, logits.device).double().contiguous()
        picked = self._select(logits, per_row, step, before, generator)
        if picked is None:  # the logits are checked: the generator is not one
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        return picked

    def _select(self, logits: object, per_row: Optional[torch.Tensor], step: int, state: object,
                generator: object) -> Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
        """The kernel's call (None where it declines an argument), raising on the first row with no distribution."""
        out = self.select(logits, self.vocab_size, _HEADS[self.head], self.eos_index, self.eps, self.temperature,
                          per_row, step, state, self.top_k, self.cut, self.min_p, generator)
        if out is None:
            return None
        tokens, log_probs, states, first_bad = out
        if first_bad >= 0:
            raise ValueError(no_distribution_message(first_bad))
        return tokens, log_probs, states
