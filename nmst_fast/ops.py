"""``torch.library`` custom ops wrapping the fused driver, with autograd.

Registering the fused loss as one opaque op lets ``torch.compile`` trace a model
that uses it without graph breaks (the driver's Python loop and the row
kernels stay outside the graph), and keeps the gradient-in-forward trick
inside an ordinary autograd formula:

* reduction "mean"/"sum": the forward already computed dh, dW, db of the summed loss for a
  unit upstream gradient; backward only scales them by the incoming scalar (divided by the
  active-row count for "mean", in fp32 or wider, so fp16's range never sees 1/N alone).
* reduction "none": the upstream gradient is per row, so backward recomputes
  each chunk's logits from the saved per-row L (one extra GEMM per chunk).

``eos_scale`` (default 1): the NMST/ST heads read eos's logit at that multiple of the one computed (a
temperature, see :class:`nmst_fast.fused.HeadConfig`).
``softcap`` (default None): the heads see c·tanh(z / c) (see :mod:`nmst_fast.fused`); the gradients
returned are still with respect to hidden, weight and bias. ``vocab_group`` (a process group's name,
default None) and ``vocab_start``: ``weight`` holds that group's vocabulary rows from ``vocab_start``
(:mod:`nmst_fast.vocab_shard`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .fused import (
    HeadConfig,
    dh_dtype,
    direct_dw,
    fused_backward_from_lse,
    fused_forward,
    mean_divisor,
    mean_folded,
)
from .kernels.cpu import row_kernels
from .settings import HeadSettings
from .vocab_shard import VocabShard


def _empty_like_none(t: Optional[Tensor], like: Tensor) -> Tensor:
    # Custom ops must return tensors; an empty one stands for "not computed".
    return t if t is not None else like.new_empty(0)


@torch.library.custom_op("nmst_fast::linear_loss", mutates_args=())
def linear_loss(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    targets: Tensor,
    steps: Optional[Tensor],
    seq_len: int,
    head: str,
    eos_index: int,
    eps: float,
    ignore_index: int,
    reduction: str,
    backend: str,
    chunk_rows: int,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
    softcap: Optional[float] = None,
    vocab_group: Optional[str] = None,
    vocab_start: int = 0,
    dw_dtype: Optional[torch.dtype] = None,
    eos_scale: float = 1.0,
    statistics: bool = False,
    grad_filter: Optional[float] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (loss in at least fp32, lse (N,) float64, dh, dW, db, statistics); grads are empty unless computed
    in this pass; ``statistics`` (reduction "none" only): (N, 4) float64 of each row's entropy, log Σ p², mean
    effective logit and top-1 flag (:func:`nmst_fast.head_math.row_statistics`), else empty.

    dW and db come in at least fp32 (the accumulators; dW in ``dw_dtype`` when given), dh in
    :func:`~nmst_fast.fused.dh_dtype` (at least fp32 on CPU): backward scales and casts them."""
    cfg = HeadConfig(HeadSettings(head, eps, eos_index), ignore_index, seq_len, softcap, eos_scale)
    need = (need_grad_hidden, need_grad_weight, need_grad_bias and bias is not None)  # as the fake kernel
    if reduction == "none":
        need = (False, False, False)  # per-row upstream grads are only known in backward
    # The caller cast the inputs for autocast (loss._autocast_inputs); inside, autocast would
    # re-cast the driver's own small matmuls (the eos GEMV) while its out= GEMMs keep the inputs' dtype.
    with torch.autocast(hidden.device.type, enabled=False):
        loss, lse, dh, dw, db, row_stats = fused_forward(
            hidden, weight, bias, targets, steps, cfg, reduction=reduction, backend=backend, chunk_rows=chunk_rows,
            need=need, shard=VocabShard.of(vocab_group, vocab_start, weight.shape[0]), dw_dtype=dw_dtype,
            statistics=statistics, grad_filter=grad_filter,
        )
    return (loss, lse, _empty_like_none(dh, hidden), _empty_like_none(dw, weight), _empty_like_none(db, weight),
            _empty_like_none(row_stats, lse))


