"""Per-token statistics of the head's step distribution on materialized logits: the reference the fused pass's
statistics (:func:`nmst_fast.linear_nmst_loss_with_statistics`, :func:`nmst_fast.head_math.row_statistics`) are
tested against, and the entropy's gradient.

The head's step distribution is softmax(ζ) of its effective logits (:mod:`nmst_fast.decoding.distribution`):
ζ_v = y_v / T for v ≠ eos and ζ_eos = L + log(1 − e^a) − a for NMST / ST (a = log(1 − α_t), L the non-eos
logsumexp of y / T), ζ = y / T for VA. Here each chunk of rows forms its (rows, V) table with plain torch ops.
The fused pass hands over the entropy's values alone; where backward asks for its gradient (GRPO's entropy bonus),
:func:`entropy_with_gradient` recomputes each chunk with autograd then, one chunk's table at a time.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .head_math import head_terms, log_survival
from .logits import eos_logits, postprocess_logits

_CHUNK_ENTRIES = 1 << 24  # a chunk's (rows, V) table: 64 MiB in float32


def _chunk_statistics(h: torch.Tensor, a: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                      bias: Optional[torch.Tensor], head: str, eos_index: int, temperature: float,
                      softcap: Optional[float], logit_scale: Optional[float], dtype: torch.dtype):
    """(entropy, log Σ p², mean ζ, is_top1) of rows ``h`` (rows, H) whose a = log(1 − α_t) is ``a`` (rows,); the
    entropy differentiable, in ``dtype``."""
    z = postprocess_logits(F.linear(h.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)),
                           softcap, logit_scale)
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


def _log_survival_rows(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       steps: Optional[torch.Tensor], *, head: str, eos_index: int, eps: float,
                       softcap: Optional[float], logit_scale: Optional[float], dtype: torch.dtype) -> torch.Tensor:
    """a = log(1 − α_t) of every position of ``hidden`` (…, H) (ST's sum along the last axis of a (B, T, H) one),
    flat (N,); zeros for VA."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    if head == "va":
        return flat.new_zeros(flat.shape[0], dtype=dtype)
    s = eos_logits(flat, weight, bias, eos_index, softcap=softcap, logit_scale=logit_scale, dtype=dtype)
    T = hidden.shape[1] if hidden.dim() == 3 else 1
    return log_survival(head, s, steps.reshape(-1), eps, T)


def _chunk_rows(vocab_size: int) -> int:
    return max(1, _CHUNK_ENTRIES // vocab_size)


def materialized_statistics(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                            targets: torch.Tensor, steps: Optional[torch.Tensor], *, head: str, eos_index: int,
                            eps: float, temperature: float, softcap: Optional[float],
                            logit_scale: Optional[float]) -> torch.Tensor:
    """(N, 4) float64 per position of ``hidden`` (B, T, H) or (N, H): entropy, log Σ p², mean ζ and whether the
    target is the most probable token (1 / 0), computed in float64 on each chunk's materialized logits."""
    with torch.no_grad():
        dtype = torch.float64
        a = _log_survival_rows(hidden, weight, bias, steps, head=head, eos_index=eos_index, eps=eps,
                               softcap=softcap, logit_scale=logit_scale, dtype=dtype)
        rows, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        n = _chunk_rows(weight.shape[0])
        parts = [_chunk_statistics(rows[i:i + n], a[i:i + n], flat_targets[i:i + n], weight, bias, head, eos_index,
                                   temperature, softcap, logit_scale, dtype)
                 for i in range(0, rows.shape[0], n)]
        if not parts:
            return rows.new_zeros(0, 4, dtype=dtype)
        entropy, log_sum_sq, mean, is_top1 = (torch.cat(column) for column in zip(*parts))
        return torch.stack([entropy, log_sum_sq, mean, is_top1.to(dtype)], dim=1)


class _RecomputedEntropy(torch.autograd.Function):
    """The entropy's values as given; backward, where it runs, calls ``grads`` for the inputs' gradients."""

    @staticmethod
    def forward(ctx, values, hidden, weight, bias, grads: Callable):
        ctx.grads = grads
        ctx.save_for_backward(hidden, weight, bias)
        return values.clone()

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias = ctx.saved_tensors
        return (None, *ctx.grads(grad, hidden, weight, bias, ctx.needs_input_grad[1:4]), None)


def entropy_with_gradient(values: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                          bias: Optional[torch.Tensor], targets: torch.Tensor, steps: Optional[torch.Tensor],
                          mask: torch.Tensor, *, head: str, eos_index: int, eps: float, temperature: float,
                          softcap: Optional[float], logit_scale: Optional[float]) -> torch.Tensor:
    """``values`` (B, T), the entropy of each position of ``hidden`` (B, T, H) (0 where ``mask`` is False), with the
    entropy's gradient with respect to ``hidden``, ``weight`` and ``bias``: backward recomputes the masked rows'
    logits chunk by chunk with autograd, as an activation checkpoint would, only when a loss uses the entropy."""

    def grads(grad, hidden, weight, bias, wanted):
        with torch.enable_grad():
            leaves = [None if t is None else t.detach().requires_grad_(want)
                      for t, want in zip((hidden, weight, bias), wanted)]
            h, w, b = leaves
            dtype = torch.promote_types(h.dtype, torch.float32)
            a = _log_survival_rows(h, w, b, steps, head=head, eos_index=eos_index, eps=eps, softcap=softcap,
                                   logit_scale=logit_scale, dtype=dtype)
            index = mask.reshape(-1).nonzero().squeeze(1)
            a_rows = a[index]
            a_leaf = a_rows.detach().requires_grad_(a_rows.requires_grad)
            upstream = grad.reshape(-1)[index]
            flat_targets = targets.reshape(-1)[index]
            inputs = [t for t in (*leaves, a_leaf) if t is not None and t.requires_grad]
            n = _chunk_rows(w.shape[0])
            for i in range(0, index.shape[0], n):
                j = i + n
                rows = h.reshape(-1, h.shape[-1])[index[i:j]]
                entropy = _chunk_statistics(rows, a_leaf[i:j], flat_targets[i:j], w, b, head, eos_index, temperature,
                                            softcap, logit_scale, dtype)[0]
                torch.autograd.backward(entropy, upstream[i:j].to(entropy.dtype), inputs=inputs)
            if a_leaf.grad is not None:
                torch.autograd.backward(a_rows, a_leaf.grad, inputs=[t for t in leaves if t is not None
                                                                     and t.requires_grad])
        return tuple(None if t is None or not want or t.grad is None else t.grad.to(t.dtype)
                     for t, want in zip(leaves, wanted))

    return _RecomputedEntropy.apply(values, hidden, weight, bias, grads)
