"""Token selection on the logits in Triton: one launch, one host sync, no (B, V) tensor.

The scan (``nmst_fast/kernels/row_scan.py``) reads the logits once, in V-splits, and leaves per row and
split: the running max/sum of the non-eos logits, the first argmax, one non-eos column drawn
from the split, or the K best non-eos candidates. The last split of each row to finish then
does the O(1)-per-row rest in the same launch (``nmst_fast/kernels/scan_select.py``, with the select
kernels' code from ``nmst_fast/kernels/row_select.py``), in float64: L, the head's log(1 − α_t), eos's
effective logit ζ_eos = L + log(1 − e^a) − a, and

* greedy: eos against the top non-eos logit (ties → lower index);
* sampling: one inverse-CDF draw over eos's mass and the splits' masses; the chosen
  split's own draw is the token (exact over all V tokens);
* top-k (then top-p): eos merged into the ranked candidates by its exact ζ_eos,
  the truncation, and an inverse-CDF draw;
* top-p alone: rejection rounds in one program per row (``nmst_fast/kernels/row_draw.py``) — draw a token,
  accept it when the mass ranked before it is below p, else redraw from the tokens ranked before
  it; bounds from the lane maxima settle most rounds without a read (about one read on peaked
  rows); ``nmst_fast/kernels/nucleus.py`` narrows the nucleus cut down by value for repeated rows and as
  the fallback.

Rows repeated with stride 0 (one prompt, several continuations) are scanned once where the scan
draws no noise (greedy, top-k), and finished by the two-launch select kernels.

So no (B, V) probability tensor, no sort, and no host sync until the end, where
one read of two flags reports undefined rows (NaN logits) and nuclei the kernel
could not resolve (the caller then takes the torch path).
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..backends import triton_available
from .distribution import Steps, check_rows, check_state, check_step_args, eos_terms, int64_steps, steps_tensor
from .truncation import TOP_P_SLACK, insert_eos, untruncated


@dataclass
class FusedSelection:
    tokens: torch.Tensor  # (B,) int64
    log_probs: torch.Tensor  # (B,) float64 log p of the chosen tokens (untruncated distribution)
    state: Optional[torch.Tensor]  # ST's running log(1−α) after this step


def fused_available(logits: torch.Tensor) -> bool:
    """The Triton path runs on CUDA tensors, or on CPU tensors in Triton's interpreter."""
    return triton_available() and (logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def _seed(generator: Optional[torch.Generator], device: torch.device) -> torch.Tensor:
    """A Philox seed as a one-element device tensor: drawn without a host sync."""
    dev = generator.device if generator is not None else device
    return torch.randint(0, 2**31 - 1, (1,), generator=generator, device=dev).to(device)


def _kernel_steps(steps: Steps, batch: int, device: torch.device) -> Union[int, torch.Tensor]:
    """An int stays a kernel scalar; a tensor is checked and broadcast to (B,) int64 (stride 0 kept)."""
    if isinstance(steps, numbers.Integral) and not isinstance(steps, bool):
        return int64_steps(steps)
    return steps_tensor(steps, batch, device)


def _prepare(logits: torch.Tensor, head: str, eos_index: int, eps: float, steps: Steps,
             state: Optional[torch.Tensor], temperature: float):
    """Checks shared by both paths; returns (logits with unit stride along V, kernel steps, state)."""
    check_step_args(logits, head, eos_index, eps, temperature)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    B = logits.shape[0]
    kernel_steps = _kernel_steps(steps, B, logits.device) if head != "va" else 1
    kernel_state = (check_state(state, B, logits.device, values=False)  # the kernels flag bad values
                    if head == "st" and state is not None else None)
    return logits, kernel_steps, kernel_state


def _check_flags(flags: torch.Tensor, batch: int) -> bool:
    """The step's one host sync: raise for an undefined row; False if a nucleus outgrew the candidates."""
    if torch.compiler.is_compiling():
        return True
    return _served(*flags.tolist(), batch)


def _served(first_bad: int, first_uncovered: int, batch: int) -> bool:
    """The flags as read: raise for an undefined row; False if some row has no valid token."""
    if first_bad < batch:
        raise ValueError(f"logits row {first_bad} has NaN/+inf values or no finite non-eos logit, or its ST "
                         "state is NaN or positive: no distribution to decode")
    return first_uncovered >= batch


def _shares_scan(logits: torch.Tensor, seed: Optional[torch.Tensor]) -> bool:
    """Whether one row's scan serves the batch: rows expanded from one (several continuations of one
    prompt), and a scan that draws no noise."""
    return seed is None and logits.shape[0] > 1 and logits.stride(0) == 0


def _scan(logits: torch.Tensor, head: str, eos_index: int, temperature: float,
          seed: Optional[torch.Tensor] = None, candidates: int = 0):
    """The one-read scan of (B, V) logits. Rows expanded from one are scanned once when the scan
    draws no noise (:func:`_shares_scan`); the head math stays per row."""
    from nmst_fast.kernels.row_scan import scan_partials  # lazy: Triton picks interpret mode at import

    shared = _shares_scan(logits, seed)
    return scan_partials(logits[:1] if shared else logits, eos_index=None if head == "va" else eos_index,
                         temperature=temperature, seed=seed, candidates=candidates)


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
    from nmst_fast.kernels.row_select import select_from_scan
    from nmst_fast.kernels.scan_select import scan_select

    logits, kernel_steps, kernel_state = _prepare(logits, head, eos_index, eps, steps, state, temperature)
    seed = None if greedy else _seed(generator, logits.device)
    args = dict(head=head, eos_index=eos_index, eps=eps, temperature=temperature, steps=kernel_steps,
                state=kernel_state, seed=seed)
    if _shares_scan(logits, seed):
        picked = select_from_scan(logits, _scan(logits, head, eos_index, temperature, seed=seed), **args)
    else:
        picked = scan_select(logits, **args)
    _check_flags(picked.flags, logits.shape[0])
    return FusedSelection(picked.tokens, picked.log_probs, picked.state)


def fused_truncation_available(top_k: Optional[int]) -> bool:
    """Whether a fused kernel serves this truncation: top-p alone always (the nucleus kernels),
    top-k when its candidate list can hold k (needs tl.topk)."""
    if not triton_available():
        return False
    if top_k is None:
        return True
    from nmst_fast.kernels.row_scan import HAS_TOPK, MAX_CANDIDATES

    return HAS_TOPK and top_k <= MAX_CANDIDATES


def _nucleus(logits: torch.Tensor, **args) -> Optional[FusedSelection]:
    """Top-p alone. Rows repeated with stride 0 (one prompt, several continuations): one cut serves
    them all. Otherwise rejection rounds in one program per row (``nmst_fast/kernels/row_draw.py``: one to two
    reads per row, about one on peaked rows); a batch with a row still rejected after the rounds'
    limit is drawn from the cut instead (a further host sync, only then). None: the cut did not
    converge either."""
    from nmst_fast.kernels.nucleus import nucleus_select, shares_one_cut
    from nmst_fast.kernels.row_draw import draw_rows

    B = logits.shape[0]
    if not shares_one_cut(logits, args["steps"], args["state"]):
        picked, _ = draw_rows(logits, **args)
        if _check_flags(picked.flags, B):
            return FusedSelection(picked.tokens, picked.log_probs, picked.state)
    picked = nucleus_select(logits, **args)
    if not _check_flags(picked.flags, B):
        return None
    return FusedSelection(picked.tokens, picked.log_probs, picked.state)


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
    """Top-k / top-p sampling without a (B, V) probability tensor or a sort of the vocabulary.

    Top-p alone: rejection rounds (``nmst_fast/kernels/row_draw.py``), or the nucleus cut
    (``nmst_fast/kernels/nucleus.py``) for repeated rows and rows rejection leaves unresolved; any nucleus
    size. With top-k: the scan keeps the K >= top_k most probable non-eos tokens;
    eos joins them by its exact ζ_eos, which makes them the K + 1 most probable tokens overall.
    Returns None when some row could not be served (a nucleus bracket that did not converge);
    the caller then takes the torch path.
    """
    from nmst_fast.kernels.row_select import select_candidates_from_scan
    from nmst_fast.kernels.scan_select import fits_one_launch, scan_select

    logits, kernel_steps, kernel_state = _prepare(logits, head, eos_index, eps, steps, state, temperature)
    threshold = top_p - TOP_P_SLACK if top_p is not None and top_p < 1.0 else None
    if top_k is None and threshold is None:  # nothing to truncate
        return fused_select(logits, head=head, eos_index=eos_index, eps=eps, steps=steps, state=state,
                            temperature=temperature, greedy=False, generator=generator)
    seed = _seed(generator, logits.device)
    if top_k is None:
        return _nucleus(logits, head=head, eos_index=eos_index, eps=eps, temperature=temperature,
                        steps=kernel_steps, state=kernel_state, top_p_threshold=threshold, seed=seed)
    args = dict(head=head, eos_index=eos_index, eps=eps, steps=kernel_steps, state=kernel_state, top_k=top_k,
                top_p_threshold=threshold, seed=seed)
    # The candidate scan draws no noise (the draw happens in the select), so repeated rows share one
    # scan (two launches); other batches take one launch when the finish can hold their candidates.
    if not _shares_scan(logits, None) and fits_one_launch(logits, top_k):
        picked = scan_select(logits, temperature=temperature, **args)
    else:
        picked = select_candidates_from_scan(logits, _scan(logits, head, eos_index, temperature, candidates=top_k),
                                             **args)
    if not _check_flags(picked.flags, logits.shape[0]):
        return None
    return FusedSelection(picked.tokens, picked.log_probs, picked.state)


def fused_ranked_candidates(
    logits: torch.Tensor,
    *,
    head: str,
    eos_index: int,
    eps: float = 1e-5,
    steps: Steps = 1,
    state: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The k most probable tokens per row in rank order (ties → lower index), from one read.

    What beam search needs: the scan's ranked non-eos candidates, eos merged in by its exact
    ζ_eos, then O(B·k) float64 torch math — no (B, V) tensor.

    Args:
        logits: (B, V); head, eos_index, eps, steps, state, temperature: as :func:`fused_select`.
        k: 1 <= k <= MAX_CANDIDATES.
    Returns:
        (tokens (B, k) int64, log_probs (B, k) float64, ST's new state (B,) or None); rows with
        fewer than k tokens are padded with token -1 and log-prob -inf.
    """
    from nmst_fast.kernels.row_scan import MAX_CANDIDATES, row_scan

    if not 1 <= k <= MAX_CANDIDATES:
        raise ValueError(f"k must lie in [1, {MAX_CANDIDATES}], got {k}")
    logits, kernel_steps, kernel_state = _prepare(logits, head, eos_index, eps, steps, state, temperature)
    scan = row_scan(logits, eos_index=None if head == "va" else eos_index, temperature=temperature,
                    candidates=k)
    lse, tokens, zeta = scan["lse"].to(torch.float64), scan["cand_idx"], scan["cand_val"].to(torch.float64)
    if head == "va":
        check_rows(lse)
        return tokens[:, :k], zeta[:, :k] - lse.unsqueeze(1), None
    log_norm, eos_zeta, eos_log_prob, next_state = eos_terms(
        lse, logits[:, eos_index].to(torch.float64), head=head, eps=eps, steps=kernel_steps, state=kernel_state)
    tokens, zeta = insert_eos(tokens, zeta, eos_index, eos_zeta)
    tokens = tokens[:, :k]
    log_p = torch.where(tokens == eos_index, eos_log_prob.unsqueeze(1), zeta[:, :k] - log_norm.unsqueeze(1))
    return tokens, log_p, next_state


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
    samples (:func:`fused_select`), anything else truncates (:func:`fused_truncated`; None: a row
    no kernel could serve)."""
    args = dict(head=head, eos_index=eos_index, eps=eps, steps=steps, state=state, temperature=temperature)
    if untruncated(top_k, top_p):
        return fused_select(logits, greedy=top_k == 1, generator=generator, **args)
    return fused_truncated(logits, top_k=top_k, top_p=top_p, generator=generator, **args)
