"""Any Hugging Face causal LM with an NMST / ST / VA head.

* :func:`apply_nmst` — train a ``…ForCausalLM`` with the fused loss (no (B, T, V) logits), t per row;
  :func:`class_labels` — labels aligned with the input ids in the convention the model's class scores.
* :func:`steps_from_labels`, :func:`steps_from_positions`, :func:`steps_from_attention_mask` — the
  step t of every token, aligned with ``labels``.
* :class:`HFDecoder` — the model under :func:`nmst_fast.generate` (greedy, top-k, nucleus, beam).
* :class:`NMSTLogitsProcessor` — HF ``generate()`` greedy / sampling on the head's distribution.

Nothing here names a model family: the decoder stack is :func:`decoder_stack`, the output layer
``model.get_output_embeddings()`` (weight, and bias where the model has one), and the logits'
post-processing comes from the config (a cap from :data:`SOFTCAP_KEYS`: Gemma 2/3, RecurrentGemma,
xLSTM; ``logit_scale``: Cohere; ``logits_scaling``: Granite). :func:`apply_nmst` checks on a probe
input, at two logit scales, that this reproduces the model's own logits and refuses the model otherwise.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import numbers
import threading
import types
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from transformers import LogitsProcessor, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..decoding import step_log_probs
from ..head import NMSTHead
from ..loss import linear_nmst_loss
from ..validation import HEADS, IMPLS, check_choice, check_eps, check_int_tensor
from .trl import watch_trl

_DEFAULTS = dict(head="nmst", eps=1e-5, context_length=None)


# --- what a model's output layer is -----------------------------------------------------------

def _is_causal_lm(model: Any) -> bool:
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


def _model_name(model: Any) -> str:
    return f"{type(model).__name__} (model_type {model.config.model_type!r})"


def _linear_of(layer: nn.Module) -> nn.Module:
    """The module that computes ``layer``'s output: PEFT's active ``modules_to_save`` copy for its
    wrapper (the original module when no adapter is active), else ``layer`` itself."""
    copies = getattr(layer, "modules_to_save", None)
    if isinstance(copies, nn.ModuleDict):
        active = list(getattr(layer, "active_adapters", None) or [])
        return copies[active[0]] if active else layer.original_module
    return layer


def _output_layer(model: Any, *, check_weight: bool = True) -> nn.Module:
    """The model's output layer (``get_output_embeddings()``: an ``nn.Linear``, or PEFT's
    ``modules_to_save`` wrapper of one), read at every call so that wrapping the model later is seen.

    Refused unless its output is exactly ``F.linear(h, weight, bias)``: the forward is ``nn.Linear``'s
    own and it holds no parameter beside ``weight`` and ``bias`` (the fused loss reads those two and
    would leave any other parameter, such as a learned logit scale, without its gradient).
    ``check_weight=False`` leaves the weight unread (:func:`_check_output_weight` then checks it
    inside the layer's call): during DeepSpeed's forward, ZeRO-3 gathers a partitioned weight
    wherever it is read and keeps it gathered until the module that read it returns."""
    layer = model.get_output_embeddings()
    if hasattr(layer, "base_layer"):  # a PEFT tuner layer: its adapter is not part of .weight
        raise ValueError(f"{_model_name(model)}: the output layer carries an adapter ({type(layer).__name__}); the "
                         "fused loss reads the layer's weight alone: train it under modules_to_save instead")
    linear = _linear_of(layer) if isinstance(layer, nn.Module) else layer
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"{_model_name(model)}: the output layer (get_output_embeddings()) must be an nn.Linear "
                         f"with a (V, H) weight, got {type(linear).__name__}")
    if type(linear).forward is not nn.Linear.forward:
        raise ValueError(f"{_model_name(model)}: the output layer {type(linear).__name__} has a forward of its own, "
                         "so its logits are not W h + b; the fused loss reads weight and bias alone and cannot "
                         "reproduce it; this model type is not supported")
    # torch.nn.utils.parametrize keeps weight's (and bias's) source tensors under parametrizations.
    others = sorted(name for name, _ in linear.named_parameters()
                    if name not in ("weight", "bias") and not name.startswith(("parametrizations.weight.",
                                                                               "parametrizations.bias.")))
    if others:
        raise ValueError(f"{_model_name(model)}: the output layer {type(linear).__name__} holds parameters beside "
                         f"weight and bias ({', '.join(others)}); the fused loss reads weight and bias alone and "
                         "would leave them without a gradient; this model type is not supported")
    if check_weight:
        _check_output_weight(model, linear)
    return layer


def _check_output_weight(model: Any, layer: nn.Module) -> None:
    weight = getattr(layer, "weight", None)
    if hasattr(weight, "ds_shape") and weight.numel() == 0:
        raise ValueError(f"{_model_name(model)}: its output layer's weight is partitioned by DeepSpeed ZeRO-3 (a "
                         "model built under deepspeed.zero.Init, as from_pretrained does while Hugging Face's ZeRO-3 "
                         "config is active); apply_nmst probes the whole model: patch it whole, then hand it to "
                         "deepspeed.initialize, which partitions it")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{_model_name(model)}: the output layer (get_output_embeddings()) must be an nn.Linear "
                         f"with a (V, H) weight, got {type(layer).__name__}")


def decoder_stack(model: Any) -> nn.Module:
    """The module whose last hidden state the output layer reads: ``model.base_model`` where it is a
    separate module, else ``model.model`` (Llama 4, mllama: their ``base_model_prefix`` names another
    attribute), else ``model.get_decoder()``. :func:`apply_nmst` checks on a probe input that the
    output layer on its hidden state gives the model's own logits."""
    candidates = [model.base_model, getattr(model, "model", None)]
    try:
        candidates.append(model.get_decoder())
    except (AttributeError, NotImplementedError, ValueError):
        pass
    for candidate in candidates:
        if isinstance(candidate, nn.Module) and candidate is not model:
            return candidate
    raise ValueError(f"{_model_name(model)} has no separate decoder stack (base_model, model or get_decoder()) "
                     "for the fused loss to run before its output layer")


def _check_causal_lm(model: Any) -> nn.Module:
    """The model's output layer, after checking that ``model`` is a causal LM this module can patch."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel (a …ForCausalLM), got {type(model).__name__}")
    if not _is_causal_lm(model) or model.config.is_encoder_decoder:
        raise ValueError(f"model must be a causal LM (AutoModelForCausalLM), got {_model_name(model)}")
    layer = _output_layer(model)
    decoder_stack(model)
    return layer


# Config keys of a plain logit cap, softcap·tanh(z / softcap): Gemma 2/3, RecurrentGemma, xLSTM.
SOFTCAP_KEYS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")


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


def _resolve_eos(model: Any, eos_token_id: Optional[int], recorded: Optional[int], vocab_size: int) -> int:
    """The NMST eos: the argument, else what the config recorded, else the model's single eos id."""
    if eos_token_id is not None and recorded is not None and eos_token_id != recorded:
        raise ValueError(f"the model was trained with eos_token_id={recorded}; refusing eos_token_id={eos_token_id}")
    eos = eos_token_id if eos_token_id is not None else recorded
    if eos is None:
        configured = model.config.get_text_config().eos_token_id
        if configured is None:
            configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if isinstance(configured, (list, tuple)):
            if len(configured) != 1:
                raise ValueError(f"{type(model).__name__}'s config lists several eos ids {list(configured)}: pass "
                                 "eos_token_id= to pick the one the NMST head terminates with (generation "
                                 "still stops on every id of the list)")
            configured = configured[0]
        if configured is None:
            raise ValueError(f"{type(model).__name__}'s config has no eos_token_id: pass eos_token_id=")
        eos = configured
    if isinstance(eos, bool) or not isinstance(eos, numbers.Integral):
        raise TypeError(f"eos_token_id must be an int, got {type(eos).__name__}")
    if not 0 <= int(eos) < vocab_size:
        raise ValueError(f"eos_token_id must lie in [0, V={vocab_size}) (the output layer's rows), got {eos}")
    return int(eos)


def stop_token_ids(model: Any, eos: int) -> tuple[int, ...]:
    """Every id that ends a generation: the NMST eos and the config's other eos ids (Llama 3 lists several)."""
    ids = [eos]
    for source in (model.config.get_text_config(), getattr(model, "generation_config", None)):
        listed = getattr(source, "eos_token_id", None)
        for i in ([listed] if isinstance(listed, int) else list(listed or [])):
            if i not in ids:
                ids.append(int(i))
    return tuple(ids)


def nmst_settings(model: Any, *, head: Optional[str] = None, eps: Optional[float] = None,
                  context_length: Optional[int] = None, eos_token_id: Optional[int] = None) -> dict:
    """The head settings to use: what the caller gave, else what ``model.config.nmst`` recorded
    (kept by ``save_pretrained``), else head "nmst", ε 1e-5 and no fixed context.
    A value that contradicts the recorded one raises ValueError: a model trained as NMST is never
    silently scored as another head."""
    layer = _check_causal_lm(model)
    recorded = dict(getattr(model.config, "nmst", None) or {})
    given = {k: v for k, v in dict(head=head, eps=eps, context_length=context_length).items() if v is not None}
    clash = {k: (recorded[k], v) for k, v in given.items() if k in recorded and recorded[k] != v}
    if clash:
        raise ValueError(f"the model was trained with {', '.join(f'{k}={a!r}' for k, (a, _) in clash.items())}; "
                         f"refusing to use {', '.join(f'{k}={b!r}' for k, (_, b) in clash.items())}")
    settings = {**_DEFAULTS, **{k: v for k, v in recorded.items() if k in _DEFAULTS}, **given}
    check_choice("head", settings["head"], HEADS)
    check_eps(settings["eps"])
    context = settings["context_length"]
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 0):
        raise ValueError(f"context_length must be None or an int >= 0, got {context!r}")
    settings["eos_token_id"] = _resolve_eos(model, eos_token_id, recorded.get("eos_token_id"), layer.weight.shape[0])
    return settings


