"""The patch: a Hugging Face causal LM whose loss is the head's fused loss.

:func:`apply_nmst` checks the model on a probe input (:mod:`~nmst_fast.integrations.hf.probe`), records the
head in its config and replaces its forward: with labels, the loss is :func:`~.scoring.score_labels`'s (no
(B, T, V) logits); without, the model's own forward runs, and HF generation sees the head's step distribution
where :mod:`~nmst_fast.integrations.hf.generation` asks for it.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import types
from typing import Any, Iterator, Optional

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from ...validation import IMPLS, check_choice
from .generation import step_distribution
from .probe import probe
from .scoring import score_labels
from .settings import nmst_settings
from .structure import decoder_hidden, decoder_stack, model_name, output_head

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
    name = model_name(model)

    def guard(module, args, kwargs):
        if module.training and torch.is_grad_enabled() and not getattr(_CALLS, "depth", 0):
            raise ValueError(f"NMST head: {name}'s decoder stack is training outside the patched forward: something "
                             "replaced model.forward after apply_nmst (Liger's fused linear cross-entropy, a hub "
                             "kernel's or a trainer's own fused LM head), and its loss would not be the head's. Turn "
                             "that fused loss off, or apply the kernels before apply_nmst and let it patch the result")

    stack.register_forward_pre_hook(guard, with_kwargs=True)
    stack._nmst_guarded = True


def named_arguments(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """Positional and keyword arguments of a call, by name, as ``signature`` binds them
    (its ``**kwargs`` flattened in): the patched forward takes calls exactly as the original."""
    named = dict(signature.bind(*args, **kwargs).arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(parameter.name, {}))
    return named


def signature_with(signature: inspect.Signature, keywords: tuple[str, ...]) -> inspect.Signature:
    """``signature`` of a bound method as its function's (``self`` first), with keyword-only
    ``keyword=None`` parameters before any ``**kwargs`` for those it lacks: HF ``generate()`` reads a forward's
    signature to decide which arguments (attention_mask, position_ids) to pass."""
    parameters = list(signature.parameters.values())
    at = next((i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD), len(parameters))
    for keyword in keywords:
        if keyword not in signature.parameters:
            parameters.insert(at, inspect.Parameter(keyword, inspect.Parameter.KEYWORD_ONLY, default=None))
            at += 1
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return signature.replace(parameters=[self_parameter, *parameters])


def apply_nmst(model: Any, *, head: Optional[str] = None, eps: Optional[float] = None,
               context_length: Optional[int] = None, eos_token_id: Optional[int] = None, impl: str = "auto",
               generation_logits: bool = False) -> Any:
    """Make any HF causal LM train with the fused NMST / ST / VA loss (returns ``model``, patched).

    With ``labels``, ``model(input_ids, labels=..., nmst_steps=None, ...)`` runs :func:`decoder_stack`,
    then :func:`nmst_fast.linear_nmst_loss` on its last hidden state and the output layer's weight
    (and bias), with the config's logit softcap and scale — inside the output layer's own call, so
    sharding hooks gather its weight (:func:`~nmst_fast.integrations.hf.scoring.score_labels`). The (B, T, V)
    logits are never formed (``logits`` is None).
    Labels follow the class's own convention, found on the probe: most causal LMs shift them inside
    (position i is scored on ``labels[:, i + 1]``); a few (the ``…ForCausalLM`` of BART-style decoders,
    XLNet's and XLM's LM heads) score ``labels[:, i]`` at position i, and so does the fused loss
    for them (-100 ignored). ``nmst_steps`` (B, T), aligned with ``labels``,
    gives the t of each token (t ≤ 0: context); without it, :func:`~.steps.default_steps`: from the labels
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
    if generation_logits and settings.head == "st":
        raise ValueError("generation_logits=True supports head 'nmst' and 'va': ST's running state cannot "
                         "follow HF's beam reordering; use NMSTLogitsProcessor or HFDecoder for ST")
    original_forward = getattr(model, "_nmst_original_forward", model.forward)
    shifted = probe(model, original_forward, output_head(model, settings))
    model.config.nmst = settings.recorded()
    signature = inspect.signature(original_forward)  # bound: without self
    prompt: dict = {}  # the generation in progress: its prompt's length (set at its prefill call), ST's state

    def forward(self, *args, num_items_in_batch=None, nmst_steps=None, **kwargs):
        named = named_arguments(signature, args, kwargs)
        labels = named.pop("labels", None)
        if labels is not None:
            with patched_call():
                out, hidden = decoder_hidden(self, **named)
                scores = score_labels(self, hidden, labels, settings, shifted=shifted, steps=nmst_steps,
                                      attention_mask=named.get("attention_mask"),
                                      position_ids=named.get("position_ids"),
                                      reduction="mean" if num_items_in_batch is None else "sum",
                                      steps_name="nmst_steps")
            loss = scores.nll
            if num_items_in_batch is not None:  # HF Trainer's gradient accumulation: one divisor for the whole batch
                loss = loss / num_items_in_batch
            return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(out, "hidden_states", None),
                                          attentions=getattr(out, "attentions", None))
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
        return step_distribution(out, settings, prompt, cache,
                                 (ids if ids is not None else named["inputs_embeds"]).shape[1], temperature)

    forward.__signature__ = signature_with(signature, ("num_items_in_batch", "nmst_steps"))
    model.forward = types.MethodType(forward, model)
    model._nmst_original_forward = original_forward
    model._nmst_shifts_labels = shifted
    model._nmst_impl = impl
    # The temperature T of HF's sampling whose division the emitted step log-probs anticipate; None: the
    # model's own logits. TRL's GRPO / RLOO set their T (nmst_fast.integrations.trl).
    model._nmst_generation_temperature = 1.0 if generation_logits else None
    model.accepts_loss_kwargs = True  # HF Trainer then passes num_items_in_batch (one divisor per accumulated batch)
    _guard_the_stack(model)
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
