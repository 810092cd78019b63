"""O(N) per-row head math for the fused paths: losses and logit-gradient coefficients.

The V-wide part of every head reduces to three per-row scalars, computed by the
split-softmax row pass: L = logsumexp over non-eos logits, s = z_eos, and z_y
(the target's logit). Everything head-specific happens here, on (N,) vectors,
in float64 (cheap at O(N), and it keeps t·log1p(−ε) exact for t up to 1e7).

The gradient of the summed, weighted loss Σ_r w_r ℓ_r with respect to a row's
logits always has the same shape, which lets one row kernel serve every head:

    dℓ/dz_v = coef_L · exp(z_v − L)     for v ≠ eos
    dℓ/dz_e = grad_s
    dℓ/dz_y += grad_target              (added at the target column, eos included)

The closed forms below are derived from the spec (and checked against autograd
through :mod:`nmst_fast.reference` by the tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .logmath import log1mexp, log_sigmoid, segmented_cumsum

_F64 = torch.float64

# a = −inf (eos certain) would make L − a and ζ_eos inf − inf; any a below this is 1 − α = 0 in float64.
LOG_SURVIVAL_FLOOR = -1e300


@dataclass
class GradCoefficients:
    """Per-row coefficients of the logit gradient, each (N,) float64. ``filter_scale``: what the gradient filter
    measures |dz| against, the rows' largest |coef_lse| (None: coef_lse's own; a vocabulary shard's coefficients,
    rescaled to its own L, carry the whole vocabulary's, so that every shard filters as one process would)."""

    coef_lse: torch.Tensor
    grad_eos: torch.Tensor
    grad_target: torch.Tensor
    filter_scale: Optional[torch.Tensor] = None

    def rows(self, start: int, stop: int) -> "GradCoefficients":
        return GradCoefficients(self.coef_lse[start:stop], self.grad_eos[start:stop], self.grad_target[start:stop])

    def largest(self) -> torch.Tensor:
        """The filter's scale: ``filter_scale``, or the rows' largest |coef_lse| (0-dim float64)."""
        return self.coef_lse.abs().max() if self.filter_scale is None else self.filter_scale


