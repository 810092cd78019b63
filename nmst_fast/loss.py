"""Public entry point: the fused linear + NMST/ST/VA loss with ``impl=`` backend choice."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from . import ops  # noqa: F401  (registers torch.ops.nmst_fast.*)
from .backends import cpu_has_fp16_arithmetic, triton_available
from .fused import chunk_buffers, default_chunk_rows, dw_accumulator_dtype
from .reference import reference_linear_nmst_loss
from .statistics import materialized_statistics
from .validation import (
    HEADS,
    IMPLS,
    REDUCTIONS,
    check_choice,
    check_data,
    check_eps,
    check_float_tensor,
    check_index,
    check_int_tensor,
    check_not_dtensor,
    check_same_device,
    check_temperature,
    expand_steps,
    raise_value_errors,
    resolve_grad_filter,
    should_check_data,
    value_flags,
)
from .vocab_order import ordered, vocabulary_order
from .vocab_shard import check_vocab_shards, group_name_of


def resolve_impl(impl: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """Map ``impl`` to the backend that will run: "reference", "chunked" or "triton". The Triton
    kernels compute in fp32, so float64 inputs take the chunked torch path under "auto" and are
    refused by "triton" (they would silently lose float64's precision)."""
    if impl == "auto":
        return "triton" if device.type == "cuda" and dtype != torch.float64 and triton_available() else "chunked"
    if impl == "triton":
        if dtype == torch.float64:
            raise ValueError("impl='triton' computes in fp32: float64 inputs take impl='chunked' (or 'auto')")
        if not triton_available():
            raise ValueError("impl='triton' needs the triton package; use impl='chunked' or 'auto'")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"impl='triton' needs CUDA tensors (got {device}); set TRITON_INTERPRET=1 before importing "
                "to run the kernels on CPU in the Triton interpreter"
            )
    return impl


def _autocasting(hidden) -> bool:
    """Whether ``torch.autocast`` is on for ``hidden``'s device ("meta" has no autocast: shape dry runs)."""
    return (isinstance(hidden, torch.Tensor) and torch.amp.is_autocast_available(hidden.device.type)
            and torch.is_autocast_enabled(hidden.device.type))


def _autocast_inputs(hidden, weight, bias):
    """Under ``torch.autocast`` the projection is a matmul, which autocast runs in its low dtype:
    fp32 ``hidden`` / ``weight`` / ``bias`` go to that dtype as ``F.linear`` would take them (so
    AMP's bf16 hidden states meet an fp32 head weight); float64 stays, as autocast leaves it. The
    op then runs with autocast off (``ops``), in the inputs' dtype throughout."""
    if not _autocasting(hidden):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(hidden.device.type)

    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float16,
                                                                              torch.bfloat16) else t

    return cast(hidden), cast(weight), cast(bias)