def output_head(model: Any, settings: dict) -> NMSTHead:
    """The model's output layer as an :class:`NMSTHead` (tied to its weight and bias, with the
    config's softcap and scale): ``head(hidden)`` gives the model's own logits."""
    layer = _output_layer(model)
    softcap, scale = logit_postprocessing(model.config)
    V, H = layer.weight.shape
    return NMSTHead(H, V, eos_index=settings["eos_token_id"], head=settings["head"], eps=settings["eps"],
                    weight=layer.weight, bias=layer.bias if layer.bias is not None else False,
                    softcap=softcap, logit_scale=scale)


def _last_hidden_state(out: Any) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def decoder_hidden(model: Any, **named: Any) -> tuple[Any, torch.Tensor]:
    """(output, last hidden state (B, T, H)) of :func:`decoder_stack` on the model's forward
    arguments ``named``, as the fused loss and the probe call it: no KV cache, only the arguments the
    stack takes."""
    for unused in ("logits_to_keep", "num_logits_to_keep", "return_dict", "labels"):
        named.pop(unused, None)
    named["use_cache"] = False
    stack = decoder_stack(model)
    out = stack(**_accepted(stack.forward, named))
    return out, _last_hidden_state(out)


_PROBE_SPAN = 50.0  # max |logit| of the second probe: a cap of 30 (Gemma's) moves it by 22


