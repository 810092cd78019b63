"""Token selection from one read of the logits (Triton row scan).

The scan (``kernels/row_scan.py``) returns per row L, the top non-eos logit and
the winner of a Gumbel-max race over non-eos tokens. eos then joins with O(1)
float64 math per row: its effective logit ζ_eos = L + log(1 − e^a) − a competes with
the non-eos winner (greedy), or, with its own Gumbel draw, with the race winner
(sampling) — so both are exact for the NMST/ST/VA step distribution without a
(B, V) probability tensor or a sort. For greedy and sampling that math runs in a
second kernel (``kernels/row_select.py``). Top-k / top-p use the scan's ranked top-K
candidates the same way, with eos merged in by its exact ζ_eos in torch.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..backends import triton_available
from .distribution import Steps, check_rows, check_step_args, eos_terms, steps_tensor
from .truncation import draw, insert_eos, truncate, untruncated


@dataclass
class FusedSelection:
    tokens: torch.Tensor  # (B,) int64
    log_probs: torch.Tensor  # (B,) float64 log p of the chosen tokens
    state: Optional[torch.Tensor]  # ST's running log(1−α) after this step


def fused_available(logits: torch.Tensor) -> bool:
    """The Triton path runs on CUDA tensors, or on CPU tensors in Triton's interpreter."""
    return triton_available() and (logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


@dataclass
class _HeadScan:
    scan: dict  # row_scan's outputs
    log_norm: torch.Tensor  # (B,) float64 logsumexp of the effective logits
    eos_zeta: Optional[torch.Tensor]  # (B,) float64 ζ_eos (None for "va")
    log_surv: Optional[torch.Tensor]  # (B,) float64 log(1 − α_t) (None for "va")


def _scan_with_head(
    logits: torch.Tensor, head: str, eos_index: int, eps: float, steps: Steps, state: Optional[torch.Tensor],
    temperature: float, seed: Optional[int], candidates: int = 0,
) -> _HeadScan:
    """One read of the logits, then the head's O(B) float64 math (eos's effective logit)."""
    from kernels.row_scan import row_scan  # lazy: Triton picks interpret mode at import

    B = logits.shape[0]
    # Rows expanded from one (several samples of one prompt) have the same deterministic scan:
    # do it once. The head math below stays per row (steps / state may differ).
    replicated = seed is None and B > 1 and logits.stride(0) == 0
    scan = row_scan(logits[:1] if replicated else logits, eos_index=None if head == "va" else eos_index,
                    temperature=temperature, seed=seed, candidates=candidates)
    if replicated:
        scan = {key: value.expand(B, *value.shape[1:]) for key, value in scan.items()}
    lse = scan["lse"].to(torch.float64)
    if head == "va":
        check_rows(lse)
        return _HeadScan(scan, lse, None, None)
    s = logits[:, eos_index].to(torch.float64)
    return _HeadScan(scan, *eos_terms(lse, s, head=head, eps=eps, steps=steps, state=state))


def _seed(generator: Optional[torch.Generator], device: torch.device) -> torch.Tensor:
    """A Philox seed as a one-element device tensor: drawn without a host sync."""
    dev = generator.device if generator is not None else device
    return torch.randint(0, 2**31 - 1, (1,), generator=generator, device=dev).to(device)


def _kernel_steps(steps: Steps, batch: int, device: torch.device) -> Union[int, torch.Tensor]:
    """An int stays a kernel scalar; a tensor is checked and broadcast to (B,) int64 (stride 0 kept)."""
    if isinstance(steps, numbers.Integral) and not isinstance(steps, bool):
        return int(steps)
    return steps_tensor(steps, batch, device)


def _check_state(state: Optional[torch.Tensor], batch: int, device: torch.device) -> Optional[torch.Tensor]:
    if state is None:
        return None
    if not isinstance(state, torch.Tensor) or not state.dtype.is_floating_point:
        raise TypeError("state must be a floating tensor (ST's running log(1 − α) from the previous step)")
    if state.shape != (batch,):
        raise ValueError(f"state must have shape ({batch},), got {tuple(state.shape)}")
    return state.to(device)


def fused_select(
    logits: torch.Tensor,
    *,
    head: str,
    eos_index: int,
    eps: float = 1e-5,
    steps: Steps = 1,
    state: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    greedy: bool,
    generator: Optional[torch.Generator] = None,
) -> FusedSelection:
    """Greedy (``greedy=True``) or exact sampling of one token per row of (B, V) ``logits``.

    Two launches (the scan, then :mod:`kernels.row_select` with the head math and eos's
    draw) and one host sync at the end, for the undefined-row check.
    """
    from kernels.row_scan import scan_partials  # lazy: Triton picks interpret mode at import
    from kernels.row_select import select_from_scan

    check_step_args(logits, head, eos_index, eps, temperature)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    B = logits.shape[0]
    kernel_steps = _kernel_steps(steps, B, logits.device) if head != "va" else 1
    kernel_state = _check_state(state, B, logits.device) if head == "st" else None
    seed = None if greedy else _seed(generator, logits.device)
    # Rows expanded from one (several greedy continuations of one prompt) share one scan.
    replicated = greedy and B > 1 and logits.stride(0) == 0
    scan = scan_partials(logits[:1] if replicated else logits, eos_index=None if head == "va" else eos_index,
                         temperature=temperature, seed=seed)
    picked = select_from_scan(logits, scan, head=head, eos_index=eos_index, eps=eps, temperature=temperature,
                              steps=kernel_steps, state=kernel_state, seed=seed)
    if not torch.compiler.is_compiling():
        first_bad = int(picked.first_bad)
        if first_bad < B:
            raise ValueError(f"logits row {first_bad} has NaN/+inf values or no finite non-eos logit: "
                             "no distribution to decode")
    return FusedSelection(picked.tokens, picked.log_probs, picked.state)


def fused_truncation_available(top_k: Optional[int]) -> bool:
    """Whether the kernel's candidate list can serve top-k (top_k=None: top-p alone)."""
    if not triton_available():
        return False
    from kernels.row_scan import HAS_TOPK, MAX_CANDIDATES

    return HAS_TOPK and (top_k is None or top_k <= MAX_CANDIDATES)


def fused_truncated(
    logits: torch.Tensor,
    *,
    head: str,
    eos_index: int,
    eps: float = 1e-5,
    steps: Steps = 1,
    state: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> Optional[FusedSelection]:
    """Top-k / top-p sampling from the kernel's ranked candidates (one read of the logits).

    The kernel returns the K most probable non-eos tokens (K = top_k, or MAX_CANDIDATES
    for top-p alone); eos joins them by its exact ζ_eos, which makes them the K + 1 most
    probable tokens overall. Returns None when top-p's nucleus may need more than those
    (the caller then takes the torch path).
    """
    from kernels.row_scan import MAX_CANDIDATES

    check_step_args(logits, head, eos_index, eps, temperature)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    wanted = top_k if top_k is not None else MAX_CANDIDATES
    hs = _scan_with_head(logits, head, eos_index, eps, steps, state, temperature, None, candidates=wanted)
    tokens, zeta = hs.scan["cand_idx"], hs.scan["cand_val"].to(torch.float64)
    if head != "va":
        tokens, zeta = insert_eos(tokens, zeta, eos_index, hs.eos_zeta)
    if top_k is not None:
        tokens, zeta = tokens[:, :top_k], zeta[:, :top_k]
    log_p = zeta - hs.log_norm.unsqueeze(1)
    probs, covered = truncate(torch.exp(log_p), top_k, top_p)
    if not covered:
        return None
    rank = draw(probs, generator)
    return FusedSelection(tokens.gather(1, rank).squeeze(1), log_p.gather(1, rank).squeeze(1),
                          hs.log_surv if head == "st" else None)


def fused_sample(
    logits: torch.Tensor,
    *,
    head: str,
    eos_index: int,
    eps: float = 1e-5,
    steps: Steps = 1,
    state: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> Optional[FusedSelection]:
    """Dispatch as :func:`nmst_fast.decoding.selection.select`: top_k=1 is greedy, no truncation
    samples by the Gumbel race, anything else goes through the candidates (None: see
    :func:`fused_truncated`)."""
    args = dict(head=head, eos_index=eos_index, eps=eps, steps=steps, state=state, temperature=temperature)
    if untruncated(top_k, top_p):
        return fused_select(logits, greedy=top_k == 1, generator=generator, **args)
    return fused_truncated(logits, top_k=top_k, top_p=top_p, generator=generator, **args)