def check_logit_option(name: str, value) -> Optional[float]:
    """``softcap`` / ``logit_scale``: None or a positive finite real (not a bool); returned as a float."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive float or None, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite float or None, got {value!r}")
    return float(value)


def _check_vocab_parallel(process_group, vocab_start, impl: str, weight: torch.Tensor, eos_index) -> None:
    """The vocabulary-parallel arguments, before any collective runs."""
    if vocab_start is None:
        raise ValueError("process_group needs vocab_start: the global index of weight's first row")
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, numbers.Integral):
        raise TypeError(f"vocab_start must be an int, got {type(vocab_start).__name__}")
    if vocab_start < 0:
        raise ValueError(f"vocab_start must be >= 0, got {vocab_start}")
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise ValueError("process_group given, but torch.distributed is not initialized (init_process_group)")
    if impl == "reference":
        raise ValueError("impl='reference' materializes the whole vocabulary's logits: a vocabulary-parallel "
                         "loss (process_group) takes impl 'auto', 'chunked' or 'triton'")
    if isinstance(eos_index, bool) or not isinstance(eos_index, numbers.Integral):
        raise TypeError(f"eos_index must be an int, got {type(eos_index).__name__}")
    if weight.shape[0] - (vocab_start <= eos_index < vocab_start + weight.shape[0]) < 1:
        raise ValueError(f"weight holds rows {vocab_start}..{vocab_start + weight.shape[0] - 1} of the vocabulary, "
                         "no non-eos row: every shard needs at least one")


def _check_structure(hidden, weight, targets, bias, head, eps, eos_index, reduction, impl, ignore_index,
                     softcap=None, logit_scale=None, vocab_size=None) -> None:
    """``vocab_size``: the global V of a vocabulary-parallel weight (None: weight's own rows)."""
    check_not_dtensor([("hidden", hidden), ("weight", weight), ("targets", targets), ("bias", bias)])
    check_choice("head", head, HEADS)
    check_logit_option("softcap", softcap)
    check_logit_option("logit_scale", logit_scale)
    check_choice("reduction", reduction, REDUCTIONS)
    check_choice("impl", impl, IMPLS)
    check_eps(eps)
    check_float_tensor("hidden", hidden)
    check_float_tensor("weight", weight)
    check_int_tensor("targets", targets)
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be (B, T, H) or (N, H), got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (V, H) with H={hidden.shape[-1]}, got shape {tuple(weight.shape)}")
    V = weight.shape[0]
    if vocab_size is None and V < 2:
        raise ValueError(f"weight must have at least 2 rows (eos and one other token), got V={V}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets must have shape {tuple(hidden.shape[:-1])} to match hidden {tuple(hidden.shape)}, "
            f"got {tuple(targets.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
    if bias is not None:
        check_float_tensor("bias", bias)
        if bias.shape != (V,):
            raise ValueError(f"bias must be (V,)=({V},), got shape {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias dtype {bias.dtype} differs from hidden dtype {hidden.dtype}")
    check_same_device([("hidden", hidden), ("weight", weight), ("targets", targets), ("bias", bias)])
    if vocab_size is None:
        check_index("eos_index", eos_index, V, "V")
    elif vocab_size >= 0:  # the shards' V, when gathered (validate=True)
        check_index("eos_index", eos_index, vocab_size, "V")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if not -2**63 <= ignore_index < 2**63:  # the targets are int64
        raise ValueError(f"ignore_index must fit in int64, got {ignore_index}")
    if head == "st" and hidden.dim() != 3:
        raise ValueError("head='st' needs (B, T, H) hidden states: its running sum goes along T")


def _check_dw_dtype(dw_dtype, weight: torch.Tensor) -> None:
    if dw_dtype is None:
        return
    if not isinstance(dw_dtype, torch.dtype):
        raise TypeError(f"dw_dtype must be a torch.dtype or None, got {type(dw_dtype).__name__}")
    allowed = (dw_accumulator_dtype(weight.dtype), weight.dtype)
    if dw_dtype not in allowed:
        raise ValueError(f"dw_dtype must be the weight's dtype ({weight.dtype}) or {allowed[0]} (the default), "
                         f"got {dw_dtype}")


def linear_nmst_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    eos_index: int,
    eps: float = 1e-5,
    head: str = "nmst",
    steps: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    impl: str = "auto",
    chunk_size: Optional[int] = None,
    validate: bool = True,
    softcap: Optional[float] = None,
    logit_scale: Optional[float] = None,
    process_group: Optional["torch.distributed.ProcessGroup"] = None,
    vocab_start: Optional[int] = None,
    dw_dtype: Optional[torch.dtype] = None,
    temperature: float = 1.0,
    grad_filter: Union[None, float, str] = None,
) -> torch.Tensor:
    """NLL of ``targets`` under the NMST / ST / VA head on the logits

        y = softcap · tanh(logit_scale · z / softcap),   z = hidden @ weight.T + bias

    (y = logit_scale · z without ``softcap``; no ``logit_scale`` means 1; neither: y = z). Every head
    works on y as on plain logits: eos's logit is y_eos, L = logsumexp over the non-eos y, and so on.

    Never materializes the (N, V) logits (except ``impl="reference"``).

    Args:
        hidden: (B, T, H) or flat (N, H); fp32, bf16, fp16 or fp64.
        weight: (V, H), same dtype and device as ``hidden`` (under ``torch.autocast``, both
            are first cast to its dtype, as ``F.linear`` would; float64 is left alone).
        targets: (B, T) or (N,) integer; ``ignore_index`` entries add nothing.
        eos_index: vocabulary index of eos.
        eps: ε in (0, 1) of the NMST/ST heads.
        head: "nmst", "st" or "va" (plain softmax; equals ``F.cross_entropy``).
        steps: integer t per position, broadcastable to ``targets``. Default for
            (B, T): 1..T along T. Flat input needs it for "nmst"; "st" needs (B, T).
            t <= 0 marks context positions (p(eos) = 0); "nmst" rejects t < 0.
            "st"'s running sum restarts at every t = 1 (packed rows: one sequence per restart).
        bias: (V,) or None.
        reduction: "mean" (over non-ignored targets; 0 if there are none), "sum",
            or "none" (per-position NLL in ``targets``' shape, 0 where ignored).
        impl: "auto" (Triton on CUDA, chunked torch elsewhere and for fp64), "triton" (fp32
            math: not for fp64), "chunked" or "reference" (materializes logits; the spec).
        chunk_size: rows per chunk for the fused backends (default: a fixed
            byte budget for the (chunk, V) logits buffer).
        validate: run the data checks (target range, step signs, NaN/inf in hidden, weight and bias), one
            host sync; they are skipped automatically under ``torch.compile``. The fused backends take them after
            their pass, before returning: their row pass flags non-finite logits, so no separate scan of the
            weight runs (logits that overflow their dtype from finite inputs are refused too).
        process_group, vocab_start: vocabulary-parallel (Megatron's layout): ``weight`` (and
            ``bias``) hold the rows [vocab_start, vocab_start + weight.shape[0]) of the global
            vocabulary, one contiguous slice per rank of ``process_group`` (uneven slices are fine;
            each needs a non-eos row); ``targets`` and ``eos_index`` are global, and every rank passes
            the same ``hidden``, ``targets`` and ``steps``. Every rank gets the whole loss and dh (summed
            over the group), and dW / db for its own rows. Traffic per call: O(N) per-row scalars
            (a MAX and a SUM all-reduce per chunk for L, SUMs for s and z_target) and one SUM of dh
            (N, H); see :mod:`nmst_fast.vocab_shard`. With ``validate``, the shards' extents are
            gathered once and checked to tile [0, V), and a data check that fails on any rank fails
            on every rank (no rank is left waiting in a collective).
        softcap: c > 0 or None: cap the logits to (−c, c) by c · tanh(· / c), as Gemma 2/3's
            ``final_logit_softcapping``. The fused backends apply it inside the row pass (the
            torch one then halves its default chunk: it keeps a second (chunk, V) buffer).
        logit_scale: a > 0 or None: multiply the logits by a before the cap, as Cohere's
            ``logit_scale`` (Granite's ``logits_scaling`` s divides: pass 1/s). The fused backends
            fold it into ``hidden`` and ``bias`` (one (N, H) product, in ``hidden``'s dtype).
        dw_dtype: the dtype the fused backends sum dW over chunks in. None (default): at least
            float32, so a bf16 / fp16 weight's gradient is rounded once, at the end. The weight's own
            bf16 / fp16 (opt-in) halves that (V, H) accumulator and rounds once per chunk (error
            against float64: ``python -m benchmarks.dw_dtype``). ``impl="reference"`` ignores it
            (autograd's dW is in the weight's dtype).
        temperature: T > 0 (default 1), the sampling temperature of :func:`nmst_fast.decoding.sample`: the
            NLL of the distribution decoding draws from at T. For "nmst"/"st" it divides the non-eos y only,
            so p(eos) does not depend on it; for "va" it divides every y (plain softmax of y / T). The fused
            backends fold 1/T into the logit scale and the cap (c·tanh(y / c) / T is (c/T)·tanh(·/(c/T)) of
            y / T) and read eos's logit back at T times the folded one: no extra pass.
        grad_filter: the fused backends' gradient filter: None (default, off), a threshold g in (0, 1), or "auto"
            (Cut Cross-Entropy's g = finfo(dtype).eps / 32 for bf16 (2⁻¹²) and fp16 (2⁻¹⁵) inputs, off for fp32
            and fp64). dh's and dW's products skip every block of vocabulary entries (columns of a chunk of rows)
            whose gradient entries are all below g times their row's weight: for the mean or sum, tokens whose
            probability is below g on every row of the chunk. The loss and db are exact; eos's column, rows whose
            target is eos and the one-hot terms of the targets are never filtered. A trained model's softmax puts
            its mass on few tokens, so most blocks are skipped (docs/loss.md: what it saves and the error it
            adds). ``impl="reference"`` ignores it.
    Returns:
        Scalar loss (or per-position losses) in ``hidden``'s dtype; under ``torch.autocast`` in
        float32 (as AMP's losses; float64 unchanged), with the op itself in autocast's dtype.
    """
    return _linear_loss(hidden, weight, targets, bias, steps, validate, dict(
        head=head, eps=eps, eos_index=eos_index, ignore_index=ignore_index, reduction=reduction, impl=impl,
        chunk_size=chunk_size, softcap=softcap, logit_scale=logit_scale, temperature=temperature, dw_dtype=dw_dtype,
        process_group=process_group, vocab_start=vocab_start, grad_filter=grad_filter))[0]


STATISTICS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def linear_nmst_loss_with_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    eos_index: int,
    eps: float = 1e-5,
    head: str = "nmst",
    steps: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    impl: str = "auto",
    chunk_size: Optional[int] = None,
    validate: bool = True,
    softcap: Optional[float] = None,
    logit_scale: Optional[float] = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`linear_nmst_loss` with ``reduction="none"``, and the statistics of each position's step distribution
    (the one decoding draws from at ``temperature``) that TRL's trainers log, from the same pass over the logits:
    the fused backends read each chunk's logits once more for them, with no second product.

    Arguments as :func:`linear_nmst_loss`'s. Returns the per-position NLL (``targets``' shape; differentiable as
    the loss) and a dict of ``targets``-shaped tensors, without gradients: "entropy" (−Σ p log p),
    "log_sum_sq_probs" (log Σ p²), "mean_logits" (the mean effective logit ζ, whose softmax the distribution is:
    the logits / T but ζ_eos = L + log(1 − e^a) − a for NMST / ST, averaged over the other V − 1 where p(eos) = 0)
    in float64, and "is_top1" (bool: the target is the most probable token, ties to the lower index). Ignored
    positions get 0 / False. ``impl="reference"`` computes them on the materialized log-probabilities.
    """
    loss, stats = _linear_loss(hidden, weight, targets, bias, steps, validate, dict(
        head=head, eps=eps, eos_index=eos_index, ignore_index=ignore_index, reduction="none", impl=impl,
        chunk_size=chunk_size, softcap=softcap, logit_scale=logit_scale, temperature=temperature, dw_dtype=None,
        process_group=None, vocab_start=None, grad_filter=None), statistics=True)
    active = (targets != ignore_index).reshape(targets.shape)
    stats = torch.where(active.unsqueeze(-1), stats.view(*targets.shape, 4), 0.0)
    out = dict(zip(STATISTICS, stats.unbind(-1)))
    out["is_top1"] = out["is_top1"] > 0.5
    return loss, out


def _linear_loss(hidden, weight, targets, bias, steps, validate: bool, arguments: dict,
                 statistics: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A checked call: (the loss, with ``statistics`` the (N, 4) float64 row statistics, else None)."""
    autocasting = _autocasting(hidden)
    hidden, weight, bias = _autocast_inputs(hidden, weight, bias)
    options = _checked_options(hidden, weight, targets, bias, validate=validate, **arguments)
    # One integer dtype from here on: in uint8, `targets != -100` compares with -100 wrapped to 156.
    targets = targets.long()
    steps = expand_steps(steps, targets, options.head, hidden.dim() == 3)
    checking = validate and should_check_data()
    inputs = [("hidden", hidden), ("weight", weight), ("bias", bias)]
    backend = resolve_impl(arguments["impl"], hidden.device, hidden.dtype)
    if backend == "reference":
        if checking:
            check_data(head=options.head, vocab_size=options.vocab_size, targets=targets,
                       ignore_index=options.ignore_index, steps=steps, tensors=inputs, group=options.group)
        loss = _reference_loss(hidden, weight, bias, targets, steps, options, autocasting)
        stats = _reference_statistics(hidden, weight, bias, targets, steps, options) if statistics else None
        return loss, stats
    # The fused op's data checks cost no pass of their own: the O(N) verdicts are formed on the device now, the
    # op's row pass turns a row's L to NaN where any of its logits is not finite (the kernels clamp bad targets),
    # and all of them are taken in one sync after the op, before anything it computed is returned.
    if checking:
        names, flags = value_flags(head=options.head, vocab_size=options.vocab_size, targets=targets,
                                   ignore_index=options.ignore_index, steps=steps)
        # eos's own row, which the row pass skips and a softcap would make finite (c·tanh(inf / c) = c): H values.
        # Every rank of a vocabulary-parallel group forms the same verdicts (False where it holds no eos row).
        eos_row = options.eos_index - options.vocab_start
        owned = 0 <= eos_row < weight.shape[0]
        for name, t in (("weight", weight), ("bias", bias)):
            names.append(name)
            flags.append(~torch.isfinite(t[eos_row]).all() if owned and t is not None
                         else torch.zeros((), dtype=torch.bool, device=hidden.device))
    loss, lse, stats = _fused_loss(hidden, weight, bias, targets, steps, options, backend, autocasting, statistics)
    if checking:
        raise_value_errors([*names, "logits"], [*flags, ~torch.isfinite(lse).all()], vocab_size=options.vocab_size,
                           ignore_index=options.ignore_index, tensors=inputs, group=options.group)
    return loss, stats