def _own_call(model: Any, forward: Callable, **named: Any) -> Any:
    """The model's own forward on the probe's arguments, without a KV cache (where it takes one), as
    training calls it; a failure is a refusal that names the model."""
    no_cache = _accepted(forward, {"use_cache": False})  # empty where the forward takes no use_cache
    try:
        return forward(**named, **no_cache)
    except Exception as error:
        raise ValueError(f"{_model_name(model)}: its own forward fails on a probe batch of token ids with labels "
                         f"({type(error).__name__}: {error}); this model type is not supported") from error


def _matches(loss: torch.Tensor, candidate: torch.Tensor) -> bool:
    # The candidate is the float64 cross-entropy of the very logits the model's loss read (HF's losses
    # upcast them to float32 at least): they agree to the loss's own precision.
    precision = max(torch.finfo(loss.dtype).eps, torch.finfo(torch.float32).eps)
    return abs(float(loss) - float(candidate)) <= 8 * precision * max(1.0, abs(float(candidate)))


def _probe(model: Any, forward: Callable, head: NMSTHead) -> bool:
    """Refuse a model whose logits the fused path does not reproduce (an unknown post-processing, a
    head that is not a plain linear layer), and find how the class aligns ``labels``: compare the
    model's own forward with the fused path's logits on a short input, with the output layer's
    weights as they are and scaled so that the logits span about ±50 (a nonlinearity such as a cap is
    invisible on small logits), then restored. Returns whether the class shifts its labels (token i+1
    is the target at position i, as most causal LMs do) rather than scoring ``labels[i]`` at position i."""
    name = _model_name(model)
    layer = _linear_of(_output_layer(model))
    V, H = layer.weight.shape
    device = layer.weight.device
    ids = (torch.arange(7, device=device) * 7919 % V)[None]
    labels = (torch.arange(7, device=device) * 4243 % V + 11)[None] % V
    params = [p for p in (layer.weight, layer.bias) if p is not None]
    saved = [p.detach().to("cpu", copy=True) for p in params]  # restored bit for bit; host memory, not device
    precision = torch.finfo(layer.weight.dtype).eps
    was_training = model.training
    model.eval()
    try:
        _check_every_parameter_is_reached(model, forward, ids, labels)
        with torch.no_grad():
            for _ in range(4):
                own = _own_call(model, forward, input_ids=ids, labels=labels)
                try:
                    _, hidden = decoder_hidden(model, input_ids=ids)
                    if hidden.shape[-1] != H:
                        raise ValueError(f"{name}: the output layer takes {H}-wide inputs but the decoder stack's "
                                         f"last hidden state is {hidden.shape[-1]} wide (a projection between them "
                                         "that the fused loss does not run); this model type is not supported")
                    ours = head(hidden).float()
                except (RuntimeError, TypeError, IndexError) as error:
                    raise ValueError(f"{name}: the fused path could not run on a probe input "
                                     f"({type(error).__name__}: {error}); this model type is not supported") from error
                expected = own.logits.float()
                span = float(expected.abs().max())
                # Some models return their logits upcast to float32 from a float64 layer (xLSTM).
                tolerance = 16 * max(precision, torch.finfo(own.logits.dtype).eps) * max(1.0, span)
                if ours.shape != expected.shape or not bool(((ours - expected).abs() <= tolerance).all()):
                    error = float((ours - expected).abs().max()) if ours.shape == expected.shape else math.inf
                    raise ValueError(
                        f"{name}: the fused loss would not see the model's own logits (max difference {error:.3g} "
                        f"at max |logit| {span:.3g} on a probe input): its logits are not "
                        "softcap·tanh(scale·(W h + b) / softcap) of the decoder stack's last hidden state with the "
                        f"config's {' / '.join(SOFTCAP_KEYS)} / logit_scale / logits_scaling; this model type is "
                        "not supported")
                raw = float(torch.nn.functional.linear(hidden, layer.weight, layer.bias).abs().max())
                if raw >= 0.8 * _PROBE_SPAN:
                    return _shifts_labels(name, own.loss, own.logits, labels)
                for p in params:  # tied input embeddings scale too: measure again
                    p.mul_(_PROBE_SPAN / max(raw, 1e-3))
            raise ValueError(f"{name}: scaling the output layer does not spread its logits (max |W h + b| {raw:.3g}); "
                             "the probe cannot check the logits' post-processing")
    finally:
        with torch.no_grad():
            for p, value in zip(params, saved):
                p.copy_(value)
        model.train(was_training)


