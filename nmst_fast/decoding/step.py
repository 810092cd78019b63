"""The decoding step: one token per row, its path chosen once, no host synchronization.

:class:`DecodingStep` is built once per (head, strategy, vocabulary size, device) and picks its path
then: the Triton kernels (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``) — greedy, sampling and
top-k (then top-p) in the one-launch split-V scan (``kernels/scan_select.py``), top-p alone by
rejection rounds (``kernels/row_draw.py``) — the C++ selection kernel on CPU (:mod:`.cpu_rows`; float32,
bfloat16 and float16 logits; every strategy, min-p included), or the torch path (``impl="torch"``, float64
logits, min-p on CUDA, or a CPU without the built kernels: :mod:`.host_rows` for greedy and for top-k of small
batches, :mod:`.selection` otherwise).

The kernels flag on the device the first row with no distribution and the first row the rejection
rounds left without a token. ``defer_checks=True`` collects the flags over calls for
:meth:`DecodingStep.check` (no host sync: a loop runs ahead of the GPU); otherwise a call reads its
own, as :func:`sample` does. The draws' RNG state lives on the device, seeded from the generator once
and advanced by each launch, so a deferred call can be captured in a CUDA graph (after one eager call)
and its replays draw afresh.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..backends import triton_available
from ..kernels.cpu import native_module
from ..kernels.host_math import NO_ROW
from ..validation import check_float_tensor, check_int
from .cpu_rows import KERNEL_DTYPES, CPURows
from .distribution import (
    INT64_MAX,
    INT64_MIN,
    Steps,
    check_head_args,
    check_state,
    effective_logits,
    no_distribution_message,
    step_values,
)
from .host_rows import MAX_ROWS, HostRows
from .selection import select
from .truncation import TOP_P_SLACK, active_min_p, check_truncation, untruncated


@dataclass
class StepOutput:
    """One decoding step's result for a batch of rows, on the logits' device: ``tokens`` (B,) int64;
    ``log_probs`` (B,) float64, log p of each under the untruncated step distribution; ``state`` (B,)
    float64, ST's running log(1 − α) after the step (None for NMST and VA)."""

    tokens: torch.Tensor
    log_probs: torch.Tensor
    state: Optional[torch.Tensor]


def check_impl(impl: object) -> None:
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")