@dataclass(frozen=True)
class _Options:
    """One call's checked scalar arguments, as plain Python values."""

    head: str
    eps: float
    eos_index: int
    ignore_index: int
    reduction: str
    chunk_size: Optional[int]
    softcap: Optional[float]
    logit_scale: Optional[float]
    temperature: float
    dw_dtype: Optional[torch.dtype]
    grad_filter: Optional[float]  # resolved: a threshold, or None (off)
    vocab_size: int  # the whole vocabulary's V (-1: a vocabulary shard's, not gathered)
    group: Optional["torch.distributed.ProcessGroup"]
    vocab_start: int


def _checked_options(hidden, weight, targets, bias, *, head, eps, eos_index, ignore_index, reduction, impl,
                     chunk_size, softcap, logit_scale, temperature, dw_dtype, process_group, vocab_start,
                     grad_filter, validate) -> _Options:
    """Every structural check of a call (types, shapes, dtypes, devices, ranges of the Python scalars; a
    vocabulary-parallel call's shards, gathered once with ``validate``), before any kernel runs."""
    vocab_size = None
    if process_group is not None:
        check_float_tensor("weight", weight)
        _check_vocab_parallel(process_group, vocab_start, impl, weight, eos_index)
        vocab_size = -1  # unknown until the shards are gathered (validate=True)
        if validate and should_check_data():
            vocab_size = check_vocab_shards(process_group, int(vocab_start), weight.shape[0], weight.device)
    _check_structure(hidden, weight, targets, bias, head, eps, eos_index, reduction, impl, ignore_index,
                     softcap, logit_scale, vocab_size)
    _check_dw_dtype(dw_dtype, weight)
    check_temperature(temperature)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    # numpy floats as plain ones: the op's schema takes Python floats
    return _Options(head=head, eps=float(eps), eos_index=int(eos_index), ignore_index=int(ignore_index),
                    reduction=reduction, chunk_size=chunk_size,
                    softcap=None if softcap is None else float(softcap),
                    logit_scale=None if logit_scale is None else float(logit_scale),
                    temperature=float(temperature), dw_dtype=dw_dtype,
                    grad_filter=resolve_grad_filter(grad_filter, hidden.dtype),
                    vocab_size=weight.shape[0] if vocab_size is None else vocab_size, group=process_group,
                    vocab_start=0 if process_group is None else int(vocab_start))