@linear_loss.register_fake
def _(hidden, weight, bias, targets, steps, seq_len, head, eos_index, eps, ignore_index, reduction, backend,
      chunk_rows, need_grad_hidden, need_grad_weight, need_grad_bias, softcap=None, vocab_group=None, vocab_start=0,
      dw_dtype=None, eos_scale=1.0, statistics=False, grad_filter=None):
    N = hidden.shape[0]
    in_forward = reduction != "none"
    loss = hidden.new_empty((N,) if reduction == "none" else (), dtype=torch.promote_types(hidden.dtype, torch.float32))
    lse = hidden.new_empty(N, dtype=torch.float64)
    direct = direct_dw(N, chunk_rows, weight.dtype, hidden.device, dw_dtype)
    acc = weight.dtype if direct else dw_dtype or torch.promote_types(weight.dtype, torch.float32)
    dh = (torch.empty_like(hidden, dtype=dh_dtype(hidden.dtype, hidden.device)) if (need_grad_hidden and in_forward)
          else hidden.new_empty(0))
    dw = torch.empty_like(weight, dtype=acc) if (need_grad_weight and in_forward) else weight.new_empty(0)
    db = (torch.empty_like(bias, dtype=torch.promote_types(bias.dtype, torch.float32))
          if (need_grad_bias and in_forward and bias is not None) else weight.new_empty(0))
    row_stats = hidden.new_empty((N, 4) if statistics else (0,), dtype=torch.float64)
    return loss, lse, dh, dw, db, row_stats


@torch.library.custom_op("nmst_fast::linear_loss_backward", mutates_args=())
def linear_loss_backward(
    grad_rows: Tensor,
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    targets: Tensor,
    steps: Optional[Tensor],
    lse: Tensor,
    seq_len: int,
    head: str,
    eos_index: int,
    eps: float,
    ignore_index: int,
    backend: str,
    chunk_rows: int,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
    softcap: Optional[float] = None,
    vocab_group: Optional[str] = None,
    vocab_start: int = 0,
    dw_dtype: Optional[torch.dtype] = None,
    eos_scale: float = 1.0,
    grad_filter: Optional[float] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    cfg = HeadConfig(HeadSettings(head, eps, eos_index), ignore_index, seq_len, softcap, eos_scale)
    with torch.autocast(hidden.device.type, enabled=False):  # as in linear_loss
        dh, dw, db = fused_backward_from_lse(
            grad_rows, hidden, weight, bias, targets, steps, lse, cfg,
            backend=backend, chunk_rows=chunk_rows,
            need=(need_grad_hidden, need_grad_weight, need_grad_bias and bias is not None),
            shard=VocabShard.of(vocab_group, vocab_start, weight.shape[0]), dw_dtype=dw_dtype,
            grad_filter=grad_filter,
        )
    return _empty_like_none(dh, hidden), _empty_like_none(dw, weight), _empty_like_none(db, weight)


@linear_loss_backward.register_fake
def _(grad_rows, hidden, weight, bias, targets, steps, lse, seq_len, head, eos_index, eps, ignore_index, backend,
      chunk_rows, need_grad_hidden, need_grad_weight, need_grad_bias, softcap=None, vocab_group=None, vocab_start=0,
      dw_dtype=None, eos_scale=1.0, grad_filter=None):
    dh = torch.empty_like(hidden) if need_grad_hidden else hidden.new_empty(0)
    dw = torch.empty_like(weight) if need_grad_weight else weight.new_empty(0)
    db = torch.empty_like(bias) if (need_grad_bias and bias is not None) else weight.new_empty(0)
    return dh, dw, db


_STATIC_ARGS = ("seq_len", "head", "eos_index", "eps", "ignore_index", "backend", "chunk_rows",
                "need_grad_hidden", "need_grad_weight", "need_grad_bias", "softcap", "vocab_group", "vocab_start",
                "dw_dtype", "eos_scale", "grad_filter")


@torch.library.custom_op("nmst_fast::scale_cast", mutates_args=())
def scale_cast(acc: Tensor, scale: Tensor, dtype: torch.dtype, backend: str) -> Tensor:
    """acc · scale (a one-element tensor) in ``dtype``, the product in fp32 or wider: one pass by the
    Triton kernel (an fp32 accumulator to bf16 dW, or a bf16 dh scaled; the scale read on the
    device: no host sync), or on CPU by the C++ kernel (to bf16 / fp16); torch elsewhere. An op, so
    backward stays traceable."""
    low = (torch.float32, torch.bfloat16, torch.float16)
    if backend == "triton" and acc.dtype in low and dtype in low and acc.is_contiguous():
        from nmst_fast.kernels.scale_cast import scale_cast as kernel  # lazily: triton decides interpret mode at import

        return kernel(acc, scale, dtype)
    # The product in fp32 or wider: an fp16 scale such as 1/N would be subnormal or zero, and a bf16
    # one 0.4% off (a CUDA kernel casts a 0-dim operand to the common dtype before multiplying).
    if (acc.device.type == "cpu" and acc.dtype in low and dtype in (torch.bfloat16, torch.float16)
            and acc.is_contiguous() and (kernels := row_kernels()) is not None):
        return kernels.scale_cast(acc, float(scale), dtype)  # one pass; torch's cast makes a float32 temporary
    wide = torch.promote_types(acc.dtype, torch.float32)
    return (acc.to(wide) * scale.to(wide)).to(dtype)


@scale_cast.register_fake
def _(acc, scale, dtype, backend):
    return torch.empty_like(acc, dtype=dtype)


def _setup_context(ctx, inputs, output):
    (hidden, weight, bias, targets, steps, seq_len, head, eos_index, eps, ignore_index, reduction, backend,
     chunk_rows, need_grad_hidden, need_grad_weight, need_grad_bias, softcap, vocab_group, vocab_start,
     dw_dtype, eos_scale, _statistics, grad_filter) = inputs
    loss, lse, dh, dw, db, row_stats = output
    # Only the loss is differentiable. Without these two calls autograd would hand
    # backward zero-filled gradients for lse/dh/dW/db: a V×H allocation for nothing.
    ctx.mark_non_differentiable(lse, dh, dw, db, row_stats)
    ctx.set_materialize_grads(False)
    ctx.reduction = reduction
    ctx.static = dict(zip(_STATIC_ARGS, (seq_len, head, eos_index, eps, ignore_index, backend, chunk_rows,
                                         need_grad_hidden, need_grad_weight, need_grad_bias, softcap, vocab_group,
                                         vocab_start, dw_dtype, eos_scale, grad_filter)))
    ctx.has_bias = bias is not None
    # the forward's gradients are the mean's (not the sum's) where its dW comes out of one bf16 GEMM
    ctx.mean_folded = mean_folded(reduction, hidden.shape[0], chunk_rows, weight.dtype, hidden.device, dw_dtype)
    ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, bias, targets, steps, lse)
    else:
        # Only the finished gradients are kept (and "mean"'s targets, for its row count): no
        # activations outlive the forward.
        ctx.save_for_backward(dh, dw, db, targets if reduction == "mean" else None)


