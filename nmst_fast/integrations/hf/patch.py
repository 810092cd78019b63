"""The head on a Hugging Face causal LM: :func:`apply_nmst`, and the NMST model classes it turns models into.

:func:`apply_nmst` checks the model on a probe input (:mod:`~nmst_fast.integrations.hf.probe`), records the
head in its config and turns the model (in place) into an instance of ``NMST<its class>``: a subclass of its own
class with :class:`NMSTModelMixin` first, whose config is likewise ``NMST<its config class>``
(:mod:`nmst_fast.integrations.nmst_config`). The model keeps every weight, module and method of its class; what
changes:

* ``forward`` with ``labels``: the head's fused loss (:func:`~.scoring.score_labels`; training forms no (B, T, V)
  logits; an evaluation forward, without grad, also returns the head's logits of the positions ``logits_to_keep``
  names, every one by default as HF models give them, none for an empty index);
  without labels the class's own forward, whose last-position logits carry the head's step distribution while
  ``generate()`` runs (:mod:`~.generation`);
* ``generate()``: decodes the head (:func:`~.generation.generate_with_head`);
* ``save_pretrained()``: writes the NMST checkpoint type, which ``from_pretrained`` opens with the head on.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from typing import Any, Callable, Iterator, Optional, Union

import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ...settings import HeadSettings
from ...validation import IMPLS, check_choice, check_int_tensor, resolve_grad_filter
from ..nmst_config import MODEL_TYPE, config_class_for
from .generation import generate_with_head, step_logits
from .head_logits import head_logits, kept_positions, position_steps
from .probe import probe_class
from .scoring import score_labels
from .settings import nmst_settings
from .structure import decoder_hidden, decoder_stack, model_name, output_logits

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


class _StackGuard:
    """A forward pre-hook on the decoder stack: a training step (stack in training mode, grad on) that reaches
    the stack other than through the patched forward comes from a forward that replaced it after
    :func:`apply_nmst` — Liger's fused linear cross-entropy, a trainer's own fused LM head — whose loss is
    not the head's. It raises before the step runs, instead of training another loss in silence. (A class, not a
    closure, so that a model with its hooks pickles.)"""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training and torch.is_grad_enabled() and not getattr(_CALLS, "depth", 0):
            raise ValueError(f"NMST head: {self.name}'s decoder stack is training outside the patched forward: "
                             "something replaced model.forward after apply_nmst (Liger's fused linear cross-entropy, "
                             "a hub kernel's or a trainer's own fused LM head), and its loss would not be the head's. "
                             "Turn that fused loss off, or apply the kernels before apply_nmst and let it patch the "
                             "result")


def _guard_the_stack(model: Any) -> None:
    """:class:`_StackGuard` on the model's decoder stack, once."""
    stack = decoder_stack(model)
    if getattr(stack, "_nmst_guarded", False):
        return
    stack.register_forward_pre_hook(_StackGuard(model_name(model)), with_kwargs=True)
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


def _bound_signature(function: Callable) -> inspect.Signature:
    """A method's signature without ``self``."""
    signature = inspect.signature(function)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


class NMSTModelMixin:
    """What a causal LM class gets as an ``NMST<Class>``: the head's forward, generate and checkpoint.

    The instance holds ``_nmst_settings`` (:class:`~nmst_fast.settings.HeadSettings`), ``_nmst_shifts_labels``
    and ``_nmst_impl``, set by :func:`apply_nmst`; ``from_pretrained`` and ``from_config`` of an NMST class run
    :func:`apply_nmst` with the config's recorded head."""

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        loaded = super().from_pretrained(*args, **kwargs)
        apply_nmst(loaded[0] if isinstance(loaded, tuple) else loaded)
        return loaded

    @classmethod
    def _from_config(cls, config: Any, **kwargs: Any) -> Any:
        return apply_nmst(super()._from_config(config, **kwargs))

    def forward(self, *args: Any, num_items_in_batch: Any = None, nmst_steps: Optional[torch.Tensor] = None,
                nmst_logits: bool = True, **kwargs: Any) -> Any:
        settings: Optional[HeadSettings] = self.__dict__.get("_nmst_settings")
        if settings is None:
            raise ValueError(f"{type(self).__name__} has no head yet: build it with from_pretrained / from_config, "
                             "or call nmst_fast.integrations.hf.apply_nmst(model) on it")
        named = named_arguments(type(self)._nmst_signature, args, kwargs)
        labels = named.pop("labels", None)
        shifted = self._nmst_shifts_labels
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
            logits = None
            if not torch.is_grad_enabled():  # evaluation: the logits too, as any HF model gives them with its loss,
                # of the positions logits_to_keep names (the loss takes every label; an empty index: the loss alone)
                keep = named.get("logits_to_keep", 0)
                logits = output_logits(self, hidden[:, kept_positions(keep)], settings)
                if nmst_logits:
                    steps = scores.steps
                    if shifted:  # the last position predicts the token after the input
                        steps = torch.cat([steps, steps[:, -1:].clamp(min=0) + 1], dim=1)
                    logits = head_logits(logits, settings, steps, keep)
            return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=getattr(out, "hidden_states", None),
                                          attentions=getattr(out, "attentions", None))
        with patched_call():
            out = super().forward(**named)
        generation = self.__dict__.get("_nmst_generation")
        if generation is not None:
            if nmst_steps is not None:
                raise ValueError("nmst_steps: generate() counts t from the first generated token itself")
            return step_logits(out, generation)
        if nmst_logits and out.logits is not None:
            ids = named.get("input_ids")
            shape = ids.shape if ids is not None else named["inputs_embeds"].shape[:2]
            steps = position_steps(settings, shape, out.logits.device, shifted=shifted,
                                   attention_mask=named.get("attention_mask"), position_ids=named.get("position_ids"),
                                   nmst_steps=nmst_steps)
            out.logits = head_logits(out.logits, settings, steps, named.get("logits_to_keep", 0))
        elif nmst_steps is not None:
            raise ValueError("nmst_steps is the t of the head's logits: it has no use with nmst_logits=False")
        return out

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return generate_with_head(self, super().generate, *args, **kwargs)


