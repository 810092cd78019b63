"""What a Hugging Face causal LM is made of, as the head reads it: its decoder stack, its output layer and
the config's post-processing of the output layer's logits.

Nothing here names a model family: the decoder stack is :func:`decoder_stack`, the output layer
``model.get_output_embeddings()`` (weight, and bias where the model has one), and the logits' post-processing
comes from the config (a cap from :data:`SOFTCAP_KEYS`: Gemma 2/3, RecurrentGemma, xLSTM; ``logit_scale``:
Cohere; ``logits_scaling``: Granite). :mod:`~nmst_fast.integrations.hf.probe` checks on a probe input that this
reproduces the model's own logits.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ...head import NMSTHead
from ...settings import HeadSettings

# Config keys of a plain logit cap, softcap·tanh(z / softcap): Gemma 2/3, RecurrentGemma, xLSTM.
SOFTCAP_KEYS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")


def base_model_type(config: Any) -> str:
    """A config's model type, the base model's for a model with a head (whose type is "nmst")."""
    return getattr(config, "base_model_type", None) or config.model_type


def model_name(model: Any) -> str:
    """The model's class and type, as refusals name it."""
    return f"{type(model).__name__} (model_type {base_model_type(model.config)!r})"


def is_causal_lm(model: Any) -> bool:
    """Whether ``model``'s class is (a subclass of) one that ``AutoModelForCausalLM`` maps a model type to:
    transformers' own, by name, or one registered with ``AutoModelForCausalLM.register`` for its config class."""
    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    mro = type(model).__mro__
    if any(cls.__name__ in names for cls in mro):
        return True
    try:  # only this config class's entry: reading every value would import every model module
        registered = MODEL_FOR_CAUSAL_LM_MAPPING[type(model.config)]
    except (KeyError, ValueError, AttributeError):
        return False
    return any(cls in mro for cls in (registered if isinstance(registered, (list, tuple)) else [registered]))


def linear_of(layer: nn.Module) -> nn.Module:
    """The module that computes ``layer``'s output: PEFT's active ``modules_to_save`` copy for its
    wrapper (the original module when no adapter is active), else ``layer`` itself."""
    copies = getattr(layer, "modules_to_save", None)
    if isinstance(copies, nn.ModuleDict):
        active = list(getattr(layer, "active_adapters", None) or [])
        return copies[active[0]] if active else layer.original_module
    return layer


def output_layer(model: Any, *, check_weight: bool = True) -> nn.Module:
    """The model's output layer (``get_output_embeddings()``: an ``nn.Linear``, or PEFT's
    ``modules_to_save`` wrapper of one), read at every call so that wrapping the model later is seen.

    Refused unless its output is exactly ``F.linear(h, weight, bias)``: the forward is ``nn.Linear``'s
    own and it holds no parameter beside ``weight`` and ``bias`` (the fused loss reads those two and
    would leave any other parameter, such as a learned logit scale, without its gradient).
    ``check_weight=False`` leaves the weight unread (:func:`check_output_weight` then checks it
    inside the layer's call): during DeepSpeed's forward, ZeRO-3 gathers a partitioned weight
    wherever it is read and keeps it gathered until the module that read it returns."""
    layer = model.get_output_embeddings()
    if hasattr(layer, "base_layer"):  # a PEFT tuner layer: its adapter is not part of .weight
        raise ValueError(f"{model_name(model)}: the output layer carries an adapter ({type(layer).__name__}); the "
                         "fused loss reads the layer's weight alone: train it under modules_to_save instead")
    linear = linear_of(layer) if isinstance(layer, nn.Module) else layer
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"{model_name(model)}: the output layer (get_output_embeddings()) must be an nn.Linear "
                         f"with a (V, H) weight, got {type(linear).__name__}")
    if type(linear).forward is not nn.Linear.forward:
        raise ValueError(f"{model_name(model)}: the output layer {type(linear).__name__} has a forward of its own, "
                         "so its logits are not W h + b; the fused loss reads weight and bias alone and cannot "
                         "reproduce it; this model type is not supported")
    # torch.nn.utils.parametrize keeps weight's (and bias's) source tensors under parametrizations.
    others = sorted(name for name, _ in linear.named_parameters()
                    if name not in ("weight", "bias") and not name.startswith(("parametrizations.weight.",
                                                                               "parametrizations.bias.")))
    if others:
        raise ValueError(f"{model_name(model)}: the output layer {type(linear).__name__} holds parameters beside "
                         f"weight and bias ({', '.join(others)}); the fused loss reads weight and bias alone and "
                         "would leave them without a gradient; this model type is not supported")
    if check_weight:
        check_output_weight(model, linear)
    return layer


def check_output_weight(model: Any, layer: nn.Module) -> None:
    """The output layer's weight is a whole (V, H) tensor (not partitioned by DeepSpeed ZeRO-3)."""
    weight = getattr(layer, "weight", None)
    if hasattr(weight, "ds_shape") and weight.numel() == 0:
        raise ValueError(f"{model_name(model)}: its output layer's weight is partitioned by DeepSpeed ZeRO-3 (a "
                         "model built under deepspeed.zero.Init, as from_pretrained does while Hugging Face's ZeRO-3 "
                         "config is active); apply_nmst probes the whole model: patch it whole, then hand it to "
                         "deepspeed.initialize, which partitions it")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{model_name(model)}: the output layer (get_output_embeddings()) must be an nn.Linear "
                         f"with a (V, H) weight, got {type(layer).__name__}")