def _check_every_parameter_is_reached(model: Any, forward: Callable, ids: torch.Tensor, labels: torch.Tensor) -> None:
    """Refuse a model with trainable parameters outside the decoder stack and the output layer that
    its own loss reaches (a learned logit temperature, say: equal to 1 at init, the probe's logits
    cannot tell): the fused loss runs the stack and the layer alone and would leave them untrained."""
    covered = {id(p) for p in decoder_stack(model).parameters()}
    covered |= {id(p) for p in model.get_output_embeddings().parameters()}
    others = [(n, p) for n, p in model.named_parameters() if id(p) not in covered and p.requires_grad]
    if not others:
        return
    with torch.enable_grad():
        loss = _own_call(model, forward, input_ids=ids, labels=labels).loss
        grads = torch.autograd.grad(loss, [p for _, p in others], allow_unused=True) if loss is not None else ()
    reached = [n for (n, _), g in zip(others, grads) if g is not None and bool(g.any())]
    if reached:
        raise ValueError(f"{_model_name(model)}: parameters outside the decoder stack and the output layer shape its "
                         f"loss ({', '.join(reached)}); the fused loss would leave them without a gradient; this "
                         "model type is not supported")


def _shifts_labels(name: str, loss: Optional[torch.Tensor], logits: torch.Tensor, labels: torch.Tensor) -> bool:
    """Whether the model's own ``loss`` on ``labels`` is the shifted cross-entropy (position i scores
    token i+1) or the unshifted one (position i scores ``labels[i]``); refuses any other loss."""
    if loss is None:
        raise ValueError(f"{name}: its forward returns no loss for labels, so the fused loss cannot follow its "
                         "label convention; this model type is not supported")
    log_p = torch.log_softmax(logits.double(), dim=-1)
    shifted = -log_p[:, :-1].gather(-1, labels[:, 1:, None]).mean()
    unshifted = -log_p.gather(-1, labels[..., None]).mean()
    matches = [_matches(loss, shifted), _matches(loss, unshifted)]
    if matches == [True, False]:
        return True
    if matches == [False, True]:
        return False
    raise ValueError(f"{name}: its own loss with labels ({float(loss):.6g}) is "
                     f"{'both' if all(matches) else 'neither'} the shifted ({float(shifted):.6g}) "
                     f"{'and' if all(matches) else 'nor'} the unshifted ({float(unshifted):.6g}) cross-entropy of "
                     "its logits (an auxiliary loss term?), so the fused loss would change what the model is trained "
                     "on; this model type is not supported")


# --- the step t of every token ----------------------------------------------------------------

def steps_from_positions(positions: torch.Tensor, context_length: int = 0) -> torch.Tensor:
    """t of every token from its position in its own sequence (0-based; negative: padding):
    t = position − context_length + 1, 0 on the first ``context_length`` tokens (context) and on padding.
    ``position_ids`` of packed sequences restart at 0 per document, so t restarts too. (B, T) int64."""
    check_int_tensor("positions", positions)
    return (positions.long() - context_length + 1).clamp(min=0)


def steps_from_attention_mask(attention_mask: torch.Tensor, context_length: int = 0) -> torch.Tensor:
    """t of every token of a (left- or right-) padded batch: positions count each row's real tokens
    (mask 1) from its first one, as HF derives ``position_ids``; padding gets t = 0. (B, T) int64."""
    check_int_tensor("attention_mask", attention_mask)
    mask = attention_mask.long()
    positions = torch.where(mask > 0, mask.cumsum(-1) - 1, -1)
    return steps_from_positions(positions, context_length)


def _segment_starts(shape: torch.Size, position_ids: Optional[torch.Tensor], device) -> torch.Tensor:
    """bool (B, T): where a sequence starts — the row's first token and, for packed rows, every
    position_id 0."""
    starts = torch.zeros(shape, dtype=torch.bool, device=device)
    if position_ids is not None:
        starts |= position_ids.to(device).expand(shape) == 0
    starts[..., 0] = True
    return starts


def steps_from_labels(labels: torch.Tensor, *, position_ids: Optional[torch.Tensor] = None,
                      ignore_index: int = -100) -> torch.Tensor:
    """t of every token from the supervision itself: t = 1 at each sequence's first supervised token
    (label ≠ ``ignore_index``, never a sequence's first token, which nothing predicts), counting on
    along the sequence; 0 before it. A chat prompt masked with -100, left padding labelled -100 and
    the documents of a packed row (``position_ids`` restarting at 0) each get their own t = 1.
    (B, T) int64, aligned with ``labels``."""
    check_int_tensor("labels", labels)
    starts = _segment_starts(labels.shape, position_ids, labels.device)
    supervised = (labels != ignore_index) & ~starts
    index = torch.arange(labels.shape[-1], device=labels.device).expand(labels.shape)
    start = torch.where(starts, index, 0).cummax(-1).values  # each position's sequence start
    counted = supervised.long().cumsum(-1)
    in_sequence = counted - (counted - supervised.long()).gather(-1, start)  # supervised so far in the sequence
    first = torch.where(supervised & (in_sequence == 1), index, -1).cummax(-1).values
    return torch.where(first >= start, index - first + 1, 0)


