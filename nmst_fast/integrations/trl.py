"""TRL's trainers on the head: SFT, DPO, KTO, GRPO and RLOO score a patched model's NMST / ST / VA head.

Every TRL trainer that scores tokens calls ``trl.trainer.utils.add_fused_lm_head(model, temperature=…,
cast_lm_head_to_fp32=…, outputs=…)`` at construction (on the base model under PEFT, and on DPO's, KTO's
and RLOO's reference model), which replaces ``model.forward`` with a fused log-softmax over the output
layer's raw logits: the patched loss would never run. :func:`watch_trl` (called by
:func:`nmst_fast.integrations.hf.apply_nmst`) wraps that function, when ``trl.trainer.utils`` is imported
or at once if it already is: for a model patched by ``apply_nmst`` — or one whose config records a head,
which is patched first — it installs :func:`add_head_outputs` instead; every other model gets TRL's own.
The user's trainer classes stay unchanged: no subclass, no flag.

What the trainers then see (``model(..., labels=…, fused_lm_head=True)`` → ``FusedCausalLMOutput``):

* ``log_probs``: each label's log-probability under the head, through the fused loss
  (:func:`nmst_fast.linear_nmst_loss` with ``reduction="none"``: no (B, T, V) logits), with t from the
  labels (t = 1 at each sequence's first supervised token, as the patched forward: SFT's completion
  masks, DPO's completion_mask, packed rows whose ``position_ids`` restart; ST's sum restarts there too);
* ``temperature`` (GRPO, RLOO) with the sampling semantics: non-eos logits / T, p(eos) unchanged; the
  policy's HF ``generate`` samples the same distribution (its step log-probs are emitted for that T);
* ``entropy``, ``is_top1``, ``log_sum_sq_probs`` and ``mean_logits`` of the head's distribution (the mean
  of its effective logits ζ, whose softmax it is: the raw logits / T for VA), from a second chunked pass
  over the supervised rows; ``entropy`` is differentiable (GRPO's entropy bonus);
* ``loss``: −Σ log_probs / (``num_items_in_batch`` or the label count), plus the MoE load-balancing term
  when the config asks for router logits, as TRL's own.

Where that is not possible the trainer's construction raises ``ValueError`` naming NMST: a TRL outside
:data:`SUPPORTED_TRL`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
import types
from typing import Any, Optional

import torch

SUPPORTED_TRL = ("1.16.0", "1.17.0")  # [lowest, first unsupported): the releases these hooks are tested with
_UTILS = "trl.trainer.utils"
_WRAPPED = "_nmst_wraps"
OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


# --- finding TRL's call -----------------------------------------------------------------------------

def watch_trl() -> None:
    """Make TRL's ``add_fused_lm_head`` serve patched models with the head: now, where TRL's utils are
    imported, else when they are (an import hook; TRL itself is not imported here). Idempotent."""
    module = sys.modules.get(_UTILS)
    if module is not None:
        _wrap(module)
    elif not any(isinstance(finder, _TRLUtilsFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TRLUtilsFinder())


class _TRLUtilsFinder(importlib.abc.MetaPathFinder):
    """Finds ``trl.trainer.utils`` as the path finder does, and wraps its function once it has run
    (before any trainer module's ``from .utils import add_fused_lm_head`` reads it)."""

    def find_spec(self, name, path, target=None):
        if name != _UTILS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _WrappingLoader(spec.loader)
        return spec


class _WrappingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _wrap(module)


def _wrap(utils: types.ModuleType) -> None:
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
    model loaded from a saved run: patched here with the recorded settings)."""
    if getattr(model, "_nmst_original_forward", None) is not None:
        return True
    config = getattr(model, "config", None)
    if not getattr(config, "nmst", None) or isinstance(model, str):
        return False
    from .hf import apply_nmst

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
    from ..decoding.distribution import check_temperature

    check_temperature(temperature)
    unknown = set(outputs) - {"log_probs", *OPTIONAL_OUTPUTS}
    if unknown:
        raise ValueError(f"outputs: unknown field(s) {sorted(unknown)} for the NMST head")
    previous = model.__dict__.get("_nmst_unfused_forward") or model.forward
    model._nmst_unfused_forward = previous
    model._nmst_trl = dict(temperature=float(temperature), cast_lm_head_to_fp32=bool(cast_lm_head_to_fp32),
                           outputs=tuple(outputs))
    # HF generate on the policy (GRPO / RLOO with use_vllm=False) samples the head at TRL's temperature.
    model._nmst_generation_temperature = float(temperature)

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
        from .hf import patched_call

        with patched_call():
            return head_outputs(self, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch,
                                **self._nmst_trl, **kwargs)

    from .hf import _with_self_and

    forward.__signature__ = _with_self_and(inspect.signature(previous),
                                           ("fused_lm_head", "shift_labels", "num_items_in_batch"))
    model.forward = types.MethodType(forward, model)


def head_outputs(model: Any, *, labels: Optional[torch.Tensor], shift_labels: Optional[torch.Tensor],
                 num_items_in_batch: Any, temperature: float, cast_lm_head_to_fp32: bool, outputs: tuple[str, ...],
                 **named: Any):
    """TRL's ``FusedCausalLMOutput`` for one call of a patched model (see :func:`add_head_outputs`).

    ``labels`` (B, T) aligned with ``input_ids`` (position i scores ``labels[:, i + 1]``), or ``shift_labels``
    (B, T) already shifted (position i scores ``shift_labels[:, i]``); ``named``: the model's other forward
    arguments (input_ids, attention_mask, position_ids, …)."""
    from trl.trainer.utils import FusedCausalLMOutput

    from ..loss import linear_nmst_loss
    from .hf import (
        _as_shifted,
        _check_output_weight,
        _in_output_layer,
        _linear_of,
        _output_layer,
        decoder_hidden,
        default_steps,
        logit_postprocessing,
    )

    if (labels is None) == (shift_labels is None):
        raise ValueError("NMST head: fused_lm_head=True needs exactly one of labels= and shift_labels=")
    settings = dict(model.config.nmst)
    text_config = model.config.get_text_config()
    router = bool(getattr(text_config, "output_router_logits", False))
    if router:
        named.setdefault("output_router_logits", True)
    named.pop("nmst_steps", None)
    out, hidden = decoder_hidden(model, **named)
    mask_in, positions = named.get("attention_mask"), named.get("position_ids")
    layer = _output_layer(model, check_weight=False)
    if shift_labels is None:
        labels = labels.to(hidden.device)
        steps = default_steps(labels, settings, attention_mask=mask_in, position_ids=positions)[:, 1:]
        hidden, targets = hidden[:, :-1], labels[:, 1:]
    else:
        targets = shift_labels.to(hidden.device)
        aligned, mask_in, positions = _as_shifted(targets, mask_in, positions)
        steps = default_steps(aligned, settings, attention_mask=mask_in, position_ids=positions)[:, 1:]
    if targets.shape != hidden.shape[:2]:
        raise ValueError(f"labels must give (B, T)={tuple(hidden.shape[:2])} targets, got {tuple(targets.shape)}")
    mask = targets != -100
    softcap, scale = logit_postprocessing(model.config)
    head, eos, eps = settings["head"], settings["eos_token_id"], settings["eps"]
    wanted = tuple(name for name in OPTIONAL_OUTPUTS if name in outputs)

    def compute(h: torch.Tensor):
        linear = _linear_of(layer)
        _check_output_weight(model, linear)
        weight, bias = linear.weight, linear.bias
        if cast_lm_head_to_fp32:
            h, weight = h.float(), weight.float()
            bias = None if bias is None else bias.float()
        context = torch.autocast(h.device.type, enabled=False) if cast_lm_head_to_fp32 else contextlib.nullcontext()
        with context:
            common = dict(eos_index=eos, eps=eps, head=head, bias=bias, softcap=softcap, logit_scale=scale,
                          temperature=temperature, impl=getattr(model, "_nmst_impl", "auto"))
            if head == "st":  # the running sum goes along T: every row of the (B, T) layout
                nll = linear_nmst_loss(h, weight, targets, steps=steps, reduction="none", **common)
                log_probs = -nll.to(torch.promote_types(nll.dtype, torch.float32))
            else:  # the supervised rows alone
                nll = linear_nmst_loss(h[mask], weight, targets[mask], steps=None if head == "va" else steps[mask],
                                       reduction="none", **common)
                nll = nll.to(torch.promote_types(nll.dtype, torch.float32))
                log_probs = nll.new_zeros(mask.shape).masked_scatter(mask, -nll)
            stats = {}
            if wanted:
                from .trl_statistics import head_statistics

                stats = head_statistics(h, weight, bias, targets, steps, mask, head=head, eos_index=eos, eps=eps,
                                        temperature=temperature, softcap=softcap, logit_scale=scale, outputs=wanted)
        return (log_probs, *(stats.get(name) for name in OPTIONAL_OUTPUTS))

    log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = _in_output_layer(layer, hidden, compute)
    divisor = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -log_probs.sum() / divisor
    aux_loss = None
    if router:
        aux_loss = _load_balancing_loss(out, text_config, named.get("attention_mask"))
        loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
    return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, log_sum_sq_probs=log_sum_sq_probs,
                               mean_logits=mean_logits, is_top1=is_top1, label_mask=mask, aux_loss=aux_loss)


def _load_balancing_loss(out: Any, text_config: Any, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The MoE load-balancing loss of the decoder's router logits, the one transformers' MoE families share."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return load_balancing_loss_func(out.router_logits, text_config.num_experts, text_config.num_experts_per_tok,
                                    attention_mask)
