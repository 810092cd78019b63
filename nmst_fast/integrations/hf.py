"""Any Hugging Face causal LM with an NMST / ST / VA head.

* :func:`apply_nmst` — train a ``…ForCausalLM`` with the fused loss (no (B, T, V) logits), t per row.
* :func:`steps_from_labels`, :func:`steps_from_positions`, :func:`steps_from_attention_mask` — the
  step t of every token, aligned with ``labels``.
* :class:`HFDecoder` — the model under :func:`nmst_fast.generate` (greedy, top-k, nucleus, beam).
* :class:`NMSTLogitsProcessor` — HF ``generate()`` greedy / sampling on the head's distribution.

Nothing here names a model family: the decoder stack is ``model.base_model``, the output layer
``model.get_output_embeddings()`` (weight, and bias where the model has one), and the logits'
post-processing comes from the config (``final_logit_softcapping``: Gemma 2/3; ``logit_scale``:
Cohere; ``logits_scaling``: Granite). :func:`apply_nmst` checks on a probe input that this
reproduces the model's own logits and refuses the model otherwise.
"""

from __future__ import annotations

import inspect
import math
import numbers
import types
from typing import Any, Callable, Optional

import torch
from torch import nn
from transformers import LogitsProcessor, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..decoding import step_log_probs
from ..head import NMSTHead
from ..loss import linear_nmst_loss
from ..validation import HEADS, IMPLS, check_choice, check_eps, check_int_tensor

_DEFAULTS = dict(head="nmst", eps=1e-5, context_length=None)


# --- what a model's output layer is -----------------------------------------------------------

def _causal_lm_class_names() -> set[str]:
    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def _output_layer(model: Any, *, check_weight: bool = True) -> nn.Module:
    """The model's output layer (``get_output_embeddings()``: an ``nn.Linear``, or PEFT's
    ``modules_to_save`` copy of one), read at every call so that wrapping the model later is seen.
    ``check_weight=False`` leaves its weight unread (:func:`_check_output_weight` then checks it
    inside the layer's call): during DeepSpeed's forward, ZeRO-3 gathers a partitioned weight
    wherever it is read and keeps it gathered until the module that read it returns."""
    layer = model.get_output_embeddings()
    if hasattr(layer, "base_layer"):  # a PEFT tuner layer: its adapter is not part of .weight
        raise ValueError(f"{type(model).__name__}: the output layer carries an adapter ({type(layer).__name__}); the "
                         "fused loss reads the layer's weight alone: train it under modules_to_save instead")
    if check_weight:
        _check_output_weight(model, layer)
    return layer


def _check_output_weight(model: Any, layer: nn.Module) -> None:
    weight = getattr(layer, "weight", None)
    if hasattr(weight, "ds_shape") and weight.numel() == 0:
        raise ValueError(f"{type(model).__name__}: its output layer's weight is partitioned by DeepSpeed ZeRO-3 (a "
                         "model built under deepspeed.zero.Init, as from_pretrained does while Hugging Face's ZeRO-3 "
                         "config is active); apply_nmst probes the whole model: patch it whole, then hand it to "
                         "deepspeed.initialize, which partitions it")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{type(model).__name__}: the output layer (get_output_embeddings()) must be an nn.Linear "
                         f"with a (V, H) weight, got {type(layer).__name__}")


