"""The readable reference: the NMST / ST / VA math (README, "How it works"; Conventions below) on materialized logits,
and truncated sampling from the resulting distribution.

This module is the spec every fast path is tested against. It is written for
clarity, works in any floating dtype (float64 for tests), and is differentiable
with plain autograd. It materializes the full (…, V) tensor, so it is not meant
for large vocabularies in training.

Conventions (shared by every backend):
  * ``steps`` t is the position's step; t = 1 at the first token after the context.
  * t <= 0 marks a context position: p(eos) = 0 there (as in the paper's code),
    so log p(v) = z_v − L, and for "st" it adds nothing to the running sum.
  * "st"'s running sum restarts at every t = 1: a packed row holding several sequences
    (each 1, 2, …, n, context between them or not) gives each one the values it has alone.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .logits import postprocess_logits
from .logmath import log1mexp, segmented_cumsum


def reference_log_survival(
    eos_logits: torch.Tensor, steps: torch.Tensor, *, eps: float, head: str
) -> torch.Tensor:
    """log(1 − α_t) for every position; shape of ``eos_logits``; 0 at context positions.

    For "st" the running sum goes along the last dimension of ``eos_logits`` and restarts at
    every position with t = 1 (from the row start when there is none).
    """
    active = steps >= 1
    if head == "nmst":
        value = F.logsigmoid(-eos_logits) + steps.to(eos_logits.dtype) * math.log1p(-eps)
    elif head == "st":
        per_step = F.logsigmoid(eos_logits) + math.log1p(-eps)
        value = segmented_cumsum(torch.where(active, per_step, torch.zeros_like(per_step)), steps == 1)
    else:
        raise ValueError(f"head must be 'nmst' or 'st' here, got {head!r}")
    return torch.where(active, value, torch.zeros_like(value))


def nmst_log_probs(
    logits: torch.Tensor,
    *,
    eos_index: int,
    eps: float = 1e-5,
    head: str = "nmst",
    steps: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Full log-distribution log p(v) of the chosen head, shape (…, V), dtype of ``logits``.

    Args:
        logits: (B, T, V) or flat (N, V) logits z = W h (+ b).
        eos_index: vocabulary index e of eos.
        eps: ε in (0, 1) of the NMST/ST heads (unused for "va").
        head: "nmst", "st" or "va".
        steps: integer t per position, broadcastable to ``logits.shape[:-1]``.
            Default for (B, T, V): 1..T along T. Flat logits need it for "nmst";
            "st" needs the (B, T, V) layout (its running sum goes along T).
        temperature: T > 0, with the sampling semantics of :func:`nmst_fast.decoding.sample`: it divides
            the non-eos logits only for "nmst"/"st" (p(eos) does not depend on it), every logit for "va".
    """
    from .validation import (
        HEADS,
        check_choice,
        check_eps,
        check_float_tensor,
        check_index,
        check_temperature,
        expand_steps,
    )

    check_choice("head", head, HEADS)
    check_temperature(temperature)
    check_float_tensor("logits", logits)
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must be (B, T, V) or (N, V), got shape {tuple(logits.shape)}")
    check_eps(eps)
    V = logits.shape[-1]
    check_index("eos_index", eos_index, V, "V")
    if head == "va":
        return torch.log_softmax(logits / temperature, dim=-1)
    if head == "st" and logits.dim() != 3:
        raise ValueError("head='st' needs (B, T, V) logits: its running sum goes along T")
    steps = expand_steps(steps, logits[..., 0], head, layout_3d=logits.dim() == 3)

    is_eos = torch.arange(V, device=logits.device) == eos_index
    non_eos_logits = (logits / temperature).masked_fill(is_eos, float("-inf"))
    non_eos_log_softmax = non_eos_logits - torch.logsumexp(non_eos_logits, dim=-1, keepdim=True)
    log_survival = reference_log_survival(logits[..., eos_index], steps, eps=eps, head=head)
    log_p = log_survival.unsqueeze(-1) + non_eos_log_softmax
    log_p_eos = log1mexp(log_survival)  # -inf at context positions, where p(eos) = 0
    return torch.where(is_eos, log_p_eos.unsqueeze(-1), log_p)


def reference_linear_nmst_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    eos_index: int,
    eps: float,
    head: str,
    steps: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    ignore_index: int,
    reduction: str,
    logits_dtype: Optional[torch.dtype] = None,
    softcap: Optional[float] = None,
    logit_scale: Optional[float] = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """NLL of ``targets`` under :func:`nmst_log_probs` (at ``temperature``) of
    y = softcap·tanh(logit_scale·z / softcap), z = ``hidden @ weight.T + bias`` (y = logit_scale·z without a
    softcap; a missing scale is 1).

    Arguments are already validated by the public entry point. ``logits_dtype``: the dtype the
    log-probabilities are computed in (default: the projection's own; autocast's caller takes fp32).
    """
    logits = F.linear(hidden, weight, bias)
    if logits_dtype is not None:
        logits = logits.to(logits_dtype)
    logits = postprocess_logits(logits, softcap, logit_scale)
    log_p = nmst_log_probs(logits, eos_index=eos_index, eps=eps, head=head, steps=steps, temperature=temperature)
    active = targets != ignore_index
    # gather takes int64 indices; targets may come in any integer dtype.
    safe_targets = torch.where(active, targets, torch.zeros_like(targets)).long()
    nll = -log_p.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)
    nll = torch.where(active, nll, torch.zeros_like(nll))
    if reduction == "none":
        return nll
    total = nll.sum()
    if reduction == "sum":
        return total
    return total / active.sum().clamp(min=1).to(total.dtype)


# Truncated sampling, the target of the decoding tests and the baseline of the selection benchmarks:
# the (B, V) distribution materialized and fully sorted, which the decoding paths avoid.


def truncated_distribution(log_probs: torch.Tensor, top_k: Optional[int], top_p: Optional[float],
                           min_p: Optional[float] = None) -> torch.Tensor:
    """(B, V) float64 probabilities after top-k, top-p and min-p truncation and renormalization.

    Ranks by probability with ties → lower index (a stable descending sort), keeps
    the first k, renormalizes, then keeps the shortest prefix whose mass reaches p, then the
    tokens whose (untruncated) probability is at least ``min_p`` times the most probable one's.
    """
    log_probs = log_probs.to(torch.float64)
    order = torch.sort(log_probs, dim=1, descending=True, stable=True).indices
    probs = torch.exp(log_probs.gather(1, order))
    untruncated = probs.clone()
    if top_k is not None:
        probs[:, top_k:] = 0.0
        probs = probs / probs.sum(dim=1, keepdim=True)
    if top_p is not None and top_p < 1.0:
        mass_before = torch.cumsum(probs, dim=1) - probs
        keep = mass_before < top_p - 1e-12
        keep[:, 0] = True
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(dim=1, keepdim=True)
    if min_p is not None and min_p > 0:
        probs = torch.where(untruncated >= min_p * untruncated[:, :1], probs, 0.0)
        probs = probs / probs.sum(dim=1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def sort_based_sample(
    log_probs: torch.Tensor,
    *,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Draw one token per row (B,) from the truncated distribution."""
    return torch.multinomial(truncated_distribution(log_probs, top_k, top_p, min_p), 1,
                             generator=generator).squeeze(1)