def default_steps(labels: torch.Tensor, settings: dict, *, attention_mask: Optional[torch.Tensor] = None,
                  position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rule the patched forward uses when no ``nmst_steps`` is given: with a fixed
    ``context_length`` (the paper's setup), t from each token's position in its own sequence
    (``position_ids``, else the attention mask, else the column); without one, from the labels
    (:func:`steps_from_labels`)."""
    context = settings["context_length"]
    if context is None:
        return steps_from_labels(labels, position_ids=position_ids)
    if position_ids is not None:
        return steps_from_positions(position_ids.expand(labels.shape), context)
    if attention_mask is not None:
        return steps_from_attention_mask(attention_mask, context)
    return steps_from_positions(torch.arange(labels.shape[-1], device=labels.device).expand(labels.shape), context)


# --- the patch ----------------------------------------------------------------------------------

_CALLS = threading.local()  # how deep this thread is inside a patched model's own forward


@contextlib.contextmanager
def patched_call() -> Iterator[None]:
    """Marks a call of the patched forward (or of TRL's head outputs): the decoder stack's guard lets
    training calls through only inside one."""
    _CALLS.depth = getattr(_CALLS, "depth", 0) + 1
    try:
        yield
    finally:
        _CALLS.depth -= 1


def _guard_the_stack(model: Any) -> None:
    """A forward pre-hook on the decoder stack: a training step (stack in training mode, grad on) that reaches
    the stack other than through the patched forward comes from a forward that replaced it after
    :func:`apply_nmst` — Liger's fused linear cross-entropy, a trainer's own fused LM head — whose loss is
    not the head's. It raises before the step runs, instead of training another loss in silence."""
    stack = decoder_stack(model)
    if getattr(stack, "_nmst_guarded", False):
        return
    name = _model_name(model)

    def guard(module, args, kwargs):
        if module.training and torch.is_grad_enabled() and not getattr(_CALLS, "depth", 0):
            raise ValueError(f"NMST head: {name}'s decoder stack is training outside the patched forward: something "
                             "replaced model.forward after apply_nmst (Liger's fused linear cross-entropy, a hub "
                             "kernel's or a trainer's own fused LM head), and its loss would not be the head's. Turn "
                             "that fused loss off, or apply the kernels before apply_nmst and let it patch the result")

    stack.register_forward_pre_hook(guard, with_kwargs=True)
    stack._nmst_guarded = True

def _in_output_layer(layer: nn.Module, hidden: torch.Tensor, compute: Callable[[torch.Tensor], torch.Tensor]):
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


def _as_shifted(labels: torch.Tensor, attention_mask: Optional[torch.Tensor],
                position_ids: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor],
                                                                Optional[torch.Tensor]]:
    """Unshifted labels (``labels[:, i]`` is the target at position i) written in the shifted layout
    the step rules read (column j is the token predicted at position j − 1): (B, T + 1), with a first
    column predicted by nothing, and the attention mask and positions carried one column on."""
    ignored = labels.new_full((labels.shape[0], 1), -100)
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, attention_mask[:, -1:]], dim=1)
    if position_ids is not None:
        position_ids = position_ids.expand(labels.shape)
        position_ids = torch.cat([position_ids, position_ids[:, -1:] + 1], dim=1)
    return torch.cat([ignored, labels], dim=1), attention_mask, position_ids


def _fused_loss(model, settings: dict, impl: str, named: dict, labels: torch.Tensor, shifted: bool,
                nmst_steps: Optional[torch.Tensor], num_items_in_batch) -> CausalLMOutputWithPast:
    # The weight is read inside the layer's call alone (loss_of), where FSDP2 / ZeRO-3 hold it whole:
    # read here, ZeRO-3 would gather it for the whole decoder stack's forward.
    layer = _output_layer(model, check_weight=False)
    out, hidden = decoder_hidden(model, **named)
    if labels.shape != hidden.shape[:2]:
        raise ValueError(f"labels must be (B, T)={tuple(hidden.shape[:2])} like input_ids, got {tuple(labels.shape)}")
    labels = labels.to(hidden.device)
    if nmst_steps is None:
        mask, positions = named.get("attention_mask"), named.get("position_ids")
        if shifted:
            steps = default_steps(labels, settings, attention_mask=mask, position_ids=positions)
        else:
            aligned, mask, positions = _as_shifted(labels, mask, positions)
            steps = default_steps(aligned, settings, attention_mask=mask, position_ids=positions)[:, 1:]
    else:
        check_int_tensor("nmst_steps", nmst_steps)
        if nmst_steps.shape != labels.shape:
            raise ValueError(f"nmst_steps must be (B, T)={tuple(labels.shape)} aligned with labels, "
                             f"got {tuple(nmst_steps.shape)}")
        steps = nmst_steps.to(hidden.device)
    if shifted:  # token i+1 is the target at position i, as HF's causal LMs shift their labels
        hidden, labels, steps = hidden[:, :-1], labels[:, 1:], steps[:, 1:]
    softcap, scale = logit_postprocessing(model.config)
    head = settings["head"]

    def loss_of(h: torch.Tensor) -> torch.Tensor:
        _check_output_weight(model, _linear_of(layer))
        return linear_nmst_loss(h, layer.weight, labels, bias=layer.bias, eos_index=settings["eos_token_id"],
                                eps=settings["eps"], head=head, steps=None if head == "va" else steps,
                                softcap=softcap, logit_scale=scale,
                                reduction="mean" if num_items_in_batch is None else "sum", impl=impl)

    loss = _in_output_layer(layer, hidden, loss_of)
    if num_items_in_batch is not None:  # HF Trainer's gradient accumulation: one divisor for the whole batch
        loss = loss / num_items_in_batch
    return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(out, "hidden_states", None),
                                  attentions=getattr(out, "attentions", None))