def _check_causal_lm(model: Any) -> nn.Module:
    """The model's output layer, after checking that ``model`` is a causal LM this module can patch."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel (a …ForCausalLM), got {type(model).__name__}")
    causal = _causal_lm_class_names()
    if not any(cls.__name__ in causal for cls in type(model).__mro__) or model.config.is_encoder_decoder:
        raise ValueError(f"model must be a causal LM (AutoModelForCausalLM), got {type(model).__name__} "
                         f"(model_type {model.config.model_type!r})")
    layer = _output_layer(model)
    if model.base_model is model:
        raise ValueError(f"{type(model).__name__} has no separate decoder stack (base_model)")
    return layer


def logit_postprocessing(config: Any) -> tuple[Optional[float], Optional[float]]:
    """(softcap, logit_scale) such that the model's logits are softcap·tanh(logit_scale·z / softcap)
    (or logit_scale·z without softcap) for z = the output layer's output; each None when absent.
    Read from the text config: ``final_logit_softcapping`` (Gemma 2/3), ``logit_scale`` (Cohere,
    multiplies), ``logits_scaling`` (Granite, divides)."""
    config = config.get_text_config()
    softcap = getattr(config, "final_logit_softcapping", None)
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


def _probe(model: Any, forward: Callable, head: NMSTHead) -> None:
    """Refuse a model whose logits the fused path does not reproduce (an unknown post-processing,
    a head that is not a plain linear layer): compare both on a short input."""
    V = head.vocab_size
    device = head.weight.device
    ids = (torch.arange(7, device=device) * 7919 % V)[None]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = forward(input_ids=ids).logits.float()
            ours = head(_last_hidden_state(model.base_model(input_ids=ids))).float()
    finally:
        model.train(was_training)
    precision = torch.finfo(head.weight.dtype).eps
    tolerance = 64 * precision * max(1.0, float(expected.abs().max()))
    if ours.shape != expected.shape or not bool(((ours - expected).abs() <= tolerance).all()):
        error = float((ours - expected).abs().max()) if ours.shape == expected.shape else math.inf
        raise ValueError(
            f"{type(model).__name__} (model_type {model.config.model_type!r}): the fused loss would not see the "
            f"model's own logits (max difference {error:.3g} on a probe input): its logits are not "
            "softcap·tanh(scale·(W h + b) / softcap) of base_model's last hidden state with the config's "
            "final_logit_softcapping / logit_scale / logits_scaling; this model type is not supported")


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


def _fused_loss(model, settings: dict, impl: str, named: dict, labels: torch.Tensor,
                nmst_steps: Optional[torch.Tensor], num_items_in_batch) -> CausalLMOutputWithPast:
    # The weight is read inside the layer's call alone (loss_of), where FSDP2 / ZeRO-3 hold it whole:
    # read here, ZeRO-3 would gather it for the whole decoder stack's forward.
    layer = _output_layer(model, check_weight=False)
    for unused in ("logits_to_keep", "num_logits_to_keep", "return_dict"):
        named.pop(unused, None)
    named["use_cache"] = False
    out = model.base_model(**_accepted(model.base_model.forward, named))
    hidden = _last_hidden_state(out)
    if labels.shape != hidden.shape[:2]:
        raise ValueError(f"labels must be (B, T)={tuple(hidden.shape[:2])} like input_ids, got {tuple(labels.shape)}")
    labels = labels.to(hidden.device)
    if nmst_steps is None:
        steps = default_steps(labels, settings, attention_mask=named.get("attention_mask"),
                              position_ids=named.get("position_ids"))
    else:
        check_int_tensor("nmst_steps", nmst_steps)
        if nmst_steps.shape != labels.shape:
            raise ValueError(f"nmst_steps must be (B, T)={tuple(labels.shape)} aligned with labels, "
                             f"got {tuple(nmst_steps.shape)}")
        steps = nmst_steps.to(hidden.device)
    softcap, scale = logit_postprocessing(model.config)
    head = settings["head"]

    def loss_of(h: torch.Tensor) -> torch.Tensor:
        _check_output_weight(model, layer)
        # Token i+1 is predicted at position i, as HF shifts its labels.
        return linear_nmst_loss(h, layer.weight, labels[:, 1:], bias=layer.bias, eos_index=settings["eos_token_id"],
                                eps=settings["eps"], head=head, steps=None if head == "va" else steps[:, 1:],
                                softcap=softcap, logit_scale=scale,
                                reduction="mean" if num_items_in_batch is None else "sum", impl=impl)

    loss = _in_output_layer(layer, hidden[:, :-1], loss_of)
    if num_items_in_batch is not None:  # HF Trainer's gradient accumulation: one divisor for the whole batch
        loss = loss / num_items_in_batch
    return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(out, "hidden_states", None),
                                  attentions=getattr(out, "attentions", None))


def apply_nmst(model: Any, *, head: Optional[str] = None, eps: Optional[float] = None,
               context_length: Optional[int] = None, eos_token_id: Optional[int] = None, impl: str = "auto",
               generation_logits: bool = False) -> Any:
    """Make any HF causal LM train with the fused NMST / ST / VA loss (returns ``model``, patched).

    With ``labels``, ``model(input_ids, labels=..., nmst_steps=None, ...)`` runs ``model.base_model``,
    then :func:`nmst_fast.linear_nmst_loss` on its last hidden state and the output layer's weight
    (and bias), with the config's logit softcap and scale — inside the output layer's own call, so
    sharding hooks gather its weight. The (B, T, V) logits are never formed (``logits`` is None).
    Labels are shifted inside as in HF (-100 ignored). ``nmst_steps`` (B, T), aligned with ``labels``,
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
    _probe(model, original_forward, output_head(model, settings))
    model.config.nmst = {k: settings[k] for k in ("head", "eps", "context_length", "eos_token_id")}
    signature = inspect.signature(original_forward)  # bound: without self
    eos = settings["eos_token_id"]
    prompt = {}  # length of the prompt of the generation in progress (set at its prefill call)

    def step_distribution(out, cache, new_tokens: int):
        # A call without a cache scores the token after its input (t = 1), as a prefill does;
        # with one, the cache already holds this call's tokens.
        total = new_tokens if cache is None else cache.get_seq_length()
        if total == new_tokens:  # prefill: a new generation starts
            prompt["length"] = total
        t = total - prompt["length"] + 1
        log_p, _ = step_log_probs(out.logits[:, -1], head=settings["head"], eos_index=eos, eps=settings["eps"],
                                  steps=t)
        out.logits[:, -1] = log_p.to(out.logits.dtype)
        return out

    def forward(self, *args, num_items_in_batch=None, nmst_steps=None, **kwargs):
        named = _named_arguments(signature, args, kwargs)
        labels = named.pop("labels", None)
        if labels is not None:
            return _fused_loss(self, settings, impl, named, labels, nmst_steps, num_items_in_batch)
        if nmst_steps is not None:
            raise ValueError("nmst_steps is given without labels: it is the t of each label")
        out = original_forward(**named)
        if not generation_logits:
            return out
        cache = named.get("cache", named.get("past_key_values"))
        ids = named.get("input_ids")
        return step_distribution(out, cache, (ids if ids is not None else named["inputs_embeds"]).shape[1])

    # HF generate() reads the forward's signature to decide whether to pass attention_mask and
    # position_ids (left-padded prompts need both): advertise the original's, plus ours.
    forward.__signature__ = _with_self_and(signature, ("num_items_in_batch", "nmst_steps"))
    model.forward = types.MethodType(forward, model)
    model._nmst_original_forward = original_forward
    model.accepts_loss_kwargs = True  # HF Trainer then passes num_items_in_batch (one divisor per accumulated batch)
    return model


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
        parameters = inspect.signature(model.base_model.forward).parameters
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
        learned = any(isinstance(m, nn.Embedding) and m is not embeddings for m in self.model.base_model.modules())
        return int(config.max_position_embeddings) if learned else None

    @staticmethod
    def _returned_cache(out: Any) -> Any:
        # transformers 5 renamed the output field too; reading the old name there warns on every step.
        return out["cache"] if "cache" in out.keys() else out.past_key_values

    def prefill(self, contexts: torch.Tensor) -> tuple[torch.Tensor, Any]:
        out = self.model.base_model(input_ids=contexts, use_cache=True)
        return _last_hidden_state(out)[:, -1], self._returned_cache(out)

    def decode_step(self, tokens: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        out = self.model.base_model(input_ids=tokens[:, None], use_cache=True, **{self._cache_arg: cache})
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