def _reference_loss(hidden, weight, bias, targets, steps, options: _Options, autocasting: bool) -> torch.Tensor:
    """``impl="reference"``: the spec on materialized logits. Under autocast: the projection in autocast's dtype
    (the inputs were cast), the log-probs and the loss in fp32 as AMP computes losses, with autocast off, as the
    fused op runs."""
    with torch.autocast(hidden.device.type, enabled=False) if autocasting else contextlib.nullcontext():
        return reference_linear_nmst_loss(
            hidden, weight, targets, eos_index=options.eos_index, eps=options.eps, head=options.head, steps=steps,
            bias=bias, ignore_index=options.ignore_index, reduction=options.reduction,
            logits_dtype=torch.promote_types(hidden.dtype, torch.float32) if autocasting else None,
            softcap=options.softcap, logit_scale=options.logit_scale, temperature=options.temperature,
        )


def _folded_logit_transforms(hidden, bias, options: _Options):
    """(hidden, bias, softcap, eos_scale) with the logit scale and the temperature folded in, so the op needs only
    the cap.

    A temperature T divides every logit y: 1/T joins the scale, and the cap c becomes c / T, since
    c·tanh(x / c) / T = (c/T)·tanh((x/T) / (c/T)); NMST/ST read eos's logit back at T times that (eos_scale).
    A scale a: c·tanh(a·z / c) = c·tanh(z' / c) with z' = (a·h) Wᵀ + a·b, and autograd carries the scale to dh
    and db (dW comes from the op with a·h already in it)."""
    logit_scale, softcap, eos_scale = options.logit_scale, options.softcap, 1.0
    if options.temperature != 1.0:
        logit_scale = (1.0 if logit_scale is None else logit_scale) / options.temperature
        softcap = None if softcap is None else softcap / options.temperature
        eos_scale = 1.0 if options.head == "va" else options.temperature
    if logit_scale is not None and logit_scale != 1.0:
        hidden = hidden * logit_scale
        bias = None if bias is None else bias * logit_scale
    return hidden, bias, softcap, eos_scale


