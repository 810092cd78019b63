"""TRL's trainers on the head: SFT, DPO, KTO, GRPO and RLOO score a patched model's NMST / ST / VA head.

Every TRL trainer that scores tokens calls ``trl.trainer.utils.add_fused_lm_head(model, temperature=…,
cast_lm_head_to_fp32=…, outputs=…)`` at construction (on the base model under PEFT, and on DPO's, KTO's
and RLOO's reference model), which replaces ``model.forward`` with a fused log-softmax over the output
layer's raw logits: the patched loss would never run. :func:`wrap_trl_utils` wraps that function when
``trl.trainer.utils`` is imported (``import nmst_fast`` installs the hook, :mod:`nmst_fast.integrations.hooks`;
this module itself is imported only then): for a model patched by ``apply_nmst`` — or one whose config records a
head, which is patched first — it installs :func:`add_head_outputs` instead; every other model gets TRL's own.
The user's trainer classes stay unchanged: no subclass, no flag.

What the trainers then see (``model(..., labels=…, fused_lm_head=True)`` → ``FusedCausalLMOutput``):

* ``log_probs``: each label's log-probability under the head, through the fused loss
  (:func:`nmst_fast.linear_nmst_loss` with ``reduction="none"``: no (B, T, V) logits), with t from the
  labels (t = 1 at each sequence's first supervised token, as the patched forward: SFT's completion
  masks, DPO's completion_mask, packed rows whose ``position_ids`` restart; ST's sum restarts there too);
* ``temperature`` (GRPO, RLOO) with the sampling semantics: non-eos logits / T, p(eos) unchanged; the
  policy's HF ``generate`` at TRL's temperature samples the same distribution (it decodes the head:
  :mod:`nmst_fast.integrations.hf.generation`);
* ``entropy``, ``is_top1``, ``log_sum_sq_probs`` and ``mean_logits`` of the head's distribution (the mean
  of its effective logits ζ, whose softmax it is: the raw logits / T for VA), from the same pass over the
  logits as the log-probabilities (:func:`nmst_fast.linear_nmst_loss_with_statistics`: no second product);
  ``entropy`` is differentiable (GRPO's entropy bonus: backward then recomputes the logits,
  :func:`nmst_fast.statistics.entropy_with_gradient`);
* ``loss``: −Σ log_probs / (``num_items_in_batch`` or the label count), plus the MoE load-balancing term
  when the config asks for router logits, as TRL's own.

Where that is not possible the trainer's construction raises ``ValueError`` naming NMST: a TRL outside
:data:`SUPPORTED_TRL`.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from typing import Any, Optional

import torch
from trl.trainer.utils import FusedCausalLMOutput

from ..settings import HeadSettings
from ..validation import check_temperature
from .hf import STATISTICS, apply_nmst, decoder_hidden, has_head, patched_call, score_labels
from .hf.patch import signature_with

SUPPORTED_TRL = ("1.16.0", "1.17.0")  # [lowest, first unsupported): the releases these hooks are tested with
_UTILS = "trl.trainer.utils"
_WRAPPED = "_nmst_wraps"


# --- finding TRL's call -----------------------------------------------------------------------------

def wrap_trl_utils(utils: types.ModuleType) -> None:
    """Replace ``add_fused_lm_head`` in TRL's utils and in every loaded TRL module that imported it."""
    original = getattr(utils, "add_fused_lm_head", None)
    if original is None:
        _refuse_in_trainers(f"this TRL ({_trl_version()}) has no trl.trainer.utils.add_fused_lm_head")
        return
    if hasattr(original, _WRAPPED):
        return

    @functools.wraps(original)
    def add_fused_lm_head(model, *args, **kwargs):
        if not _has_head(model):
            return original(model, *args, **kwargs)
        bound = inspect.signature(original).bind(model, *args, **kwargs)
        bound.apply_defaults()
        _check_trl_version()
        named = dict(bound.arguments)
        named.pop("model")
        return add_head_outputs(model, **named)

    setattr(add_fused_lm_head, _WRAPPED, original)
    for module in [utils] + [m for name, m in list(sys.modules.items()) if name.startswith("trl.") and m is not None]:
        if getattr(module, "add_fused_lm_head", None) is original:
            module.add_fused_lm_head = add_fused_lm_head


def _trl_version() -> str:
    return getattr(sys.modules.get("trl"), "__version__", "unknown")


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _check_trl_version() -> None:
    version = _trl_version()
    lowest, beyond = (_version_tuple(v) for v in SUPPORTED_TRL)
    if not lowest <= _version_tuple(version) < beyond:
        raise ValueError(f"NMST head: TRL {version} is not supported (supported: >= {SUPPORTED_TRL[0]}, "
                         f"< {SUPPORTED_TRL[1]}); its trainers would score the model's raw softmax instead of the "
                         f"head. Install trl>={SUPPORTED_TRL[0]},<{SUPPORTED_TRL[1]}")


