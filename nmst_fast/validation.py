"""Argument checks shared by the public entry points.

Every check raises ``ValueError``/``TypeError`` naming the offending argument. Structural checks (types, shapes,
devices, dtypes, ranges of Python scalars) are free and run before any kernel. Data checks (target range, step
signs, non-finite values) need one host sync; they are batched into a single ``.tolist()`` and skipped while
``torch.compile`` traces, where a sync would break the graph. The fused loss takes their verdicts after its pass,
before it returns anything (:func:`value_flags`, :func:`raise_value_errors`): its row pass flags a row with a
non-finite logit (hidden, weight or bias holding NaN or inf), so the (V, H) weight is never scanned apart.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

HEADS = ("nmst", "st", "va")
IMPLS = ("auto", "triton", "chunked", "reference")
REDUCTIONS = ("mean", "sum", "none")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_eps(eps: object) -> None:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a float in (0, 1), got {type(eps).__name__}")
    if not (0.0 < float(eps) < 1.0):
        raise ValueError(f"eps must lie in the open interval (0, 1), got {eps!r}")


def check_temperature(temperature: object) -> None:
    if (isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not temperature > 0
            or not math.isfinite(temperature)):
        raise ValueError(f"temperature must be a positive finite float, got {temperature!r}")


def check_int(name: str, value: object, minimum: int, *, optional: bool = False) -> None:
    """``value`` must be an int (not a bool) >= ``minimum``, or None when ``optional``."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{' or None' if optional else ''}, got {value!r}")


