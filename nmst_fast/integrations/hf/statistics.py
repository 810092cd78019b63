"""Per-token statistics of the head's distribution that TRL's trainers log or regularize with:
entropy, log Σ p², the mean effective logit and whether the label is the most probable token.

The head's step distribution is softmax(ζ) of its effective logits (:mod:`nmst_fast.decoding.distribution`):
ζ_v = y_v / T for v ≠ eos and ζ_eos = L + log(1 − e^a) − a for NMST / ST (a = log(1 − α_t), L the non-eos
logsumexp of y / T), ζ = y / T for VA. These need a V-wide pass of their own (the fused loss keeps only L,
s and the target's logit), so they are computed here in chunks of rows with plain torch ops; the entropy
keeps its gradient (GRPO's entropy bonus) by recomputing each chunk in backward (activation checkpointing),
so no (rows, V) table outlives its chunk.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ...decoding.distribution import head_terms
from ...head_math import log_survival
from ...logits import eos_logits, postprocess_logits

_CHUNK_ENTRIES = 1 << 24  # a chunk's (rows, V) table: 64 MiB in float32


def _chunk_statistics(h: torch.Tensor, a: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                      bias: Optional[torch.Tensor], head: str, eos_index: int, temperature: float,
                      softcap: Optional[float], logit_scale: Optional[float], dtype: torch.dtype):
    z = postprocess_logits(F.linear(h, weight, bias).to(dtype), softcap, logit_scale)
    y = z / temperature
    if head == "va":
        zeta = y
        log_p = y - torch.logsumexp(y, dim=-1, keepdim=True)
        no_eos_mass = torch.zeros_like(a, dtype=torch.bool)
    else:
        is_eos = torch.arange(y.shape[-1], device=y.device) == eos_index
        lse = torch.logsumexp(y.masked_fill(is_eos, float("-inf")), dim=-1)
        a = a.to(dtype)
        log_norm, eos_zeta, log_p_eos = head_terms(lse, a)  # log p(eos) −inf where t <= 0 (no eos mass)
        log_p = torch.where(is_eos, log_p_eos[:, None], y - log_norm[:, None])
        zeta = torch.where(is_eos, eos_zeta[:, None], y)
        no_eos_mass = a == 0
    finite_log_p = torch.where(torch.isneginf(log_p), 0.0, log_p)  # p log p = 0 at p = 0, with a finite gradient
    entropy = -(log_p.exp() * finite_log_p).sum(dim=-1)
    with torch.no_grad():
        log_sum_sq = torch.logsumexp(2 * log_p, dim=-1)
        is_top1 = log_p.argmax(dim=-1) == targets  # ties: the lowest index, as TRL's
        V = zeta.shape[-1]
        if head == "va":
            mean = zeta.mean(dim=-1)
        else:  # without eos mass ζ_eos is −inf: the mean of the other V − 1
            non_eos_sum = zeta.masked_fill(is_eos, 0.0).sum(dim=-1)
            mean = torch.where(no_eos_mass, non_eos_sum / (V - 1), (non_eos_sum + zeta[:, eos_index]) / V)
    return entropy, log_sum_sq, mean, is_top1


def head_statistics(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                    steps: torch.Tensor, mask: torch.Tensor, *, head: str, eos_index: int, eps: float,
                    temperature: float, softcap: Optional[float], logit_scale: Optional[float],
                    outputs: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The ``outputs`` among "entropy", "log_sum_sq_probs", "mean_logits", "is_top1" for every position of
    (B, T) ``targets`` (0 / False where ``mask`` is False), at temperature T with the sampling semantics.

    Args:
        hidden: (B, T, H) hidden states; weight (V, H), bias (V,) or None: the output layer; the logits are
            softcap·tanh(logit_scale·z / softcap) as in :func:`nmst_fast.linear_nmst_loss`.
        steps: (B, T) int t of each position; ST's running sum goes along T and restarts at t = 1.
        mask: (B, T) bool, the positions to compute (the supervised ones).
    Returns:
        (B, T) tensors: entropy in at least float32 (differentiable), log_sum_sq_probs and mean_logits
        likewise (no gradient), is_top1 bool.
    """
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    a_all = None
    if head != "va":
        s = eos_logits(hidden, weight, bias, eos_index, softcap=softcap, logit_scale=logit_scale, dtype=dtype)
        B, T = steps.shape
        a_all = log_survival(head, s.reshape(-1), steps.reshape(-1), eps, T).view(B, T)
    rows, row_targets = hidden[mask], targets[mask]
    a_rows = a_all[mask] if a_all is not None else rows.new_zeros(rows.shape[0], dtype=dtype)
    per_chunk = max(1, _CHUNK_ENTRIES // weight.shape[0])
    needs_grad = torch.is_grad_enabled() and "entropy" in outputs and any(
        t is not None and t.requires_grad for t in (rows, weight, bias, a_rows))
    parts = []
    for start in range(0, rows.shape[0], per_chunk):
        args = (rows[start:start + per_chunk], a_rows[start:start + per_chunk], row_targets[start:start + per_chunk],
                weight, bias, head, eos_index, temperature, softcap, logit_scale, dtype)
        parts.append(checkpoint(_chunk_statistics, *args, use_reentrant=False) if needs_grad
                     else _chunk_statistics(*args))
    if parts:
        entropy, log_sum_sq, mean, is_top1 = (torch.cat(column) for column in zip(*parts))
    else:
        entropy = log_sum_sq = mean = rows.new_zeros(0, dtype=dtype)
        is_top1 = torch.zeros(0, dtype=torch.bool, device=rows.device)
    if not needs_grad:
        entropy = entropy.detach()
    values = dict(entropy=entropy, log_sum_sq_probs=log_sum_sq, mean_logits=mean, is_top1=is_top1)
    return {name: values[name].new_zeros(mask.shape).masked_scatter(mask, values[name]) for name in outputs}
