"""The exact one-step distribution of a head, as *effective logits*.

For NMST/ST, p(eos) = α_t and p(v≠eos) = (1−α_t)·softmax_{v≠eos}(z)_v. With a = log(1−α_t) and
L = logsumexp_{v≠eos} z_v, that is exactly softmax(ζ) with

    ζ_v = z_v  (v ≠ eos),      ζ_eos = L + log(1 − e^a) − a,      logsumexp(ζ) = L − a.

So every decoder is ordinary softmax decoding on ζ, which differs from the raw logits in one entry.
Temperature τ (NMST/ST) divides the non-eos logits only: p(eos), and with it the termination
guarantee, is unchanged. For VA it divides every logit.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..head_math import head_terms, nmst_log_survival, st_step_survival
from ..validation import HEADS, check_choice, check_eps, check_float_tensor, check_index, check_temperature

Steps = Union[int, torch.Tensor]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the range of one int t, as the kernels hold it


@dataclass
class StepDistribution:
    """One decoding step's distribution for a batch of rows.

    Attributes:
        zeta: (B, V) effective logits, float32 (float64 for float64 input); for NMST/ST its eos
            column is not ζ_eos and may hold anything.
        log_norm: (B,) float64 logsumexp(ζ); log p(v) = ζ_v − log_norm.
        eos_index: the eos column.
        eos_zeta: (B,) float64 ζ_eos, by which every reader ranks and weighs eos (None for "va").
        eos_log_prob: (B,) float64 log p(eos) = log(1 − e^a) as is (None for "va"): ζ_eos − log_norm
            differs by L's rounding, which broke exact ties between beams with the same p(eos).
        state: (B,) float64 running log(1−α_t) for "st" (None for other heads).
    """

    zeta: torch.Tensor
    log_norm: torch.Tensor
    eos_index: int
    eos_zeta: Optional[torch.Tensor]
    eos_log_prob: Optional[torch.Tensor]
    state: Optional[torch.Tensor]

    def token_log_probs(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B,) float64 log p of one token per row, without forming the (B, V) table."""
        log_p = self.zeta.gather(1, tokens.unsqueeze(1)).squeeze(1) - self.log_norm  # float64 by promotion
        if self.eos_log_prob is not None:
            log_p = torch.where(tokens == self.eos_index, self.eos_log_prob, log_p)
        return log_p

    def log_probs(self, rows: slice = slice(None)) -> torch.Tensor:
        """(R, V) float64 log p of ``rows`` (default: every row)."""
        log_p = self.zeta[rows] - self.log_norm[rows].unsqueeze(1)  # float64 by promotion: one (R, V) buffer
        if self.eos_log_prob is not None:
            log_p[:, self.eos_index] = self.eos_log_prob[rows]
        return log_p


def step_values(steps: Steps, batch: int, device: torch.device) -> Steps:
    """t as every path takes it: one int (fitting int64, as the kernels hold it) or a (batch,) int64
    tensor on ``device``; a TypeError or ValueError naming steps otherwise."""
    if isinstance(steps, numbers.Integral) and not isinstance(steps, bool):
        if not INT64_MIN <= int(steps) <= INT64_MAX:
            raise ValueError(f"steps must fit in int64, got {int(steps)}")
        return int(steps)
    if not isinstance(steps, torch.Tensor) or steps.dtype.is_floating_point or steps.dtype == torch.bool:
        raise TypeError(f"steps must be an int or an integer tensor, got {type(steps).__name__}")
    try:
        return torch.broadcast_to(steps.to(device), (batch,)).long()
    except RuntimeError as err:
        raise ValueError(f"steps of shape {tuple(steps.shape)} does not broadcast to the batch ({batch},)") from err


def check_head_args(head: object, eos_index: object, vocab_size: int, eps: object, temperature: object) -> None:
    """The head's arguments, for logits of ``vocab_size`` columns (checked by the caller)."""
    check_choice("head", head, HEADS)
    check_index("eos_index", eos_index, vocab_size, "V")
    check_eps(eps)
    check_temperature(temperature)