def _refuse_in_trainers(reason: str) -> None:
    """A TRL without the function the hook wraps: its trainers refuse a patched model at construction."""
    import transformers

    trainer = transformers.Trainer
    if getattr(trainer.__init__, _WRAPPED, None) is not None:
        return
    init = trainer.__init__

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        model = kwargs.get("model", args[0] if args else None)
        if type(self).__module__.startswith("trl.") and model is not None and _has_head(_base_model(model)):
            raise ValueError(f"NMST head: {reason}; its trainers would score the model's raw softmax instead of "
                             f"the head. Install trl>={SUPPORTED_TRL[0]},<{SUPPORTED_TRL[1]}")
        init(self, *args, **kwargs)

    checked_init._nmst_wraps = init
    trainer.__init__ = checked_init


def _base_model(model: Any) -> Any:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _has_head(model: Any) -> bool:
    """Whether ``model`` decodes a head: patched by ``apply_nmst``, or its config records one (a reference
    model loaded from a saved run of nmst-fast 0.1: patched here with the recorded settings)."""
    if has_head(model):
        return True
    config = getattr(model, "config", None)
    if not getattr(config, "nmst", None) or isinstance(model, str):
        return False
    apply_nmst(model)
    return True


# --- the head's outputs ---------------------------------------------------------------------------

def add_head_outputs(model: Any, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                     outputs: tuple[str, ...] = ("log_probs",)) -> None:
    """TRL's fused-LM-head contract on a model patched by ``apply_nmst``, answered by the head.

    ``model(..., labels=…, shift_labels=…, num_items_in_batch=…, fused_lm_head=True)`` returns TRL's
    ``FusedCausalLMOutput`` (per-token fields (B, T − 1), or (B, T) with ``shift_labels``, zero where the
    label is −100); without ``fused_lm_head`` the call goes to the patched forward. ``temperature`` also
    sets the policy's HF generation to sample the head at T (see the module docstring)."""
    check_temperature(temperature)
    unknown = set(outputs) - {"log_probs", *STATISTICS}
    if unknown:
        raise ValueError(f"outputs: unknown field(s) {sorted(unknown)} for the NMST head")
    previous = model.__dict__.get("_nmst_unfused_forward") or model.forward
    model._nmst_unfused_forward = previous
    model._nmst_trl = dict(temperature=float(temperature), cast_lm_head_to_fp32=bool(cast_lm_head_to_fp32),
                           outputs=tuple(outputs))

    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                **kwargs):
        if not fused_lm_head:
            for name, value in (("labels", labels), ("shift_labels", shift_labels),
                                ("num_items_in_batch", num_items_in_batch)):
                if value is not None:
                    kwargs[name] = value
            return self._nmst_unfused_forward(*args, **kwargs)
        if args:
            raise TypeError("NMST head: fused_lm_head=True takes keyword arguments only (input_ids=…, labels=…)")
        with patched_call():
            return head_outputs(self, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch,
                                **self._nmst_trl, **kwargs)

    forward.__signature__ = signature_with(inspect.signature(previous),
                                           ("fused_lm_head", "shift_labels", "num_items_in_batch"))
    model.forward = types.MethodType(forward, model)


def head_outputs(model: Any, *, labels: Optional[torch.Tensor], shift_labels: Optional[torch.Tensor],
                 num_items_in_batch: Any, temperature: float, cast_lm_head_to_fp32: bool, outputs: tuple[str, ...],
                 **named: Any):
    """TRL's ``FusedCausalLMOutput`` for one call of a patched model (see :func:`add_head_outputs`).

    ``labels`` (B, T) aligned with ``input_ids`` (position i scores ``labels[:, i + 1]``), or ``shift_labels``
    (B, T) already shifted (position i scores ``shift_labels[:, i]``); ``named``: the model's other forward
    arguments (input_ids, attention_mask, position_ids, …). Scored by
    :func:`~nmst_fast.integrations.hf.score_labels`."""
    if (labels is None) == (shift_labels is None):
        raise ValueError("NMST head: fused_lm_head=True needs exactly one of labels= and shift_labels=")
    settings = HeadSettings.from_recorded(model.config.nmst)
    text_config = model.config.get_text_config()
    router = bool(getattr(text_config, "output_router_logits", False))
    if router:
        named.setdefault("output_router_logits", True)
    named.pop("nmst_steps", None)
    out, hidden = decoder_hidden(model, **named)
    scores = score_labels(model, hidden, shift_labels if labels is None else labels, settings,
                          shifted=labels is not None, attention_mask=named.get("attention_mask"),
                          position_ids=named.get("position_ids"), temperature=temperature,
                          dtype=torch.float32 if cast_lm_head_to_fp32 else None,
                          statistics=tuple(name for name in STATISTICS if name in outputs))
    log_probs, mask = -scores.nll, scores.mask
    divisor = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -log_probs.sum() / divisor
    aux_loss = None
    if router:
        aux_loss = _load_balancing_loss(out, text_config, named.get("attention_mask"))
        loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
    return FusedCausalLMOutput(loss=loss, log_probs=log_probs, label_mask=mask, aux_loss=aux_loss,
                               **{name: scores.statistics.get(name) for name in STATISTICS})


def _load_balancing_loss(out: Any, text_config: Any, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The MoE load-balancing loss of the decoder's router logits, the one transformers' MoE families share."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return load_balancing_loss_func(out.router_logits, text_config.num_experts, text_config.num_experts_per_tok,
                                    attention_mask)


wrap_trl_utils(sys.modules[_UTILS])  # TRL is imported by now (above); idempotent