def _along_time(x: torch.Tensor, seq_len: int) -> torch.Tensor:
    # (B·T,) → (B, T); explicit rows, since view(-1, 0) is ambiguous for an empty T.
    return x.view(x.numel() // seq_len if seq_len else 0, seq_len)


def _zero_like(x: Union[torch.Tensor, float]) -> Union[torch.Tensor, float]:
    return torch.zeros_like(x) if isinstance(x, torch.Tensor) else 0.0


def nmst_log_survival(s: Union[torch.Tensor, float], steps: Union[int, torch.Tensor], eps: float):
    """NMST's log(1 − α_t) = logσ(−s) + t·log1p(−ε), float64; 0 at context rows (t <= 0).
    ``steps``: t per row, or one int t for every row (a decoding step: no (N,) tensor of it); ``s``
    (N,), or one row's float (then ``steps`` is its int t)."""
    value = log_sigmoid(-s)
    if isinstance(steps, int):  # context (t <= 0): 0 even where s = +inf makes logσ(−s) = −inf
        return value + steps * math.log1p(-eps) if steps >= 1 else _zero_like(value)
    return torch.where(steps >= 1, value + steps.to(_F64) * math.log1p(-eps), 0.0)


def st_step_term(s: Union[torch.Tensor, float], eps: float):
    """One step's addend to ST's running log(1 − α): logσ(s) + log1p(−ε), float64 (a tensor or a
    float, as ``s``)."""
    return log_sigmoid(s) + math.log1p(-eps)


def st_step_survival(prev: Union[torch.Tensor, float], s: Union[torch.Tensor, float],
                     steps: Union[int, torch.Tensor], eps: float):
    """ST at one decoding step: (log(1 − α_t), the running sum after the step) from the running sum
    ``prev`` before it; context rows (t <= 0) get 0 and pass ``prev`` on. (B,) float64 tensors with an
    int or (B,) ``steps``, or one row's floats with its int t."""
    running = prev + st_step_term(s, eps)
    if isinstance(steps, int):
        return (running, running) if steps >= 1 else (_zero_like(prev), prev)
    live = steps >= 1
    return torch.where(live, running, 0.0), torch.where(live, running, prev)


def log_survival(head: str, s: torch.Tensor, steps: torch.Tensor, eps: float, seq_len: int) -> torch.Tensor:
    """log(1 − α_t) per row (N,) float64; 0 at context rows (t <= 0).

    "st" accumulates along T, so its rows must be laid out (B, T) flat with ``seq_len`` = T;
    its running sum restarts at every t = 1 (a new sequence of a packed row), as in the reference.
    """
    if head == "nmst":
        return nmst_log_survival(s, steps, eps)
    active = steps >= 1
    per_step = torch.where(active, st_step_term(s, eps), 0.0)
    value = segmented_cumsum(_along_time(per_step, seq_len), _along_time(steps == 1, seq_len)).reshape(-1)
    return torch.where(active, value, 0.0)


def row_losses(
    head: str,
    lse: torch.Tensor,
    s: torch.Tensor,
    z_target: torch.Tensor,
    targets_eos: torch.Tensor,
    log_surv: torch.Tensor | None,
) -> torch.Tensor:
    """Per-row NLL (N,) float64 (not yet masked for ignored rows).

    ``targets_eos`` is a bool mask of rows whose target is eos; ``z_target`` must
    hold s on those rows.
    """
    lse, s, z_target = lse.to(_F64), s.to(_F64), z_target.to(_F64)
    if head == "va":
        return torch.logaddexp(lse, s) - z_target
    return torch.where(targets_eos, -log1mexp(log_surv), -(log_surv + z_target - lse))


def eos_logit_grads(
    head: str,
    s: torch.Tensor,
    log_surv: torch.Tensor,
    targets_eos: torch.Tensor,
    row_weight: torch.Tensor,
    steps: torch.Tensor,
    seq_len: int,
) -> torch.Tensor:
    """d(Σ w ℓ)/ds per row for "nmst"/"st" (N,) float64.

    Needs only s, never L, so the fused pass can have it before touching V-wide data.
    For "st", row t's s enters log(1−α) of every later row of its sequence (up to the next
    t = 1, where the running sum restarts), so its gradient is a reverse running sum of
    dℓ/d log(1−α) along T, restarted at the same places.
    """
    s = s.to(_F64)
    active = steps >= 1
    # dℓ/d log(1−α): eos target: ℓ = −log(1 − e^a) → 1/expm1(−a); other targets: ℓ = −a − … → −1.
    # Context rows have a constant a = 0 and pass on no gradient (their eos NLL is inf).
    d_loss_d_surv = torch.where(targets_eos, 1.0 / torch.expm1(-torch.where(active, log_surv, -1.0)), -1.0)
    d_loss_d_surv = torch.where(active, d_loss_d_surv * row_weight.to(_F64), 0.0)
    if head == "nmst":
        # a = logσ(−s) + t log1p(−ε):  da/ds = −σ(s)
        return -torch.sigmoid(s) * d_loss_d_surv
    # a_t = Σ_{t' <= t} logσ(s_t') + … (t' in t's sequence):  d a_t / d s_t' = σ(−s_t') for those t'.
    per_seq = _along_time(d_loss_d_surv, seq_len)
    from_later_rows = segmented_cumsum(per_seq, _along_time(steps == 1, seq_len), reverse=True).reshape(-1)
    return torch.where(active, torch.sigmoid(-s) * from_later_rows, 0.0)


def grad_coefficients(
    head: str,
    lse: torch.Tensor,
    s: torch.Tensor,
    targets_eos: torch.Tensor,
    row_weight: torch.Tensor,
    eos_grads: torch.Tensor | None,
) -> GradCoefficients:
    """Coefficients of d(Σ w ℓ)/dz for a block of rows (see module docstring).

    ``eos_grads`` is :func:`eos_logit_grads` for those rows ("nmst"/"st"), None for "va".
    """
    w = row_weight.to(_F64)
    if head == "va":
        lse, s = lse.to(_F64), s.to(_F64)
        # softmax over all V: exp(z_v − LSE) = exp(z_v − L) · σ(L − s); its eos entry is σ(s − L).
        return GradCoefficients(coef_lse=w * torch.sigmoid(lse - s), grad_eos=w * torch.sigmoid(s - lse),
                                grad_target=-w)
    # Non-eos targets: ℓ = −a − z_y + L, so the non-eos part is the split softmax minus one-hot.
    non_eos_weight = torch.where(targets_eos, 0.0, w)
    return GradCoefficients(coef_lse=non_eos_weight, grad_eos=eos_grads, grad_target=-non_eos_weight)


def head_terms(non_eos_lse, log_surv):
    """(log_norm = L − a, ζ_eos = L + log(1 − e^a) − a, log p(eos) = log(1 − e^a)) from L and
    a = log(1 − α_t): (B,) float64 tensors (float32 ones: the floor is float32's lowest), or one row's floats."""
    if isinstance(log_surv, torch.Tensor):
        floored = log_surv.clamp(min=max(LOG_SURVIVAL_FLOOR, torch.finfo(log_surv.dtype).min))
    else:
        floored = max(log_surv, LOG_SURVIVAL_FLOOR)
    eos_log_prob = log1mexp(log_surv)
    return non_eos_lse - floored, non_eos_lse + eos_log_prob - floored, eos_log_prob


def row_statistics(head: str, lse: torch.Tensor, s: torch.Tensor, log_surv: torch.Tensor | None, sums: torch.Tensor,
                   vocab_size: int, eos_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token statistics of the head's distribution softmax(ζ) from a row pass's sums: (entropy, log Σ p²,
    the mean of ζ, the most probable token), each (N,), float64 but the last (int64; ties to the lower index).

    ζ_v = y_v for v ≠ eos (the logits as the row pass sees them: a temperature folded in), ζ_eos = L + log(1 − e^a)
    − a for NMST / ST (−inf where a = 0: the mean then averages the other V − 1), ζ_eos = s for VA. ``sums`` (N, 5)
    float64 is the row pass's ``statistics``: Σ q·y, Σ q², Σ y (q_v = e^(y_v − L), the non-eos softmax), the max of
    the non-eos y and its first column. With x = e^a (1 for VA but through L's merge with s): p_v = x·q_v, so
    −Σ p log p = −p_eos log p_eos − x·(Σ q·y − log_norm) and Σ p² = p_eos² + x²·Σ q²."""
    lse, s = lse.to(_F64), s.to(_F64)
    weighted, squares, total, top, column = sums.unbind(1)
    column = column.long()
    if head == "va":
        all_lse = torch.logaddexp(lse, s)
        log_norm, eos_zeta, eos_log_prob = all_lse, s, s - all_lse
        survival = torch.exp(lse - all_lse)  # the non-eos share of the mass
        mean = (total + s) / vocab_size
    else:
        log_norm, eos_zeta, eos_log_prob = head_terms(lse, log_surv.to(_F64))
        survival = torch.exp(lse - log_norm)
        mean = torch.where(log_surv == 0, total / (vocab_size - 1), (total + eos_zeta) / vocab_size)
    eos_term = torch.where(torch.isneginf(eos_log_prob), 0.0, eos_log_prob.exp() * eos_log_prob)
    # Σ_{v≠eos} p_v log p_v = x·Σ q_v (y_v − log_norm), Σ q = 1
    entropy = -eos_term - torch.where(survival == 0, 0.0, survival * (weighted - log_norm))
    log_sum_sq = torch.logaddexp(2 * eos_log_prob, torch.log(squares) + 2 * (lse - log_norm))
    best_log_prob = top - log_norm
    eos_first = (eos_log_prob > best_log_prob) | ((eos_log_prob == best_log_prob) & (eos_index < column))
    return entropy, log_sum_sq, mean, torch.where(eos_first, eos_index, column)