def check_index(name: str, value: object, size: int, size_name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not (0 <= int(value) < size):
        raise ValueError(f"{name} must lie in [0, {size_name}={size}), got {value}")


def check_float_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (fp16/bf16/fp32/fp64), got {t.dtype}")
    return t


def check_int_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    return t


def check_not_dtensor(pairs: list[tuple[str, Optional[torch.Tensor]]]) -> None:
    """Refuse DTensors (a tensor-parallel or FSDP2-sharded parameter read outside its module's
    call): inside the fused op one fails with an unreadable error (``.tolist()`` of a tensor
    subclass, or mixed torch.Tensor and DTensor)."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.tensor import DTensor

    for name, t in pairs:
        if isinstance(t, DTensor):
            raise TypeError(
                f"{name} is a DTensor (placements {tuple(t.placements)}): the fused loss takes plain tensors. "
                "An FSDP2-sharded output layer must run the loss inside its own forward, where its weight "
                "is gathered (nmst_fast.integrations.hf.apply_nmst does this); a replicated DTensor can be "
                "passed as .to_local() or .full_tensor()")


def check_same_device(pairs: list[tuple[str, Optional[torch.Tensor]]]) -> None:
    present = [(n, t) for n, t in pairs if t is not None]
    first_name, first = present[0]
    for name, t in present[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def expand_steps(steps: Optional[torch.Tensor], targets: torch.Tensor, head: str,
                 layout_3d: bool) -> Optional[torch.Tensor]:
    """Check ``steps`` and broadcast it to ``targets``' shape (int64), or build the default.

    Default for the (B, T) layout is 1..T along T. The flat layout has no notion
    of time, so "nmst" needs explicit steps there ("st" is rejected earlier).
    Returns None for "va", which does not use steps.
    """
    if head == "va":
        if steps is not None:
            check_int_tensor("steps", steps)
        return None
    if steps is None:
        if not layout_3d:
            raise ValueError(f"steps is required for head={head!r} with flat (N, H) hidden states")
        T = targets.shape[-1]
        return torch.arange(1, T + 1, device=targets.device).expand(targets.shape)
    check_int_tensor("steps", steps)
    if steps.device != targets.device:
        raise ValueError(f"steps is on {steps.device} but targets is on {targets.device}")
    try:
        return torch.broadcast_to(steps, targets.shape).long()
    except RuntimeError as err:
        raise ValueError(
            f"steps of shape {tuple(steps.shape)} does not broadcast to targets' shape {tuple(targets.shape)}"
        ) from err


def should_check_data() -> bool:
    """Data checks sync with the device; never inside a torch.compile trace."""
    return not torch.compiler.is_compiling()


def value_flags(*, head: str, vocab_size: int, targets: torch.Tensor, ignore_index: int,
                steps: Optional[torch.Tensor]) -> tuple[list[str], list[torch.Tensor]]:
    """The O(N) value checks' verdicts as device scalars (no sync): a target outside [0, V) that is not
    ``ignore_index`` ("targets"), a negative NMST step ("steps"). ``vocab_size`` -1: not known (not checked)."""
    names, flags = ["targets"], []
    active = targets != ignore_index
    out_of_range = targets < 0 if vocab_size < 0 else (targets < 0) | (targets >= vocab_size)
    flags.append((active & out_of_range).any())
    if head == "nmst" and steps is not None:
        names.append("steps")
        flags.append((steps < 0).any())
    return names, flags


def _non_finite(t: torch.Tensor) -> torch.Tensor:
    # min and max are finite exactly when every value is (NaN propagates through both): one read of the tensor in
    # its own dtype (a float32 sum would first copy a bf16 weight; an elementwise isfinite writes a bool copy of it)
    return ~torch.isfinite(torch.stack(torch.aminmax(t))).all()


def _or_over(verdicts: torch.Tensor, group) -> list[bool]:
    """The verdicts OR-ed over ``group``'s ranks (every rank then raises together), on the host: the one sync."""
    if group is not None:
        verdicts = verdicts.to(torch.int32)
        torch.distributed.all_reduce(verdicts, op=torch.distributed.ReduceOp.MAX, group=group)
    return verdicts.bool().tolist()


def raise_value_errors(names: list[str], flags: list[torch.Tensor], *, vocab_size: int, ignore_index: int,
                       tensors: list[tuple[str, Optional[torch.Tensor]]], group=None) -> None:
    """Take the verdicts (one host sync; OR-ed over a process ``group``) and raise the first bad one's error.

    A verdict named "logits" (a row pass met a non-finite logit) is traced to its cause only then: the first of
    ``tensors`` holding NaN or inf (scanned now, OR-ed over the group too), or the logits' overflow of their dtype.
    """
    for name, is_bad in zip(names, _or_over(torch.stack(flags), group)):
        if not is_bad:
            continue
        if name == "targets":
            raise ValueError(
                f"targets holds a value outside [0, V={vocab_size}) that is not ignore_index={ignore_index}"
            )
        if name == "steps":
            raise ValueError("steps must be >= 0 for head='nmst' (0 marks a context position)")
        if name == "logits":
            present = [(n, t) for n, t in tensors if t is not None and t.numel()]
            culprits = _or_over(torch.stack([_non_finite(t) for _, t in present]), group) if present else []
            for (culprit, _), bad in zip(present, culprits):
                if bad:
                    raise ValueError(f"{culprit} contains NaN or inf")
            dtype = present[0][1].dtype if present else "their dtype"
            raise ValueError(f"the logits hidden @ weight.T (+ bias) overflow {dtype}: NaN or inf from finite inputs")
        raise ValueError(f"{name} contains NaN or inf")


def check_data(
    *,
    head: str,
    vocab_size: int,
    targets: torch.Tensor,
    ignore_index: int,
    steps: Optional[torch.Tensor],
    tensors: list[tuple[str, Optional[torch.Tensor]]],
    group=None,
) -> None:
    """Value checks that need to look at data, before any kernel, done with a single host sync: the
    :func:`value_flags` and every value of ``tensors`` finite. With a process ``group`` the verdicts are OR-ed over
    its ranks first, so every rank raises together."""
    names, flags = value_flags(head=head, vocab_size=vocab_size, targets=targets, ignore_index=ignore_index,
                               steps=steps)
    for name, t in tensors:
        if t is not None and t.numel():
            names.append(name)
            flags.append(_non_finite(t))
    raise_value_errors(names, flags, vocab_size=vocab_size, ignore_index=ignore_index, tensors=tensors, group=group)


def resolve_grad_filter(grad_filter, dtype: torch.dtype) -> Optional[float]:
    """``linear_nmst_loss``'s ``grad_filter`` as a threshold, or None (off), for inputs of ``dtype``."""
    if grad_filter is None:
        return None
    if isinstance(grad_filter, str):
        if grad_filter != "auto":
            raise ValueError(f'grad_filter must be None, "auto" or a float in (0, 1), got {grad_filter!r}')
        return torch.finfo(dtype).eps / 32 if dtype in (torch.bfloat16, torch.float16) else None
    if isinstance(grad_filter, bool) or not isinstance(grad_filter, numbers.Real):
        raise TypeError(f'grad_filter must be None, "auto" or a float, got {type(grad_filter).__name__}')
    if not 0.0 < float(grad_filter) < 1.0:
        raise ValueError(f"grad_filter must be in (0, 1), got {grad_filter!r}")
    return float(grad_filter)
