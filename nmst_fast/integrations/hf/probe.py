"""The probe: does the fused path see the model's own logits, and which labels does the class score?

Before a head goes on a model, its own forward and the fused path (the decoder stack, then the output layer
with the config's post-processing) run on a short input twice (on a small random copy of the model, the same class
and configuration but for its sizes: :mod:`.shrink`; on the model itself where no copy builds, or to confirm the
copy's refusal): with the output layer's weights as they are,
and scaled so that the logits span about ±50 (a cap or other nonlinearity is invisible on small logits; the
weights are restored bit for bit). A model whose logits the fused path does not reproduce at both scales,
or whose own loss reaches a parameter the fused loss would leave untrained, is refused with a ``ValueError``
naming its type; the class's own loss tells whether it shifts its labels.
"""

from __future__ import annotations

import math
import types
from typing import Any, Callable, Optional

import torch

from ...head import NMSTHead
from ...settings import HeadSettings
from .shrink import small_copy
from .structure import (
    SOFTCAP_KEYS,
    accepted,
    decoder_hidden,
    decoder_stack,
    linear_of,
    model_name,
    output_head,
    output_layer,
)

PROBE_SPAN = 50.0  # max |logit| of the second probe: a cap of 30 (Gemma's) moves it by 22


def own_call(model: Any, forward: Callable, **named: Any) -> Any:
    """The model's own forward on the probe's arguments, without a KV cache (where it takes one), as
    training calls it; a failure is a refusal that names the model."""
    no_cache = accepted(forward, {"use_cache": False})  # empty where the forward takes no use_cache
    try:
        return forward(**named, **no_cache)
    except Exception as error:
        raise ValueError(f"{model_name(model)}: its own forward fails on a probe batch of token ids with labels "
                         f"({type(error).__name__}: {error}); this model type is not supported") from error


def _matches(loss: torch.Tensor, candidate: torch.Tensor) -> bool:
    # The candidate is the float64 cross-entropy of the very logits the model's loss read (HF's losses
    # upcast them to float32 at least): they agree to the loss's own precision.
    precision = max(torch.finfo(loss.dtype).eps, torch.finfo(torch.float32).eps)
    return abs(float(loss) - float(candidate)) <= 8 * precision * max(1.0, abs(float(candidate)))


def probe_class(model: Any, model_class: type, settings: HeadSettings) -> bool:
    """:func:`probe` of ``model`` (an instance of ``model_class``, or of an NMST class over it) with the head of
    ``settings``, run on a small copy of it (:func:`~.shrink.small_copy`): its modeling code and its config's logit
    post-processing are the model's, its weights are not read. Where no small copy builds, or the copy is refused,
    the model itself is probed (a refusal is then the model's own). Returns whether the class shifts its labels."""
    small = small_copy(model, model_class)
    if small is not None:
        try:
            return probe(small, types.MethodType(model_class.forward, small), output_head(small, settings))
        except ValueError:
            pass
    return probe(model, types.MethodType(model_class.forward, model), output_head(model, settings))


def probe(model: Any, forward: Callable, head: NMSTHead) -> bool:
    """Refuse a model whose logits the fused path does not reproduce (an unknown post-processing, a
    head that is not a plain linear layer), and find how the class aligns ``labels``: compare the
    model's own ``forward`` with the fused path's logits on a short input, at the weights' own scale and
    at ±:data:`PROBE_SPAN`, then restore them. Returns whether the class shifts its labels (token i+1
    is the target at position i, as most causal LMs do) rather than scoring ``labels[i]`` at position i."""
    name = model_name(model)
    layer = linear_of(output_layer(model))
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
                own = own_call(model, forward, input_ids=ids, labels=labels)
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
                if raw >= 0.8 * PROBE_SPAN:
                    return _shifts_labels(name, own.loss, own.logits, labels)
                for p in params:  # tied input embeddings scale too: measure again
                    p.mul_(PROBE_SPAN / max(raw, 1e-3))
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
        loss = own_call(model, forward, input_ids=ids, labels=labels).loss
        grads = torch.autograd.grad(loss, [p for _, p in others], allow_unused=True) if loss is not None else ()
    reached = [n for (n, _), g in zip(others, grads) if g is not None and bool(g.any())]
    if reached:
        raise ValueError(f"{model_name(model)}: parameters outside the decoder stack and the output layer shape its "
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
