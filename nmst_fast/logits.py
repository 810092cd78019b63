"""The logits a head reads: a model's logit post-processing, and the eos logit alone.

Some models post-process the output layer's z = W h (+ b): a scale (Cohere's ``logit_scale``, Granite's
``logits_scaling``) and a cap (Gemma 2/3's ``final_logit_softcapping``). The heads then see
y = softcap · tanh(logit_scale · z / softcap) (logit_scale · z without a cap). NMST and ST need y's eos
entry s at every position, which costs one (N, H) · (H,) product instead of the (N, V) logits.
"""

from __future__ import annotations

from typing import Optional

import torch


def postprocess_logits(z: torch.Tensor, softcap: Optional[float] = None,
                       logit_scale: Optional[float] = None) -> torch.Tensor:
    """y = softcap · tanh(logit_scale · z / softcap), each step skipped when its argument is None; any shape,
    ``z``'s dtype."""
    if logit_scale is not None:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


def eos_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eos_index: int, *,
               softcap: Optional[float] = None, logit_scale: Optional[float] = None,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The post-processed eos logit s of every row: (…,) for ``hidden`` (…, H), ``weight`` (V, H), ``bias`` (V,)
    or None. Computed in ``dtype`` (default: ``hidden``'s, at least float32)."""
    dtype = dtype or torch.promote_types(hidden.dtype, torch.float32)
    s = hidden.to(dtype) @ weight[eos_index].to(dtype)
    if bias is not None:
        s = s + bias[eos_index].to(dtype)
    return postprocess_logits(s, softcap, logit_scale)
