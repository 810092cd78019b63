"""``NMSTHead``: a model's output layer + loss in one module."""

from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import nn

from .logits import postprocess_logits
from .loss import check_logit_option, linear_nmst_loss
from .reference import nmst_log_probs
from .validation import HEADS, IMPLS, check_choice, check_eps, check_index


class NMSTHead(nn.Module):
    """Output projection with an NMST / ST / VA head.

    Swap a model's ``lm_head`` + cross-entropy for this module: ``head.loss(h, y)``
    trains through the fused kernels (no (N, V) logits), ``head.log_probs(h)``
    gives the full log-distribution for evaluation, and ``head(h)`` the logits the head
    sees, y = softcap · tanh(logit_scale · (W h + b) / softcap) (decoding takes them as its logits).

    Args:
        hidden_size: H.
        vocab_size: V (eos included).
        eos_index: vocabulary index of eos.
        head: "nmst", "st" or "va".
        eps: ε in (0, 1).
        bias: True to learn a fresh (V,) output bias (zero-initialized, in the weight's dtype and
            device), False for none, or an existing (V,) ``nn.Parameter`` to tie to (a model's
            ``lm_head.bias``: its owner initializes it).
        weight: an existing (V, H) parameter to tie to (e.g. the input
            embedding's weight); a fresh one is created otherwise.
        impl: backend for :meth:`loss` (see :func:`nmst_fast.linear_nmst_loss`).
        softcap: None or c > 0: cap the logits by c · tanh(· / c) (Gemma 2/3).
        logit_scale: None or a > 0: multiply the logits by a before the cap (Cohere's
            ``logit_scale``; Granite's ``logits_scaling`` s is a = 1/s).
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        eos_index: int,
        head: str = "nmst",
        eps: float = 1e-5,
        bias: bool | nn.Parameter = False,
        weight: Optional[nn.Parameter] = None,
        impl: str = "auto",
        softcap: Optional[float] = None,
        logit_scale: Optional[float] = None,
    ) -> None:
        super().__init__()
        check_choice("head", head, HEADS)
        check_choice("impl", impl, IMPLS)
        check_eps(eps)
        softcap = check_logit_option("softcap", softcap)
        logit_scale = check_logit_option("logit_scale", logit_scale)
        for name, value, least in (("hidden_size", hidden_size, 1), ("vocab_size", vocab_size, 2)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < least:
                raise ValueError(f"{name} must be >= {least}" + (" (eos and one other token)" if least == 2 else "")
                                 + f", got {value}")
        check_index("eos_index", eos_index, vocab_size, "vocab_size")
        if weight is not None and not isinstance(weight, nn.Parameter):
            # A plain tensor would stay out of parameters(), state_dict() and .to(): never trained or saved.
            raise TypeError(f"weight must be an nn.Parameter (e.g. embedding.weight), got {type(weight).__name__}")
        self._owns_weight = weight is None
        if weight is None:
            weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        elif tuple(weight.shape) != (vocab_size, hidden_size):
            raise ValueError(f"weight must be (vocab_size, hidden_size)=({vocab_size}, {hidden_size}), "
                             f"got {tuple(weight.shape)}")
        self.weight = weight
        if isinstance(bias, nn.Parameter):
            if tuple(bias.shape) != (vocab_size,):
                raise ValueError(f"bias must be (vocab_size,)=({vocab_size},), got {tuple(bias.shape)}")
        elif isinstance(bias, torch.Tensor):
            # As for weight: a plain tensor would be neither trained nor saved.
            raise TypeError(f"bias must be a bool or an nn.Parameter (e.g. lm_head.bias), got {type(bias).__name__}")
        elif not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool or an nn.Parameter, got {type(bias).__name__}")
        self._owns_bias = bias is True
        if bias is True:
            # A tied weight sets the bias's dtype and device: a bf16 or CUDA embedding gets a bias it can be added to.
            bias = nn.Parameter(torch.empty(vocab_size, dtype=weight.dtype, device=weight.device))
        self.bias = bias if isinstance(bias, nn.Parameter) else None
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.eos_index, self.head, self.eps, self.impl = eos_index, head, eps, impl
        self.softcap, self.logit_scale = softcap, logit_scale
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize the head's own parameters: its weight ~ N(0, 1/hidden_size) (a tied weight is
        its owner's to initialize and is left alone) and its own bias 0 (a tied one, likewise, is
        left alone). Also what ``to_empty`` after a meta-device construction needs."""
        if self._owns_weight:
            nn.init.normal_(self.weight, std=self.hidden_size**-0.5)
        if self._owns_bias:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, eos_index={self.eos_index}, "
                f"head={self.head!r}, eps={self.eps}, bias={self.bias is not None}, impl={self.impl!r}"
                + ("" if self.softcap is None else f", softcap={self.softcap}")
                + ("" if self.logit_scale is None else f", logit_scale={self.logit_scale}"))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits y = softcap · tanh(logit_scale · z / softcap), z = W h (+ b) (z itself
        without softcap / logit_scale): (…, V) for ``hidden`` (…, H), in the weight's dtype (as
        ``F.linear`` gives it; under autocast, autocast's). Materializes them: use :meth:`loss` to train."""
        return postprocess_logits(nn.functional.linear(hidden, self.weight, self.bias), self.softcap, self.logit_scale)

    def loss(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        *,
        steps: Optional[torch.Tensor] = None,
        ignore_index: int = -100,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """Fused NLL of ``targets`` under the head on :meth:`forward`'s logits (softcap and
        logit_scale applied); see :func:`nmst_fast.linear_nmst_loss` for shapes and dtypes."""
        return linear_nmst_loss(
            hidden, self.weight, targets, eos_index=self.eos_index, eps=self.eps, head=self.head,
            steps=steps, bias=self.bias, ignore_index=ignore_index, reduction=reduction, impl=self.impl,
            softcap=self.softcap, logit_scale=self.logit_scale,
        )

    def log_probs(self, hidden: torch.Tensor, *, steps: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Full log-distribution (…, V) of the head on ``hidden`` (B, T, H) or (N, H): :func:`nmst_log_probs`
        of :meth:`forward`'s logits, in their dtype."""
        return nmst_log_probs(self(hidden), eos_index=self.eos_index, eps=self.eps, head=self.head, steps=steps)
