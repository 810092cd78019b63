"""The eos column a row of logits must carry so that a sampler's softmax, after its division by the row's
temperature T, is the head's step distribution: what HF generation and both vLLM runners write.

q_T = softmax(ζ) with ζ_v = z_v / T (v ≠ eos) and ζ_eos the head's effective eos logit
(:func:`nmst_fast.decoding.effective_logits`), so the row keeps its non-eos logits and gets
eos = T·ζ_eos. The V-wide part is L_T = logsumexp over non-eos of z / T; the rest is per-row scalars.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

import torch

from ..head_math import head_terms, nmst_log_survival, st_step_survival
from ..kernels.cpu import row_kernels
from ..settings import HeadSettings
from .distribution import RowBuffer, exp_sum, row_blocks

# ζ_eos − L is the logit of α_t; beyond this (α_t = 1 in float32) it is held here so that float32
# stays finite and p(eos) rounds to 1.
MAX_EOS_LOGIT_GAP = 200.0

def cpu_kernels(rows: torch.Tensor) -> Optional[Any]:
    """The CPU row kernels (:mod:`nmst_fast.kernels.cpu`) where they take ``rows`` (float32 CPU with unit
    column stride) and could be built, else None."""
    if rows.device.type == "cpu" and rows.dtype == torch.float32 and rows.stride(1) == 1:
        return row_kernels()
    return None


def tempered_non_eos_lse(rows: torch.Tensor, eos: int, inverse: Optional[torch.Tensor] = None,
                         buffer: Optional[RowBuffer] = None) -> torch.Tensor:
    """(A,) float64 logsumexp over every column but ``eos`` of ``rows`` (A, V) times ``inverse`` (A,)
    (1/T per row, float64; None: 1). **May overwrite ``rows``' eos column** (the caller writes that column
    afterwards; read it first).

    Float32 CPU rows with unit column stride go to the CPU row kernel
    (:mod:`nmst_fast.kernels.cpu`: per row its max, then Σ 2^((z − max)·log₂e/T), nothing written).
    Elsewhere, or where that kernel could not be built, torch ops compute the same by blocks of rows
    (:func:`~nmst_fast.decoding.distribution.row_blocks`), the eos column set to −inf: the max kept apart
    in float64, then Σ e^((z − max)/T) (:func:`~nmst_fast.decoding.distribution.exp_sum`) in one reused
    ``buffer`` (None: a fresh one)."""
    kernels = cpu_kernels(rows)
    if kernels is not None:
        return kernels.non_eos_lse(rows, eos, None if inverse is None else inverse.double().contiguous())
    rows.select(1, eos).fill_(-math.inf)
    buffer = buffer if buffer is not None else RowBuffer()
    out = []
    for block in row_blocks(rows):
        part = rows[block]
        shift = part.amax(dim=1, keepdim=True).nan_to_num(0.0, 0.0, 0.0)  # −inf / NaN / +inf rows stay so
        shifted = torch.sub(part, shift, out=buffer.get(*part.shape, part.dtype, part.device))
        scale = None if inverse is None else inverse[block]
        offset = shift.view(-1).double()
        out.append(exp_sum(shifted, scale).double().log_().add_(offset if scale is None else offset * scale))
    return out[0] if len(out) == 1 else torch.cat(out)


def host_to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A step's small host list (row indices, temperatures, steps) as a tensor on ``device``. On CUDA it
    goes through pinned memory with a non-blocking copy: a copy from pageable memory waits for all the
    device's queued work, a host sync every step."""
    host = torch.tensor(list(values), dtype=dtype)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def inverse_temperatures(temperatures: Sequence[float], device: torch.device) -> Optional[torch.Tensor]:
    """(A,) float64 1/T per row, or None when every T is 1 (no scaling pass)."""
    if all(t == 1.0 for t in temperatures):
        return None
    return host_to_device([1.0 / t for t in temperatures], torch.float64, device)


