"""A model with a head hands out the head's logits: ``log_softmax(model(ids).logits)`` is the head's step
log-distribution at every position.

The logits are the model's own with the eos entry replaced by the head's effective eos logit ζ at the step t the
position predicts (the effective-logit form of :func:`nmst_fast.decoding.effective_logits`, which generation writes
at each step): softmax over them gives p(eos) = 1 − (1 − α_t) and p(v) = (1 − α_t)·exp(z_v − L). VA's are the
model's logits as they are. Context positions (t ≤ 0) get ζ = −inf: p(eos) = 0 there, as the loss has it. So the
cross-entropy of a forward's logits against the next tokens is the loss ``model(ids, labels=ids)`` gives, under the
same t.

t of a position is the t of the token it predicts (the next one), by the rule the loss applies to labels when no
``nmst_steps`` is given (:func:`~.steps.scored_steps`): every real token (attention mask 1) counts as a label, so t
= 1 at each sequence's first predicted token (its second; a left-padded row's first real one), or from the
positions under a fixed ``context_length``; ST's running sum goes along the row. ``nmst_steps`` (B, T), aligned with
the input ids as with labels (a prompt's tokens t ≤ 0, a response's 1, 2, …: the RL case), gives another alignment;
the last position predicts the token after the input, at the last t + 1 (1 after a context).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ...decoding.eos_column import MAX_EOS_LOGIT_GAP, tempered_non_eos_lse
from ...head_math import head_terms, log_survival
from ...settings import HeadSettings
from ...validation import check_int_tensor
from .steps import scored_steps


def position_steps(settings: HeadSettings, input_shape: torch.Size, device: torch.device, *, shifted: bool,
                   attention_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                   nmst_steps: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, T) int64: the t at which each position's logits predict (see the module). ``shifted``: the class's label
    convention (``nmst_steps`` is aligned with the input ids, as labels, for a class that shifts them; with the
    positions, as its labels, for one that does not)."""
    B, T = input_shape
    if nmst_steps is not None:
        check_int_tensor("nmst_steps", nmst_steps)
        if tuple(nmst_steps.shape) != (B, T):
            raise ValueError(f"nmst_steps must be (B, T)={(B, T)} aligned with input_ids, "
                             f"got {tuple(nmst_steps.shape)}")
        steps = nmst_steps.to(device).long()
        if not shifted:
            return steps
        after = steps[:, -1:].clamp(min=0) + 1
        return torch.cat([steps[:, 1:], after], dim=1)
    # The loss's rule on labels = the real tokens, one column more: the token after the input, which the last
    # position predicts.
    mask = torch.ones(B, T + 1, dtype=torch.long, device=device)
    if attention_mask is not None:
        mask[:, :T] = attention_mask.to(device).long()
    labels = torch.where(mask > 0, 0, -100)
    positions = None
    if position_ids is not None:
        positions = position_ids.to(device).expand(B, T)
        positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
    return scored_steps(labels, settings, shifted=True, attention_mask=mask, position_ids=positions)[:, 1:]


def kept_positions(logits_to_keep: Union[int, torch.Tensor]) -> Union[slice, torch.Tensor]:
    """HF's ``logits_to_keep`` as an index of the sequence dimension: an int k the last k positions (0: all of them),
    a 1-D int tensor those positions."""
    if isinstance(logits_to_keep, torch.Tensor):
        return logits_to_keep
    return slice(-logits_to_keep, None) if logits_to_keep else slice(None)


def head_logits(logits: torch.Tensor, settings: HeadSettings, steps: torch.Tensor,
                logits_to_keep: Union[int, torch.Tensor] = 0) -> torch.Tensor:
    """``logits`` (B, T', V) the model's own, of the positions ``logits_to_keep`` (HF's argument:
    :func:`kept_positions`) of a sequence of T (``steps`` (B, T)), with their eos entry replaced by the head's
    effective eos logit at each position's t (in the logits' dtype).

    Logits that autograd tracks (a training forward without labels: DPO's or GRPO's log-probabilities) get a new
    tensor whose gradient flows through ζ to every logit (L's softmax weights and s); others are overwritten in
    place (one row pass, no copy) and returned. ST needs every position's eos logit: its logits come for every
    position or none."""
    if settings.head == "va":
        return logits
    B, kept, V = logits.shape
    T = steps.shape[1]
    positions = kept_positions(logits_to_keep)
    if isinstance(positions, torch.Tensor):
        positions = positions.to(steps.device)
    if settings.head == "st" and kept and not (kept == T and (
            isinstance(positions, slice) or torch.equal(positions, torch.arange(T, device=steps.device)))):
        raise ValueError(f"head 'st': its logits need every position's eos logit (its running sum goes along the "
                         f"row), but the forward kept {kept} of {T} positions (logits_to_keep): call it "
                         "without logits_to_keep")
    if kept == 0:
        return logits
    steps = steps[:, positions].reshape(-1)
    eos = settings.eos_index
    if torch.is_grad_enabled() and logits.requires_grad:
        rows = logits.reshape(B * kept, V)
        s = rows[:, eos].double()
        others = rows.float().index_fill(1, torch.tensor([eos], device=rows.device), -float("inf"))
        zeta = _eos_logit(settings, s, torch.logsumexp(others, dim=1).double(), steps, kept)
        out = logits.clone()
        out[..., eos] = zeta.view(B, kept).to(logits.dtype)
        return out
    rows = logits.view(B * kept, V) if logits.is_contiguous() else logits.reshape(B * kept, V)
    s = rows[:, eos].double()  # read before the row pass may overwrite the column
    rows[:, eos] = _eos_logit(settings, s, tempered_non_eos_lse(rows, eos), steps, kept).to(rows.dtype)
    if rows.data_ptr() != logits.data_ptr():
        logits.copy_(rows.view(B, kept, V))
    return logits


def _eos_logit(settings: HeadSettings, s: torch.Tensor, lse: torch.Tensor, steps: torch.Tensor,
               seq_len: int) -> torch.Tensor:
    """(N,) float64 effective eos logit ζ from s, L (float64) and t; a row without a distribution keeps s."""
    _, zeta, _ = head_terms(lse, log_survival(settings.head, s, steps, settings.eps, seq_len))
    live = (lse.abs() < float("inf")) & (s > -float("inf"))
    return torch.where(live, torch.minimum(zeta, lse + MAX_EOS_LOGIT_GAP), s)