def decoder_stack(model: Any) -> nn.Module:
    """The module whose last hidden state the output layer reads: ``model.base_model`` where it is a
    separate module, else ``model.model`` (Llama 4, mllama: their ``base_model_prefix`` names another
    attribute), else ``model.get_decoder()``. The probe checks on a probe input that the output layer on its
    hidden state gives the model's own logits."""
    candidates = [model.base_model, getattr(model, "model", None)]
    try:
        candidates.append(model.get_decoder())
    except (AttributeError, NotImplementedError, ValueError):
        pass
    for candidate in candidates:
        if isinstance(candidate, nn.Module) and candidate is not model:
            return candidate
    raise ValueError(f"{model_name(model)} has no separate decoder stack (base_model, model or get_decoder()) "
                     "for the fused loss to run before its output layer")


def check_causal_lm(model: Any) -> nn.Module:
    """The model's output layer, after checking that ``model`` is a causal LM the head can be put on."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel (a …ForCausalLM), got {type(model).__name__}")
    if not is_causal_lm(model) or model.config.is_encoder_decoder:
        raise ValueError(f"model must be a causal LM (AutoModelForCausalLM), got {model_name(model)}")
    layer = output_layer(model)
    decoder_stack(model)
    return layer


def logit_postprocessing(config: Any) -> tuple[Optional[float], Optional[float]]:
    """(softcap, logit_scale) such that the model's logits are softcap·tanh(logit_scale·z / softcap)
    (or logit_scale·z without softcap) for z = the output layer's output; each None when absent.
    Read from the text config: the cap from :data:`SOFTCAP_KEYS` (Gemma 2/3, RecurrentGemma, xLSTM),
    ``logit_scale`` (Cohere, multiplies), ``logits_scaling`` (Granite, divides)."""
    config = config.get_text_config()
    caps = {key: getattr(config, key) for key in SOFTCAP_KEYS if getattr(config, key, None) is not None}
    if len(set(caps.values())) > 1:
        raise ValueError(f"the config sets several different logit caps {caps}")
    softcap = next(iter(caps.values()), None)
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:
        scale /= float(config.logits_scaling)
    return (None if softcap is None else float(softcap)), (None if scale == 1.0 else scale)


def output_head(model: Any, settings: HeadSettings) -> NMSTHead:
    """The model's output layer as an :class:`NMSTHead` (tied to its weight and bias, with the
    config's softcap and scale): ``head(hidden)`` gives the model's own logits."""
    layer = output_layer(model)
    softcap, scale = logit_postprocessing(model.config)
    V, H = layer.weight.shape
    return NMSTHead(H, V, eos_index=settings.eos_index, head=settings.head, eps=settings.eps,
                    weight=layer.weight, bias=layer.bias if layer.bias is not None else False,
                    softcap=softcap, logit_scale=scale)


def output_logits(model: Any, hidden: torch.Tensor, settings: HeadSettings) -> torch.Tensor:
    """The model's own logits (B, T, V) of the decoder stack's last hidden state ``hidden`` (its output layer and
    the config's post-processing), formed inside the layer's own call (FSDP2 / ZeRO-3 gather its weight)."""
    return in_output_layer(output_layer(model, check_weight=False), hidden, lambda h: output_head(model, settings)(h))


def last_hidden_state(out: Any) -> torch.Tensor:
    """A decoder stack's output's last hidden state (B, T, H)."""
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def accepted(function: Callable, named: dict) -> dict:
    """The arguments ``function`` takes (all of them when it has ``**kwargs``)."""
    parameters = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return named
    return {k: v for k, v in named.items() if k in parameters}


def decoder_hidden(model: Any, **named: Any) -> tuple[Any, torch.Tensor]:
    """(output, last hidden state (B, T, H)) of :func:`decoder_stack` on the model's forward
    arguments ``named``, as the fused loss and the probe call it: no KV cache, only the arguments the
    stack takes."""
    for unused in ("logits_to_keep", "num_logits_to_keep", "return_dict", "labels"):
        named.pop(unused, None)
    named["use_cache"] = False
    stack = decoder_stack(model)
    out = stack(**accepted(stack.forward, named))
    return out, last_hidden_state(out)


def in_output_layer(layer: nn.Module, hidden: torch.Tensor, compute: Callable[[torch.Tensor], Any]) -> Any:
    """``compute(hidden)`` run as the output layer's own forward, so its module hooks fire around it:
    FSDP2 / ZeRO-3 gather the layer's full weight in its pre-forward hook, and the loss reads it there."""
    previous = layer.__dict__.get("forward")
    layer.forward = compute
    try:
        return layer(hidden)
    finally:
        if previous is None:
            del layer.forward
        else:
            layer.forward = previous