def host_eos_value(settings: HeadSettings, L: float, s: float, t: int, temperature: float,
                   before: float = 0.0) -> tuple[Optional[float], float]:
    """One row by the library's float formulas: (its new eos logit T·ζ_eos, or None when the row keeps
    its logits; ST's running sum after step t, ``before`` passed on when the row keeps its logits).
    A row keeps its logits when it has no distribution (NaN, no finite non-eos logit), when another
    control banned eos (−inf: it stays banned) or left eos as the only finite logit (it stays certain)."""
    if math.isnan(L) or math.isnan(s) or L == math.inf or s == -math.inf or L == -math.inf:
        return None, before
    if settings.head == "nmst":
        log_survival, after = nmst_log_survival(s, t, settings.eps), before
    else:
        log_survival, after = st_step_survival(before, s, t, settings.eps)
    _, eos_zeta, _ = head_terms(L, log_survival)
    return temperature * min(eos_zeta, L + MAX_EOS_LOGIT_GAP), after


def device_eos_values(settings: HeadSettings, lse: torch.Tensor, eos_logits: torch.Tensor,
                      steps: Union[torch.Tensor, Sequence[int]], temperatures: Sequence[float],
                      before: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The rows' new eos column (A,) in ``eos_logits``' dtype, computed on their device with no read
    back, and ST's running sums after the step (A,) float64 (None for NMST). ``lse`` (A,) float64 L_T,
    ``eos_logits`` (A,) the rows' eos logits s, ``steps`` t per row (a tensor on the device, or ints),
    ``before`` ST's sums before the step (None: 0). Rows that keep their logits (see
    :func:`host_eos_value`) get s back and pass ``before`` on."""
    device = lse.device
    s = eos_logits.double()
    t = steps if isinstance(steps, torch.Tensor) else host_to_device(steps, torch.int64, device)
    live = (lse.abs() < math.inf) & (s > -math.inf)  # False for NaN, ±inf L and s = NaN or −inf
    after = None
    if settings.head == "nmst":
        log_survival = nmst_log_survival(s, t, settings.eps)
    else:
        if before is None:
            before = torch.zeros_like(s)
        log_survival, after = st_step_survival(before, s, t, settings.eps)
        after = torch.where(live, after, before)  # a step without a distribution adds nothing
    _, eos_zeta, _ = head_terms(lse, log_survival)
    temperature = host_to_device(temperatures, torch.float64, device)
    value = torch.minimum(eos_zeta, lse + MAX_EOS_LOGIT_GAP) * temperature
    return torch.where(live, value, s).to(eos_logits.dtype), after


def write_eos_column(logits: torch.Tensor, settings: HeadSettings, step: int, temperature: float = 1.0,
                     state: Optional[torch.Tensor] = None,
                     buffer: Optional[RowBuffer] = None) -> Optional[torch.Tensor]:
    """Every row of ``logits`` (B, V) float32 / float64 at one decoding step t = ``step``: its eos entry becomes
    T·ζ_eos (in place), so that softmax(logits / T) is the head's step distribution at temperature T
    (``temperature``). ``state``: "st" only, the rows' running sums before the step ((B,) float64; None: 0).
    Returns ST's running sums after the step ((B,) float64; None for NMST). Rows without a distribution (NaN,
    no finite non-eos logit) and rows whose eos another control set to −inf keep their logits.

    On the CPU the row kernel does the row pass, the scalars and the write in one call
    (:mod:`nmst_fast.kernels.cpu`); elsewhere torch ops without a host read (:func:`device_eos_values`)."""
    B, eos = logits.shape[0], settings.eos_index
    st = settings.head == "st"
    kernels = cpu_kernels(logits)
    if kernels is not None:
        before = None
        if st:
            before = torch.zeros(B, dtype=torch.float64) if state is None else state.to("cpu", torch.float64)
        after = kernels.write_eos_column(logits, torch.arange(B), eos, torch.full((B,), float(temperature),
                                                                                  dtype=torch.float64),
                                         torch.full((B,), int(step), dtype=torch.int64), before, settings.eps,
                                         MAX_EOS_LOGIT_GAP)
        return after if st else None
    eos_logits = logits[:, eos].clone()  # read before the row pass may overwrite the column
    inverse = None if temperature == 1.0 else torch.full((B,), 1.0 / temperature, dtype=torch.float64,
                                                         device=logits.device)
    lse = tempered_non_eos_lse(logits, eos, inverse, buffer)
    column, after = device_eos_values(settings, lse, eos_logits, torch.full((B,), int(step), device=logits.device),
                                      [float(temperature)] * B, state)
    logits[:, eos] = column
    return after
