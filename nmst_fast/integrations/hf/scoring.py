"""The one scoring core: labels under the head, on a model's output layer.

:func:`score_labels` is what every integration that scores tokens calls — the patched forward (the training
loss), TRL's trainers (per-token log-probabilities and statistics) and lm-eval (log-likelihoods): the decoder
stack's last hidden state and the labels in the class's layout go in; the head's NLL of each label (or their
sum or mean) comes out of :func:`nmst_fast.linear_nmst_loss`, so the (B, T, V) logits are never formed. The
step t of each label comes from the labels (t = 1 at each sequence's first supervised token, packed rows'
``position_ids`` restarting it) or from the training context the settings fix, unless the caller gives it.
It runs inside the output layer's own call, so FSDP2 / ZeRO-3 gather the layer's weight around it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ...loss import STATISTICS, linear_nmst_loss, linear_nmst_loss_with_statistics
from ...settings import HeadSettings
from ...statistics import entropy_with_gradient
from ...validation import check_int_tensor, check_temperature
from .steps import scored_steps
from .structure import check_output_weight, in_output_layer, linear_of, logit_postprocessing, output_layer


@dataclass
class LabelScores:
    """What :func:`score_labels` returns.

    Attributes:
        nll: the head's NLL, in at least float32: (B, T') per target (0 where the label is ignored) for
            reduction "none", else the sum or the mean over the scored targets (a scalar).
        targets: (B, T') the scored labels (-100: ignored), position i of the hidden states scoring column i.
        steps: (B, T') int64 t of each target.
        mask: (B, T') bool, the targets that are scored.
        statistics: name -> (B, T') tensor of the asked :data:`STATISTICS` (0 / False where not scored).
    """

    nll: torch.Tensor
    targets: torch.Tensor
    steps: torch.Tensor
    mask: torch.Tensor
    statistics: dict[str, torch.Tensor] = field(default_factory=dict)


def score_labels(model: Any, hidden: torch.Tensor, labels: torch.Tensor, settings: HeadSettings, *, shifted: bool,
                 steps: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                 position_ids: Optional[torch.Tensor] = None, temperature: float = 1.0, reduction: str = "none",
                 dtype: Optional[torch.dtype] = None, impl: Optional[str] = None,
                 statistics: tuple[str, ...] = (), steps_name: str = "steps") -> LabelScores:
    """The head's NLL of ``labels`` on ``model``'s output layer.

    Args:
        model: a ``…ForCausalLM`` (its output layer, logit post-processing and ``_nmst_impl``).
        hidden: (B, T, H) the decoder stack's last hidden state on the input ids.
        labels: (B, T) int, -100 ignored: with ``shifted``, aligned with the input ids (position i scores
            ``labels[:, i + 1]``, as most causal LMs shift); without, position i scores ``labels[:, i]``.
        settings: the head.
        steps: (B, T) int t of each label, aligned with ``labels``; None: :func:`~.steps.scored_steps` (from the
            labels, or from the positions, the attention mask or the column under a fixed ``context_length``).
        attention_mask, position_ids: the forward's, for the step rules (packed rows restart t).
        temperature: T with the sampling semantics (non-eos logits / T for NMST/ST, every logit for VA).
        reduction: "none" (per target), "sum" or "mean" (over the scored targets; what training takes: its
            gradient is formed in the same pass).
        dtype: run the head in this dtype (hidden, weight and bias cast, autocast off); None: as they come.
        impl: the fused loss's backend; None: the model's (``apply_nmst(impl=)``), else "auto".
        statistics: names from :data:`STATISTICS` to compute too, from the same pass over the logits (reduction
            "none" only); the entropy keeps its gradient (:func:`nmst_fast.statistics.entropy_with_gradient`).
        steps_name: what errors call ``steps`` (the caller's argument name).
    """
    check_temperature(temperature)
    unknown = set(statistics) - set(STATISTICS)
    if unknown:
        raise ValueError(f"unknown statistics {sorted(unknown)}: the head gives {list(STATISTICS)}")
    if statistics and reduction != "none":
        raise ValueError(f"statistics come per target: reduction must be 'none', got {reduction!r}")
    if labels.shape != hidden.shape[:2]:
        raise ValueError(f"labels must be (B, T)={tuple(hidden.shape[:2])} like input_ids, got {tuple(labels.shape)}")
    labels = labels.to(hidden.device)
    if steps is None:
        steps = scored_steps(labels, settings, shifted=shifted, attention_mask=attention_mask,
                             position_ids=position_ids)
    else:
        check_int_tensor(steps_name, steps)
        if steps.shape != labels.shape:
            raise ValueError(f"{steps_name} must be (B, T)={tuple(labels.shape)} aligned with labels, "
                             f"got {tuple(steps.shape)}")
        steps = steps.to(hidden.device)
    if shifted:  # token i+1 is the target at position i
        hidden, labels, steps = hidden[:, :-1], labels[:, 1:], steps[:, 1:]
    mask = labels != -100
    layer = output_layer(model, check_weight=False)  # the weight is read inside the layer's call alone
    softcap, scale = logit_postprocessing(model.config)
    head = settings.head
    common = dict(eos_index=settings.eos_index, eps=settings.eps, head=head, softcap=softcap, logit_scale=scale,
                  temperature=temperature, impl=impl or getattr(model, "_nmst_impl", "auto"))
    grad_filter = getattr(model, "_nmst_grad_filter", None)  # apply_nmst's (the statistics' pass has no gradient)

    def compute(h: torch.Tensor):
        linear = linear_of(layer)
        check_output_weight(model, linear)
        weight, bias = linear.weight, linear.bias
        if dtype is not None:
            h, weight = h.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        context = torch.autocast(h.device.type, enabled=False) if dtype is not None else contextlib.nullcontext()
        head_steps = None if head == "va" else steps
        stats = {}
        with context:
            if statistics:
                nll, stats = _with_statistics(h, weight, bias, labels, head_steps, mask, head == "st", common)
            elif reduction != "none" or head == "st":  # every row: ST's running sum goes along T
                nll = linear_nmst_loss(h, weight, labels, bias=bias, steps=head_steps, reduction=reduction,
                                       grad_filter=grad_filter, **common)
            else:  # the scored rows alone
                rows = linear_nmst_loss(h[mask], weight, labels[mask], bias=bias,
                                        steps=None if head_steps is None else head_steps[mask], reduction="none",
                                        grad_filter=grad_filter, **common)
                nll = rows.new_zeros(mask.shape).masked_scatter(mask, rows)
            if reduction == "none":
                nll = nll.to(torch.promote_types(nll.dtype, torch.float32))
            if "entropy" in stats and torch.is_grad_enabled() and any(
                    t is not None and t.requires_grad for t in (h, weight, bias)):
                stats["entropy"] = entropy_with_gradient(
                    stats["entropy"], h, weight, bias, labels, steps, mask, head=head, eos_index=settings.eos_index,
                    eps=settings.eps, temperature=temperature, softcap=softcap, logit_scale=scale)
        return nll, {name: stats[name] for name in statistics}

    nll, stats = in_output_layer(layer, hidden, compute)
    return LabelScores(nll=nll, targets=labels, steps=steps, mask=mask, statistics=stats)


def _with_statistics(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                     steps: Optional[torch.Tensor], mask: torch.Tensor, every_row: bool,
                     common: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The NLL (B, T) and the :data:`STATISTICS` (B, T) (0 / False off ``mask``; entropy, log Σ p² and the mean in at
    least float32, without gradients) of one pass: every row where ``every_row`` (ST), else the scored rows."""
    if every_row:
        nll, stats = linear_nmst_loss_with_statistics(h, weight, labels, bias=bias, steps=steps, **common)
    else:
        rows, row_stats = linear_nmst_loss_with_statistics(
            h[mask], weight, labels[mask], bias=bias, steps=None if steps is None else steps[mask], **common)
        nll = rows.new_zeros(mask.shape).masked_scatter(mask, rows)
        stats = {name: value.new_zeros(mask.shape).masked_scatter(mask, value) for name, value in row_stats.items()}
    dtype = torch.promote_types(h.dtype, torch.float32)
    return nll, {name: value if value.dtype == torch.bool else value.to(dtype) for name, value in stats.items()}