def check_state(state: object, batch: int, device: torch.device, *, values: bool = True) -> torch.Tensor:
    """ST's state as every path accepts it: a floating (B,) tensor (moved to ``device``) of
    log(1 − α) ≤ 0 (−inf: eos certain). ``values=False``: no NaN / positive check (the kernels flag
    such rows on the device)."""
    if not isinstance(state, torch.Tensor) or not state.dtype.is_floating_point:
        raise TypeError("state must be a floating tensor (ST's running log(1 − α) from the previous step)")
    if state.shape != (batch,):
        raise ValueError(f"state must have shape ({batch},), got {tuple(state.shape)}")
    if values:
        invalid = (state.isnan() | (state > 0)).nonzero()
        if invalid.numel():
            row = int(invalid[0, 0])
            raise ValueError(f"state row {row} is {float(state[row])}: ST's state is a log(1 − α), <= 0 and not NaN")
    return state.to(device)


def eos_terms(
    non_eos_lse: torch.Tensor, eos_logit: torch.Tensor, *, head: str, eps: float, steps: Steps,
    state: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The NMST/ST head's per-row scalars from L and the raw eos logit s (both (B,) float64), rows
    checked first: (log_norm, ζ_eos, log p(eos) (see :func:`head_terms`), ST's next state or None).
    a = log(1 − α_t) is NMST's logσ(−s) + t·log1p(−ε), or ST's state + logσ(s) + log1p(−ε) (state 0
    at the start), which is also its next state; context rows (t <= 0): a = 0, ST's state passes."""
    check_rows(non_eos_lse, eos_logit)
    B = eos_logit.shape[0]
    t = step_values(steps, B, eos_logit.device)  # one int t stays an int: no (B,) tensor of it
    if head == "nmst":
        log_surv, next_state = nmst_log_survival(eos_logit, t, eps), None
    else:
        prev = torch.zeros(B, dtype=torch.float64, device=eos_logit.device) if state is None else \
            check_state(state, B, eos_logit.device).to(torch.float64)
        log_surv, next_state = st_step_survival(prev, eos_logit, t, eps)
    return (*head_terms(non_eos_lse, log_surv), next_state)


def check_rows(non_eos_lse: torch.Tensor, eos_logit: Optional[torch.Tensor] = None) -> None:
    """NaN or +inf logits, or rows with no finite non-eos logit, have no defined distribution."""
    if torch.compiler.is_compiling():
        return
    # One read for the usual case: a finite sum of every L (float64) and clamped eos logit (NaN stays NaN).
    total = non_eos_lse.sum() if eos_logit is None else non_eos_lse.sum() + eos_logit.clamp(-1.0, 1.0).sum()
    if math.isfinite(total):
        return
    bad = ~torch.isfinite(non_eos_lse)
    if eos_logit is not None:
        bad |= torch.isnan(eos_logit)
    if bool(bad.any()):
        raise ValueError(no_distribution_message(int(bad.nonzero()[0, 0])))


def no_distribution_message(row: int, *, with_state: bool = False) -> str:
    """The error for a row with no distribution (``with_state``: the kernels judged its ST state too)."""
    state = ", or its ST state is NaN or positive" if with_state else ""
    return f"logits row {row} has NaN/+inf values or no finite non-eos logit{state}: no distribution to decode"


def effective_logits(
    logits: torch.Tensor,
    *,
    head: str,
    eos_index: int,
    eps: float = 1e-5,
    steps: Steps = 1,
    state: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
) -> StepDistribution:
    """ζ for one step of ``logits`` (B, V), which are not modified (``zeta`` shares their memory when
    they are float32/float64 and temperature is 1: no (B, V) copy).

    Args:
        steps: t of this step (int or (B,)); t <= 0 is context (p(eos) = 0).
        state: "st" only: (B,) running log(1−α) after the previous step (None: start, 0).
    """
    check_float_tensor("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits must be (B, V), got shape {tuple(logits.shape)}")
    if logits.shape[1] < 2:
        raise ValueError(f"logits must have V >= 2 (eos and one other token), got V={logits.shape[1]}")
    check_head_args(head, eos_index, logits.shape[1], eps, temperature)
    zeta = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()  # never written to
    if temperature != 1.0:
        zeta = zeta / temperature  # eos's column too, but for NMST/ST that column is not read
    if head == "va":
        lse = _row_logsumexp(zeta)
        check_rows(lse)
        return StepDistribution(zeta, lse, eos_index, None, None, None)

    s = logits[:, eos_index].double()  # the raw eos logit: temperature leaves it alone
    lse = _row_logsumexp(zeta, without=eos_index)
    log_norm, eos_zeta, eos_log_prob, next_state = eos_terms(lse, s, head=head, eps=eps, steps=steps, state=state)
    return StepDistribution(zeta, log_norm, eos_index, eos_zeta, eos_log_prob, next_state)


def _row_logsumexp(values: torch.Tensor, without: Optional[int] = None) -> torch.Tensor:
    """(B,) float64 logsumexp of each row of ``values`` (B, V) over every column but ``without`` (one
    per side of it, views, combined in float64), by :func:`row_blocks`. Each side is
    max + log Σ e^(x − max) with the max kept apart in float64: a float32 ``torch.logsumexp`` rounds
    L to float32 (1e-3 at |z| ~ 1e4), which broke exact top-p cuts."""
    def side(part: torch.Tensor) -> torch.Tensor:
        shift = part.amax(dim=1, keepdim=True).nan_to_num(0.0, 0.0, 0.0)  # −inf / NaN / +inf rows stay so
        return exp_sum(part - shift).double().log_().add_(shift.view(-1))

    def one_block(block: torch.Tensor) -> torch.Tensor:
        parts = (block,) if without is None else (block[:, :without], block[:, without + 1:])
        sides = [side(part) for part in parts if part.shape[1]]
        return sides[0] if len(sides) == 1 else torch.logaddexp(sides[0], sides[1])

    blocks = row_blocks(values)
    return one_block(values) if len(blocks) == 1 else torch.cat([one_block(values[rows]) for rows in blocks])


LOG2E = 1.4426950408889634


def exp_sum(shifted: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B,) Σ e^(c·d) over each row of ``shifted`` d = x − max (B, n), overwritten; ``scale`` c (B,) per
    row (None: 1), in the pass that forms the exponent. On CPU as Σ 2^(c·d·log2 e): its exp2 costs a
    third of its exp (fp32, 50k entries, AVX-512: 15 against 42 µs) at the same ~1e-7 relative error
    (d is formed first: x·log2 e − max·log2 e would cancel)."""
    on_cpu = shifted.device.type == "cpu"
    if scale is not None:
        shifted.mul_((scale * LOG2E if on_cpu else scale).to(shifted.dtype)[:, None])
    elif on_cpu:
        shifted.mul_(LOG2E)
    return (shifted.exp2_() if on_cpu else shifted.exp_()).sum(dim=1)


class RowBuffer:
    """One (rows, n) buffer reused across calls: grown when a call needs more rows, made anew when the
    width, dtype or device changes."""

    def __init__(self) -> None:
        self._buffer: Optional[torch.Tensor] = None

    def get(self, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A (rows, width) buffer (its contents undefined)."""
        buffer = self._buffer
        if (buffer is None or buffer.shape[0] < rows or buffer.shape[1] != width or buffer.dtype != dtype
                or buffer.device != device):
            buffer = self._buffer = torch.empty(rows, width, dtype=dtype, device=device)
        return buffer if buffer.shape[0] == rows else buffer.narrow(0, 0, rows)


# CPU work on (B, V) tensors goes by blocks of rows of about this many entries: a float64 temporary
# of a block (16 MB) stays under glibc's largest mmap threshold, so it is recycled from the heap rather
# than mapped and page-faulted afresh each call (top-p 0.9 and sampling 2–3× faster at 256 × 50257).
BLOCK_ENTRIES = 1 << 21


def row_blocks(table: torch.Tensor) -> list[slice]:
    """Slices covering the rows of ``table`` (B, V): on CPU blocks of at most BLOCK_ENTRIES entries (one
    row at least; one empty slice for an empty batch), elsewhere the whole table (allocators cache)."""
    B, V = table.shape
    if table.device.type != "cpu":
        return [slice(0, B)]
    per_block = max(1, BLOCK_ENTRIES // max(1, V))
    return [slice(start, min(B, start + per_block)) for start in range(0, B, per_block)] or [slice(0, 0)]


def step_log_probs(
    logits: torch.Tensor,
    *,
    head: str,
    eos_index: int,
    eps: float = 1e-5,
    steps: Steps = 1,
    state: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Exact log-distribution (B, V) float64 of one decoding step, and ST's new state (None for NMST/VA)."""
    dist = effective_logits(logits, head=head, eos_index=eos_index, eps=eps, steps=steps, state=state,
                            temperature=temperature)
    return dist.log_probs(), dist.state