def apply_nmst(model: Any, *, head: Optional[str] = None, eps: Optional[float] = None,
               context_length: Optional[int] = None, eos_token_id: Optional[int] = None, impl: str = "auto",
               generation_logits: bool = False) -> Any:
    """Make any HF causal LM train with the fused NMST / ST / VA loss (returns ``model``, patched).

    With ``labels``, ``model(input_ids, labels=..., nmst_steps=None, ...)`` runs :func:`decoder_stack`,
    then :func:`nmst_fast.linear_nmst_loss` on its last hidden state and the output layer's weight
    (and bias), with the config's logit softcap and scale — inside the output layer's own call, so
    sharding hooks gather its weight. The (B, T, V) logits are never formed (``logits`` is None).
    Labels follow the class's own convention, found on the probe: most causal LMs shift them inside
    (position i is scored on ``labels[:, i + 1]``); a few (the ``…ForCausalLM`` of BART-style decoders,
    XLNet's and XLM's LM heads) score ``labels[:, i]`` at position i, and so does the fused loss
    for them (-100 ignored). ``nmst_steps`` (B, T), aligned with ``labels``,
    gives the t of each token (t ≤ 0: context); without it, :func:`default_steps`: from the labels
    (t = 1 at each sequence's first supervised token) unless a fixed ``context_length`` is set.
    HF Trainer's ``num_items_in_batch`` is honoured (loss summed, then divided by it).
    Without labels the model is unchanged, unless ``generation_logits=True``: then the last
    position's logits become the head's exact step log-probabilities (t = 1 at the first generated
    token), so every HF ``generate()`` mode, beam search included, decodes the head's distribution
    ("nmst" and "va"; ST's running state cannot follow HF's beam reordering).

    Args:
        model: a transformers ``…ForCausalLM`` (``from_pretrained(local_dir)`` or random init).
        head, eps, context_length: the head; None takes what ``model.config.nmst`` recorded, else
            "nmst", 1e-5 and no fixed context.
        eos_token_id: the token the head terminates with; None takes the config's (refused when the
            config lists several, as Llama 3's does: pick one).
        impl: the fused loss's backend (see :func:`nmst_fast.linear_nmst_loss`).
    Raises:
        TypeError / ValueError: not a causal LM, no linear output layer, no eos, bad settings, or a
        model whose own logits the fused path does not reproduce on a probe input (checked here).
    """
    check_choice("impl", impl, IMPLS)
    settings = nmst_settings(model, head=head, eps=eps, context_length=context_length, eos_token_id=eos_token_id)
    if generation_logits and settings["head"] == "st":
        raise ValueError("generation_logits=True supports head 'nmst' and 'va': ST's running state cannot "
                         "follow HF's beam reordering; use NMSTLogitsProcessor or HFDecoder for ST")
    original_forward = getattr(model, "_nmst_original_forward", model.forward)
    shifted = _probe(model, original_forward, output_head(model, settings))
    model.config.nmst = {k: settings[k] for k in ("head", "eps", "context_length", "eos_token_id")}
    signature = inspect.signature(original_forward)  # bound: without self
    eos = settings["eos_token_id"]
    prompt = {}  # the generation in progress: its prompt's length (set at its prefill call), ST's state

    def step_distribution(out, cache, new_tokens: int, temperature: float):
        # A call without a cache scores the token after its input (t = 1), as a prefill does;
        # with one, the cache already holds this call's tokens.
        total = new_tokens if cache is None else cache.get_seq_length()
        if total == new_tokens:  # prefill: a new generation starts
            prompt["length"], prompt["state"] = total, None
        t = total - prompt["length"] + 1
        log_p, prompt["state"] = step_log_probs(out.logits[:, -1], head=settings["head"], eos_index=eos,
                                                eps=settings["eps"], steps=t, state=prompt["state"],
                                                temperature=temperature)
        # HF's sampling divides these by its temperature T: T · log p_T gives back the head's p_T.
        out.logits[:, -1] = (log_p * temperature).to(out.logits.dtype)
        return out

    def forward(self, *args, num_items_in_batch=None, nmst_steps=None, **kwargs):
        named = _named_arguments(signature, args, kwargs)
        labels = named.pop("labels", None)
        if labels is not None:
            with patched_call():
                return _fused_loss(self, settings, impl, named, labels, shifted, nmst_steps, num_items_in_batch)
        if nmst_steps is not None:
            raise ValueError("nmst_steps is given without labels: it is the t of each label")
        # Through the instance (not the closure's bound method), so a deep copy of the model (TRL's
        # reference models) runs its own weights.
        with patched_call():
            out = self._nmst_original_forward(**named)
        temperature = self._nmst_generation_temperature
        if temperature is None:
            return out
        cache = named.get("cache", named.get("past_key_values"))
        ids = named.get("input_ids")
        return step_distribution(out, cache, (ids if ids is not None else named["inputs_embeds"]).shape[1],
                                 temperature)

    # HF generate() reads the forward's signature to decide whether to pass attention_mask and
    # position_ids (left-padded prompts need both): advertise the original's, plus ours.
    forward.__signature__ = _with_self_and(signature, ("num_items_in_batch", "nmst_steps"))
    model.forward = types.MethodType(forward, model)
    model._nmst_original_forward = original_forward
    model._nmst_shifts_labels = shifted
    model._nmst_impl = impl
    # The temperature T of HF's sampling whose division the emitted step log-probs anticipate; None: the
    # model's own logits. TRL's GRPO / RLOO set their T (nmst_fast.integrations.trl).
    model._nmst_generation_temperature = 1.0 if generation_logits else None
    model.accepts_loss_kwargs = True  # HF Trainer then passes num_items_in_batch (one divisor per accumulated batch)
    _guard_the_stack(model)
    watch_trl()  # TRL's trainers then score the head (nmst_fast.integrations.trl), imported or not yet
    return model