def kernels_serve(impl: str, device: torch.device, top_k: Optional[int], min_p: Optional[float] = None) -> bool:
    """Whether the Triton kernels serve this strategy on ``device``: greedy, sampling, top-p alone and
    top-k (then top-p) with k up to ``row_scan.MAX_CANDIDATES``, without min-p. "auto" takes them on CUDA;
    "triton" insists (CPU tensors need ``TRITON_INTERPRET=1``)."""
    check_impl(impl)
    if impl == "torch" or (impl == "auto" and device.type != "cuda"):
        return False
    if active_min_p(min_p) is not None and top_k != 1:  # greedy keeps its one token whatever min_p is
        if impl == "triton":
            raise ValueError("impl='triton' does not serve min_p; use impl='torch' (or 'auto': the torch path on "
                             "CUDA, the C++ kernel on CPU)")
        return False
    servable = triton_available()  # greedy, sampling and top-p alone; top-k when the scan's list holds k
    if servable and top_k not in (None, 1):
        from nmst_fast.kernels.row_scan import HAS_TOPK, MAX_CANDIDATES  # lazy: Triton reads its mode at import
        servable = HAS_TOPK and top_k <= MAX_CANDIDATES
    if impl == "triton":
        if not servable:
            raise ValueError("impl='triton' serves top_k up to nmst_fast.kernels.row_scan.MAX_CANDIDATES (and needs "
                             f"tl.topk for truncation), got top_k={top_k}; use impl='torch'")
        if not (triton_available() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")):
            raise ValueError("impl='triton' needs CUDA logits (or TRITON_INTERPRET=1 for CPU tensors)")
        return True
    return servable


class DecodingStep:
    """Token selection for one (head, strategy, vocabulary size, device), set up once.

    Args:
        head: "nmst" | "st" | "va"; eos_index, eps: the head's (see :func:`nmst_fast.linear_nmst_loss`).
        vocab_size: V, the logits' width.
        device: where the logits live.
        top_k: keep the k most probable tokens (ties → lower index); ``top_k=1`` is greedy.
        top_p: keep the smallest most-probable set with mass >= p (after top-k, if both).
        min_p: keep the tokens whose probability is at least ``min_p`` times the most probable one's (after
            top-k and top-p, if given; 0 or None: off), as llama.cpp's, vLLM's and HF's min-p.
        temperature: divides non-eos logits (all logits for "va"); p(eos) of NMST/ST is unchanged.
        impl: "auto" (the Triton kernels on CUDA when they serve the strategy, see
            :func:`kernels_serve`; the C++ selection kernel on CPU; torch otherwise), "triton" or "torch"
            (torch ops only).
    """

    def __init__(self, *, head: str, eos_index: int, vocab_size: int, device: Union[str, torch.device] = "cpu",
                 eps: float = 1e-5, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 min_p: Optional[float] = None, temperature: float = 1.0, impl: str = "auto"):
        check_int("vocab_size", vocab_size, 2)  # eos and one other token
        check_head_args(head, eos_index, int(vocab_size), eps, temperature)
        check_truncation(top_k, top_p, min_p)
        self.head, self.eos_index, self.eps, self.temperature = head, int(eos_index), float(eps), float(temperature)
        self.vocab_size, self.device, self.top_k, self.top_p = int(vocab_size), torch.device(device), top_k, top_p
        self.min_p = active_min_p(min_p)
        self.kernels = kernels_serve(impl, self.device, top_k, self.min_p)
        self._greedy = top_k == 1
        plain = untruncated(top_k, top_p, self.min_p)
        # The kernels' truncation: top-k's list (None for greedy and sampling) and the top-p threshold
        # (p less the float64 slack the torch path allows; None: no top-p).
        self._list = None if plain else top_k
        self._threshold = top_p - TOP_P_SLACK if not plain and top_p is not None and top_p < 1.0 else None
        self._rejection = not plain and top_k is None  # top-p alone: the row draw
        # Greedy, and top-k of up to host_rows.MAX_ROWS rows, on the torch path: each row finished on the host.
        self._host_rows = None if top_k is None else HostRows(head=head, eos_index=self.eos_index, eps=self.eps,
                                                               temperature=self.temperature, top_k=top_k, top_p=top_p,
                                                               min_p=self.min_p)
        # (2,) int32 on the device: the rows the deferred calls flagged since the last check (NO_ROW: none).
        self._flags: Optional[torch.Tensor] = None
        # (3,) int64 on the device: the draws' RNG state (step_common.rng_state), seeded from _rng_source.
        self._rng: Optional[torch.Tensor] = None
        self._rng_source: Optional[torch.Generator] = None
        self._launch = None  # the kernel wrapper, imported at the first call (Triton reads its mode then)
        # "auto" on CPU: the C++ selection kernel (decoding/cpu_rows.py), set up at the first call (its build).
        self._cpu_rows: Optional[CPURows] = None
        self._cpu_rows_wanted = impl == "auto" and self.device.type == "cpu"

    def __call__(self, logits: torch.Tensor, *, steps: Steps = 1, state: Optional[torch.Tensor] = None,
                 generator: Optional[torch.Generator] = None, defer_checks: bool = False) -> StepOutput:
        """One token per row of ``logits`` (B, V) on the step's device.

        Args:
            steps: t of this step (int or (B,)); t <= 0 is context (p(eos) = 0).
            state: "st" only: (B,) running log(1−α) from the previous step (None at the start).
            generator: torch.Generator for reproducible draws.
            defer_checks: leave the kernels' flags for :meth:`check` (no host sync); a row without a
                distribution yields some column in [0, V) until then.
        """
        if self._cpu_rows is not None and type(steps) is int and INT64_MIN <= steps <= INT64_MAX:
            # A decoding loop's call on CPU: the kernel checks the logits, ST's state and the generator itself.
            picked = self._cpu_rows.unchecked(logits, steps, state, generator)
            if picked is not None:
                return StepOutput(*picked)
        self._check_logits(logits)
        if not self.kernels:
            return self._torch_step(logits, steps, state, generator)
        if defer_checks and self._flags is None:
            self._flags = torch.full((2,), NO_ROW, dtype=torch.int32, device=self.device)
        picked = self._kernel_step(logits, steps, state, generator, self._flags if defer_checks else None)
        if not (defer_checks or torch.compiler.is_compiling()):
            bad, unresolved = picked.flags.tolist()  # the call's one host sync
            if bad < logits.shape[0]:
                raise ValueError(no_distribution_message(bad, with_state=True))
            if unresolved < logits.shape[0]:
                # A row the rejection rounds left (P ≤ (1 − p)^64): the torch path draws the batch, on
                # CUDA ranking whole rows at once (one sort costs about one large torch.topk there).
                return self._torch_step(logits, steps, state, generator,
                                        first_size=self.vocab_size if logits.is_cuda else None)
        return StepOutput(picked.tokens, picked.log_probs, picked.state)

    def check(self) -> None:
        """Read the flags of the deferred calls since the last check (one host sync) and clear them;
        raise if a call had a row without a distribution (ValueError) or a row the top-p rounds left
        without a token (RuntimeError; probability ≤ (1 − p)^64 per row), naming the lowest such row."""
        if self._flags is None:
            return
        bad, unresolved = self._flags.tolist()
        if bad == NO_ROW and unresolved == NO_ROW:
            return
        self._flags.fill_(NO_ROW)
        if bad != NO_ROW:
            raise ValueError(f"a call since the last check: {no_distribution_message(bad, with_state=True)}")
        raise RuntimeError(f"a call since the last check: the top-p rejection rounds left row {unresolved} without "
                           "a token; decode with impl='torch' or without defer_checks")

    def _check_logits(self, logits: torch.Tensor) -> None:
        check_float_tensor("logits", logits)
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be (B, V={self.vocab_size}), got shape {tuple(logits.shape)}")
        if logits.device != self.device and not (self.device.type == logits.device.type and self.device.index is None):
            raise ValueError(f"logits are on {logits.device}, the decoding step on {self.device}")

    def _torch_step(self, logits: torch.Tensor, steps: Steps, state: Optional[torch.Tensor],
                    generator: Optional[torch.Generator], first_size: Optional[int] = None) -> StepOutput:
        if self._cpu_rows_wanted and logits.dtype in KERNEL_DTYPES:
            if self._cpu_rows is None:
                module = native_module()  # None where the kernels do not build: the torch path from then on
                if module is None:
                    self._cpu_rows_wanted = False
                    return self._torch_step(logits, steps, state, generator, first_size)
                self._cpu_rows = CPURows(module.select_rows, head=self.head, eos_index=self.eos_index,
                                         vocab_size=self.vocab_size, eps=self.eps, temperature=self.temperature,
                                         top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)
            return StepOutput(*self._cpu_rows(logits, steps, state, generator))
        if self._host_rows is not None and (self._greedy or logits.shape[0] <= MAX_ROWS):
            return StepOutput(*self._host_rows(logits, steps, state, generator))
        dist = effective_logits(logits, head=self.head, eos_index=self.eos_index, eps=self.eps, steps=steps,
                                state=state, temperature=self.temperature)
        tokens = select(dist, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, generator=generator,
                        first_size=first_size)
        return StepOutput(tokens, dist.token_log_probs(tokens), dist.state)

    def _kernel_step(self, logits: torch.Tensor, steps: Steps, state: Optional[torch.Tensor],
                     generator: Optional[torch.Generator], flags: Optional[torch.Tensor]):
        if self._launch is None:
            if self._rejection:
                from nmst_fast.kernels.row_draw import draw_rows
                self._launch = lambda *args, **kwargs: draw_rows(*args, **kwargs)[0]
            else:
                from nmst_fast.kernels.scan_select import scan_select
                self._launch = functools.partial(scan_select, top_k=self._list)
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        B, device = logits.shape[0], logits.device
        kernel_steps = 1 if self.head == "va" else step_values(steps, B, device)
        kernel_state = (check_state(state, B, device, values=False)  # the kernels flag bad values
                        if self.head == "st" and state is not None else None)
        seed = None if self._greedy else self._rng_state(generator)
        return self._launch(logits, head=self.head, eos_index=self.eos_index, eps=self.eps,
                            temperature=self.temperature, steps=kernel_steps, state=kernel_state, seed=seed,
                            top_p_threshold=self._threshold, flags=flags)

    def _rng_state(self, generator: Optional[torch.Generator]) -> torch.Tensor:
        """The kernels' RNG state, seeded from ``generator`` at the first draw and whenever the
        generator changes: the generator's state fixes every draw, and the launches advance it."""
        if self._rng is None or generator is not self._rng_source:
            from nmst_fast.kernels.step_common import rng_state

            dev = generator.device if generator is not None else self.device
            seed = torch.randint(0, 2**31 - 1, (1,), generator=generator, device=dev).to(self.device)
            self._rng, self._rng_source = rng_state(seed, self.device), generator
        return self._rng


@torch.no_grad()  # a draw, not a loss: logits straight from a model may require grad
def sample(
    logits: torch.Tensor,
    *,
    head: str,
    eos_index: int,
    eps: float = 1e-5,
    steps: Steps = 1,
    state: Optional[torch.Tensor] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    temperature: float = 1.0,
    generator: Optional[torch.Generator] = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One token per row of ``logits`` (B, V) from the head's step distribution, optionally truncated:
    a :class:`DecodingStep` built for these logits and called once (arguments as there).
    Returns (tokens (B,) int64, ST's new state or None).
    """
    check_float_tensor("logits", logits)  # before the backend choice reads logits.device
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if logits.dim() != 2:  # the step checks the rest (the head's arguments, V >= 2 with eos_index)
        raise ValueError(f"logits must be (B, V), got shape {tuple(logits.shape)}")
    step = DecodingStep(head=head, eos_index=eos_index, vocab_size=logits.shape[1], device=logits.device, eps=eps,
                        top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature, impl=impl)
    out = step(logits, steps=steps, state=state, generator=generator)
    return out.tokens, out.state