def own_class(model: Any) -> type:
    """The class the model had before :func:`apply_nmst` (its class itself when it has no head)."""
    if not isinstance(model, NMSTModelMixin):
        return type(model)
    return next(cls for cls in type(model).__mro__
                if issubclass(cls, PreTrainedModel) and not issubclass(cls, NMSTModelMixin))


def model_class_for(base: type, config_class: Optional[type] = None) -> type:
    """``NMST<base>``: the causal LM class ``base`` with :class:`NMSTModelMixin` first, its config class
    ``NMST<config_class>`` (default: the base's own config class); one class per pair, named in this module so
    that pickling finds it (:func:`__getattr__`)."""
    if issubclass(base, NMSTModelMixin):
        return base
    return _nmst_class(base, config_class_for(config_class or base.config_class))


@functools.cache
def _nmst_class(base: type, config_class: type) -> type:
    signature = _bound_signature(base.forward)

    def forward(self, *args, **kwargs):
        return NMSTModelMixin.forward(self, *args, **kwargs)

    forward.__signature__ = signature_with(signature, ("num_items_in_batch", "nmst_steps", "nmst_logits"))
    forward.__doc__ = NMSTModelMixin.forward.__doc__
    name = f"NMST{base.__name__}"
    return type(name, (NMSTModelMixin, base), {
        "__module__": __name__, "__qualname__": name, "forward": forward, "_nmst_signature": signature,
        "config_class": config_class})


def __getattr__(name: str) -> type:
    """``NMST<Class>`` model classes by name, made on demand: unpickling a model finds them."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if name.startswith("NMST"):
        for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
            for class_name in [value] if isinstance(value, str) else value:
                if class_name == name[len("NMST"):]:
                    return model_class_for(getattr(transformers, class_name))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def has_head(model: Any) -> bool:
    """Whether ``model`` carries a head (:func:`apply_nmst` ran on it)."""
    return isinstance(model, NMSTModelMixin) and "_nmst_settings" in model.__dict__


def apply_nmst(model: Any, *, head: Optional[str] = None, eps: Optional[float] = None,
               context_length: Optional[int] = None, eos_token_id: Optional[int] = None,
               impl: str = "auto", grad_filter: Union[None, float, str] = None) -> Any:
    """Put a head on any HF causal LM (returns ``model``, now an ``NMST<its class>`` instance: see the module).

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
    Without labels the forward is the model's own; ``generate()`` decodes the head's step distribution in every
    mode it can follow (:func:`~.generation.generate_with_head`).

    Args:
        model: a transformers ``…ForCausalLM`` (``from_pretrained(local_dir)`` or random init), with or without
            a head already (a head already on it is re-checked with the settings given).
        head, eps, context_length: the head; None takes what ``model.config.nmst`` recorded, else
            "nmst", 1e-5 and no fixed context.
        eos_token_id: the token the head terminates with; None takes the config's (refused when the
            config lists several, as Llama 3's does: pick one).
        impl: the fused loss's backend (see :func:`nmst_fast.linear_nmst_loss`).
        grad_filter: the fused loss's gradient filter in training (None: off; "auto" or a threshold, see
            :func:`nmst_fast.linear_nmst_loss`); not saved with the model.
    Raises:
        TypeError / ValueError: not a causal LM, no linear output layer, no eos, bad settings, or a
        model whose own logits the fused path does not reproduce on a probe input (checked here).
    """
    check_choice("impl", impl, IMPLS)
    resolve_grad_filter(grad_filter, torch.bfloat16)  # refuses a bad value now, not at the first training step
    settings = nmst_settings(model, head=head, eps=eps, context_length=context_length, eos_token_id=eos_token_id)
    base = own_class(model)
    shifted = probe_class(model, base, settings)
    model.config.nmst = settings.recorded()
    config = model.config
    if config.model_type != MODEL_TYPE:
        config.base_model_type = config.model_type
        config.__class__ = config_class_for(type(config))
    if not isinstance(model, NMSTModelMixin):
        model.__class__ = model_class_for(base, type(config))
    model._nmst_settings = settings
    model._nmst_shifts_labels = shifted
    model._nmst_impl = impl
    model._nmst_grad_filter = grad_filter
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
    check_int_tensor("labels", labels)
    if shifts:
        return labels
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
