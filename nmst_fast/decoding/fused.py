"""Greedy and untruncated sampling from one read of the logits (Triton row scan).

The kernel (``kernels/row_scan.py``) returns per row L, the top non-eos logit and
the winner of a Gumbel-max race over non-eos tokens. eos then joins with O(B)
float64 math: its effective logit ζ_eos = L + log(1 − e^a) − a competes with the
non-eos winner (greedy), or, with its own Gumbel draw, with the race winner
(sampling) — so both are exact for the NMST/ST/VA step distribution without a
(B, V) probability tensor or a sort. Top-k / top-p go through the torch path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..backends import triton_available
from .distribution import Steps, check_rows, check_step_args, eos_effective_logit, step_log_survival


@dataclass
class FusedSelection:
    tokens: torch.Tensor  # (B,) int64
    log_probs: torch.Tensor  # (B,) float64 log p of the chosen tokens
    state: Optional[torch.Tensor]  # ST's running log(1−α) after this step


def fused_available(logits: torch.Tensor) -> bool:
    """The Triton path runs on CUDA tensors, or on CPU tensors in Triton's interpreter."""
    return triton_available() and (logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def _gumbel(shape: int, generator: Optional[torch.Generator], device: torch.device) -> torch.Tensor:
    dev = generator.device if generator is not None else device
    u = torch.rand(shape, dtype=torch.float64, generator=generator, device=dev).clamp_min(1e-300)
    return (-torch.log(-torch.log(u))).to(device)


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
    """Greedy (``greedy=True``) or exact sampling of one token per row of (B, V) ``logits``."""
    from kernels.row_scan import row_scan  # lazy: Triton picks interpret mode at import

    check_step_args(logits, head, eos_index, eps, temperature)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    seed = None
    if not greedy:
        dev = generator.device if generator is not None else logits.device
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=dev))
    scan = row_scan(logits, eos_index=None if head == "va" else eos_index, temperature=temperature, seed=seed)
    lse = scan["lse"].to(torch.float64)
    pick_idx, pick_val = (scan["top_idx"], scan["top_val"]) if greedy else (scan["race_idx"], scan["race_val"])
    if head == "va":
        check_rows(lse)
        log_p = logits.gather(1, pick_idx[:, None]).squeeze(1).to(torch.float64) / temperature - lse
        return FusedSelection(pick_idx, log_p, None)

    s = logits[:, eos_index].to(torch.float64)
    check_rows(lse, s)
    log_surv = step_log_survival(s, head=head, eps=eps, steps=steps, state=state)
    eos_zeta = eos_effective_logit(lse, log_surv)
    pick = pick_val.to(torch.float64)
    if greedy:  # ties go to the lower index, as everywhere
        eos_wins = (eos_zeta > pick) | ((eos_zeta == pick) & (eos_index < pick_idx))
    else:
        eos_wins = eos_zeta + _gumbel(lse.shape[0], generator, logits.device) > pick
    tokens = torch.where(eos_wins, eos_index, pick_idx)
    chosen = logits.gather(1, pick_idx[:, None]).squeeze(1).to(torch.float64) / temperature
    log_norm = lse - log_surv
    log_p = torch.where(eos_wins, eos_zeta, chosen) - log_norm
    return FusedSelection(tokens, log_p, log_surv if head == "st" else None)