def class_labels(model: Any, labels: torch.Tensor) -> torch.Tensor:
    """``labels`` aligned with ``input_ids`` (column i is token i, -100 ignored: what most causal LMs
    take and shift inside) in the convention of ``model``'s class, found by :func:`apply_nmst`'s probe:
    unchanged where the class shifts its labels; moved one column left, -100 last, where it scores
    ``labels[:, i]`` at position i (BART-style decoders, XLNet, XLM). Position i then scores token i + 1
    either way. (B, T) int64 in, (B, T) out."""
    shifts = getattr(model, "_nmst_shifts_labels", None)
    if shifts is None:
        raise ValueError(f"{type(model).__name__} is not patched: call apply_nmst(model, ...) first")
    if shifts:
        return labels
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)


def _accepted(function: Callable, named: dict) -> dict:
    """The arguments ``function`` takes (all of them when it has ``**kwargs``)."""
    parameters = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return named
    return {k: v for k, v in named.items() if k in parameters}


def _named_arguments(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """Positional and keyword arguments of a call, by name, as ``signature`` binds them
    (its ``**kwargs`` flattened in): the patched forward takes calls exactly as the original."""
    named = dict(signature.bind(*args, **kwargs).arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(parameter.name, {}))
    return named


def _with_self_and(signature: inspect.Signature, keywords: tuple[str, ...]) -> inspect.Signature:
    """``signature`` of a bound method as its function's (``self`` first), with keyword-only
    ``keyword=None`` parameters before any ``**kwargs`` for those it lacks."""
    parameters = list(signature.parameters.values())
    at = next((i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD), len(parameters))
    for keyword in keywords:
        if keyword not in signature.parameters:
            parameters.insert(at, inspect.Parameter(keyword, inspect.Parameter.KEYWORD_ONLY, default=None))
            at += 1
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return signature.replace(parameters=[self_parameter, *parameters])


# --- decoding -----------------------------------------------------------------------------------

class HFDecoder(nn.Module):
    """The :class:`nmst_fast.generation.DecodingModel` protocol over any HF causal LM.

    The head is the model's own output layer (tied weight and bias, the config's softcap and
    scale), so ``head="va"`` decodes exactly what the model itself would. The KV cache is HF's
    ``Cache``: rows are reordered and dropped with its ``reorder_cache``. Generation stops on every
    eos id the config lists (:attr:`stop_token_ids`); the head terminates with its own eos.

    Args:
        model: a transformers ``…ForCausalLM``.
        head, eps, eos_token_id: as :func:`apply_nmst`; None takes what ``model.config.nmst``
            recorded, else "nmst", 1e-5 and the config's eos. A value that contradicts the recorded
            one raises ValueError.
    """

    def __init__(self, model: Any, *, head: Optional[str] = None, eps: Optional[float] = None,
                 eos_token_id: Optional[int] = None) -> None:
        super().__init__()
        settings = nmst_settings(model, head=head, eps=eps, eos_token_id=eos_token_id)
        self.model = model
        self.nmst_head = output_head(model, settings)
        self.stop_token_ids = stop_token_ids(model, settings["eos_token_id"])
        self._stack = decoder_stack(model)
        parameters = inspect.signature(self._stack.forward).parameters
        # transformers renamed the KV-cache argument (past_key_values -> cache); use what this version takes.
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"

    @property
    def max_positions(self) -> Optional[int]:
        """Context plus fed tokens the model can attend over, where it has a learned position table
        (GPT-2's ``n_positions``, OPT's ``max_position_embeddings``): ``generate`` checks
        ``max_length`` against it. None for rotary / relative positions, which have no hard limit."""
        config = self.model.config.get_text_config()
        if getattr(config, "n_positions", None) is not None:
            return int(config.n_positions)
        embeddings = self.model.get_input_embeddings()
        learned = any(isinstance(m, nn.Embedding) and m is not embeddings for m in self._stack.modules())
        return int(config.max_position_embeddings) if learned else None

    @staticmethod
    def _returned_cache(out: Any) -> Any:
        # transformers 5 renamed the output field too; reading the old name there warns on every step.
        return out["cache"] if "cache" in out.keys() else out.past_key_values

    def prefill(self, contexts: torch.Tensor) -> tuple[torch.Tensor, Any]:
        out = self._stack(input_ids=contexts, use_cache=True)
        return _last_hidden_state(out)[:, -1], self._returned_cache(out)

    def decode_step(self, tokens: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        out = self._stack(input_ids=tokens[:, None], use_cache=True, **{self._cache_arg: cache})
        return _last_hidden_state(out)[:, -1], self._returned_cache(out)

    def select_cache(self, cache: Any, index: torch.Tensor) -> Any:
        cache.reorder_cache(index)
        return cache


class NMSTLogitsProcessor(LogitsProcessor):
    """Turn a model's logits into the NMST / ST log-distribution inside HF ``generate()``.

    Greedy search and sampling (with HF's top-k / top-p, which run after custom processors)
    then decode the head's exact step distribution; t = 1 at the first generated token.
    Keep HF's ``temperature`` at 1 (it would scale eos too); pass ``temperature`` here, which
    divides non-eos logits only. HF beam search hands processors log-softmaxed scores, which
    have lost the raw eos logit the head needs: that is detected and refused — decode beams with
    ``apply_nmst(model, generation_logits=True)`` (HF beam search then sees the NMST
    log-probabilities as the model's logits) or ``nmst_fast.generate(HFDecoder(model, head=...),
    strategy="beam")``. ST keeps its running state per row, so rows must not be reordered between
    steps (checked).

    One instance may serve several ``generate()`` calls: a call continues the previous step only
    when it holds the same rows grown by one token; any other shape starts a new generation at
    t = 1. The one ambiguous case — the same batch size and one token longer, but other prefixes
    (rows reordered, or a new prompt exactly one token longer than the last sequences) — raises;
    :meth:`reset` before a new ``generate()`` call avoids it.
    """

    def __init__(self, *, eos_token_id: int, head: str = "nmst", eps: float = 1e-5, temperature: float = 1.0):
        check_choice("head", head, HEADS)
        check_eps(eps)
        if isinstance(eos_token_id, bool) or not isinstance(eos_token_id, numbers.Integral):
            raise TypeError(f"eos_token_id must be one int (the head's eos; HF stops on every id of its own "
                            f"eos list), got {type(eos_token_id).__name__}")
        self.eos, self.head, self.eps, self.temperature = int(eos_token_id), head, eps, temperature
        self._prompt_length: Optional[int] = None
        self._state: Optional[torch.Tensor] = None
        self._previous: Optional[torch.Tensor] = None

    def reset(self) -> None:
        """Forget the generation in progress: the next call is step t = 1 of a new one."""
        self._prompt_length, self._state, self._previous = None, None, None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        previous = self._previous
        grown = previous is not None and input_ids.shape[0] == previous.shape[0] and \
            input_ids.shape[1] == previous.shape[1] + 1
        if grown and not torch.equal(input_ids[:, :-1], previous):
            raise ValueError("NMSTLogitsProcessor: the rows changed between consecutive steps — HF reordered "
                             "them (the head's step and ST's running state follow each row), or a new generate() "
                             "call began with prompts one token longer than the last sequences: call reset() "
                             "before reusing a processor")
        if not grown:  # a new generate() call: t = 1 at its first generated token
            self._prompt_length, self._state = input_ids.shape[1], None
        # HF runs its own processors first. min_new_tokens / min_length / suppress_tokens ban eos
        # (score −inf), which the head would read as a logit making p(eos) = α_t > 0 (NMST) or 1
        # (ST); forced_eos_token_id leaves eos the only finite score. A ban keeps eos at 0 and
        # renormalizes the rest, a force keeps eos at 1; ST, whose running sum needs every step's
        # real eos logit, refuses a ban.
        banned = forced = None
        if 0 <= self.eos < scores.shape[-1]:
            eos_score = scores[:, self.eos]
            banned = eos_score == float("-inf")
            others = scores.index_fill(-1, torch.tensor([self.eos], device=scores.device), float("-inf"))
            forced = torch.isfinite(eos_score) & (others.amax(dim=-1) == float("-inf"))
        free = None if forced is None else ~forced
        if torch.allclose(torch.logsumexp(scores[free].double(), dim=-1), torch.zeros((), dtype=torch.float64),
                          atol=1e-4) and (free is None or bool(free.any())):
            raise ValueError("NMSTLogitsProcessor got normalized log-probs (HF beam search): the raw eos logit "
                             "is gone; use apply_nmst(model, generation_logits=True) without the processor, "
                             "or nmst_fast.generate(HFDecoder(model, head=...), strategy='beam')")
        if banned is not None and self.head == "st" and bool(banned.any()):
            raise ValueError("NMSTLogitsProcessor: eos arrives as -inf (HF's min_new_tokens / min_length / "
                             "suppress_tokens ran first and banned it); head 'st' needs the raw eos logit at every "
                             "step for its running sum: drop those options, or decode with head 'nmst'")
        any_forced = forced is not None and bool(forced.any())
        # A forced row has no non-eos logit to normalize: the head reads zeros there (its row ends now).
        logits = scores.masked_fill(forced[:, None], 0.0) if any_forced else scores
        t = input_ids.shape[1] - self._prompt_length + 1
        log_p, state = step_log_probs(logits, head=self.head, eos_index=self.eos, eps=self.eps, steps=t,
                                      state=self._state, temperature=self.temperature)
        if banned is not None and bool(banned.any()):
            # The head's distribution conditioned on "not eos": the non-eos softmax, eos at 0.
            log_p[banned] = torch.log_softmax(scores[banned].to(log_p.dtype) / self.temperature, dim=-1)
        if any_forced:
            log_p[forced] = torch.where(torch.isfinite(scores[forced]), 0.0, float("-inf")).to(log_p.dtype)
        self._state, self._previous = state, input_ids
        return log_p.to(scores.dtype)