def _product_dtype_inputs(hidden, weight, bias, options: _Options):
    """(hidden, weight, bias, options) as the op multiplies them: float16 on a CPU without fp16 arithmetic
    (:func:`~nmst_fast.backends.cpu_has_fp16_arithmetic`) goes to float32, whose GEMMs run about 100x faster there
    than the emulated fp16 ones, and are no less exact. Autograd rounds dh, dW and db back to float16 once, so
    ``dw_dtype`` (a float16 accumulator) has nothing left to choose and is dropped."""
    if not (hidden.dtype == torch.float16 and hidden.device.type == "cpu" and not cpu_has_fp16_arithmetic()):
        return hidden, weight, bias, options
    return (hidden.float(), weight.float(), None if bias is None else bias.float(),
            dataclasses.replace(options, dw_dtype=None))


def _reference_statistics(hidden, weight, bias, targets, steps, options: _Options) -> torch.Tensor:
    """(N, 4) float64 row statistics (as the fused op's) on the materialized float64 log-probabilities."""
    return materialized_statistics(hidden, weight, bias, targets, steps, head=options.head,
                                   eos_index=options.eos_index, eps=options.eps, temperature=options.temperature,
                                   softcap=options.softcap, logit_scale=options.logit_scale)


def _orders_vocabulary(flat_hidden, weight, options: _Options, backend: str, statistics: bool) -> bool:
    """Whether the call runs on the vocabulary sorted by mean logit (:mod:`nmst_fast.vocab_order`): where the gradient
    filter runs on CPU and a gradient is taken, on one process's whole vocabulary (the row statistics' top-1 ties go
    to the lower index, which the order would change: they keep the identity), outside a torch.compile trace (the
    choice syncs with the host)."""
    return (options.grad_filter is not None and backend == "chunked" and flat_hidden.device.type == "cpu"
            and options.group is None and not statistics and torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and (flat_hidden.requires_grad or weight.requires_grad))