def _graph_kept() -> bool:
    """Whether the running backward keeps the graph for another (``retain_graph=True``); True where torch does not
    say."""
    kept = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if kept is None else bool(kept())


def _scaled(grad: Tensor, scale: Tensor, dtype: torch.dtype, backend: str) -> Tensor:
    """The forward's ``grad`` times the upstream ``scale`` in ``dtype`` (:func:`scale_cast`); ``grad`` itself, with no
    pass, where that is what it is: a CPU scale of exactly 1 (training's, where "mean" is folded into the forward) on a
    gradient already in ``dtype``, and a graph that no later backward reads again (a kept graph's next backward would
    hand out the same tensor, whatever the caller did to the first)."""
    if (grad.dtype == dtype and grad.device.type == "cpu" and scale.device.type == "cpu"
            and not torch.compiler.is_compiling() and not _graph_kept() and bool(scale == 1)):
        return grad
    return scale_cast(grad, scale, dtype, backend)


def _backward(ctx, grad_loss, _grad_lse, _grad_dh, _grad_dw, _grad_db, _grad_statistics):
    st = ctx.static
    if grad_loss is None:  # grads are not materialized: None means the loss got no gradient
        return (None,) * 23
    if torch.is_grad_enabled():
        # create_graph=True: the gradients come from the forward (or a recomputation) as constants,
        # so their own derivatives would be silently zero. Refuse rather than give wrong Hessians.
        raise RuntimeError("the fused loss (impl='chunked'/'triton') has no second derivatives: backward "
                           "with create_graph=True (double backward, Hessians, gradient penalties through "
                           "the loss) needs impl='reference'")
    if ctx.reduction == "none":
        hidden, weight, bias, targets, steps, lse = ctx.saved_tensors
        dh, dw, db = linear_loss_backward(grad_loss, hidden, weight, bias, targets, steps, lse, **st)
    else:
        dh, dw, db, targets = ctx.saved_tensors
        weight_dtype, bias_dtype = ctx.dtypes
        scale = grad_loss
        if ctx.reduction == "mean" and not ctx.mean_folded:  # the forward's gradients are the sum's
            scale = grad_loss.to(torch.float64) / mean_divisor(targets != st["ignore_index"])
        if st["need_grad_hidden"]:
            dh = _scaled(dh, scale, weight_dtype, st["backend"])  # hidden's dtype, which is weight's
        if st["need_grad_weight"]:
            dw = _scaled(dw, scale, weight_dtype, st["backend"])
        if st["need_grad_bias"] and ctx.has_bias:
            db = _scaled(db, scale, bias_dtype, st["backend"])
    grads = (
        dh if st["need_grad_hidden"] else None,
        dw if st["need_grad_weight"] else None,
        db if (st["need_grad_bias"] and ctx.has_bias) else None,
    )
    return grads + (None,) * 20


linear_loss.register_autograd(_backward, setup_context=_setup_context)