def _fused_loss(hidden, weight, bias, targets, steps, options: _Options, backend: str, autocasting: bool,
                statistics: bool = False) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The fused op (``torch.ops.nmst_fast.linear_loss``) on the flattened rows: (the loss, L per row (NaN where a
    logit is not finite), the row statistics or None)."""
    out_dtype = hidden.dtype
    hidden, bias, softcap, eos_scale = _folded_logit_transforms(hidden, bias, options)
    hidden, weight, bias, options = _product_dtype_inputs(hidden, weight, bias, options)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    if _orders_vocabulary(flat_hidden, weight, options, backend, statistics):
        order = vocabulary_order(flat_hidden, weight, bias)
        if order is not None:
            weight, bias, targets, eos_index = ordered(order, weight, bias, targets, options.eos_index)
            options = dataclasses.replace(options, eos_index=eos_index)
    dw_dtype = options.dw_dtype or dw_accumulator_dtype(weight.dtype)
    summed_apart = hidden.device.type == "cpu" and weight.requires_grad and dw_dtype != weight.dtype
    chunk_rows = options.chunk_size or default_chunk_rows(
        flat_hidden.shape[0], weight.shape[0], hidden.dtype, hidden.device,
        buffers=chunk_buffers(backend, hidden.device, softcap),
        accumulator_bytes=weight.numel() * dw_dtype.itemsize if summed_apart else 0)
    grad_on = torch.is_grad_enabled()
    loss, lse, _dh, _dw, _db, row_stats = torch.ops.nmst_fast.linear_loss(
        flat_hidden,
        weight.contiguous(),
        bias,
        targets.reshape(-1),
        None if steps is None else steps.reshape(-1).contiguous(),
        targets.shape[-1] if hidden.dim() == 3 else 1,  # T: "st" sums along it
        options.head,
        options.eos_index,
        options.eps,
        options.ignore_index,
        options.reduction,
        backend,
        chunk_rows,
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
        softcap,
        None if options.group is None else group_name_of(options.group),
        options.vocab_start,
        None if options.dw_dtype == dw_accumulator_dtype(weight.dtype) else options.dw_dtype,
        eos_scale,
        statistics,
        options.grad_filter,
    )
    # The op's loss is at least fp32. Under autocast it stays so (AMP's losses are fp32: a GradScaler's
    # 65536 would be inf as an fp16 upstream gradient); otherwise it takes hidden's dtype, as F.cross_entropy.
    if not autocasting:
        loss = loss.to(out_dtype)
    return (loss.view(targets.shape) if options.reduction == "none" else loss), lse, (row_stats if statistics else None)
