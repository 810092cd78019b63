"""Token selection on the logits in Triton: two launches, one host sync, no (B, V) tensor.

The scan (``kernels/row_scan.py``) reads the logits once and leaves per row and
V-split: the running max/sum of the non-eos logits, the first argmax, one non-eos
column drawn from the split, or the K best non-eos candidates. The
select kernels (``kernels/row_select.py``) then do the O(1)-per-row rest in
float64: L, the head's log(1 − α_t), eos's effective logit
ζ_eos = L + log(1 − e^a) − a, and

* greedy: eos against the top non-eos logit (ties → lower index);
* sampling: one inverse-CDF draw over eos's mass and the splits' masses; the chosen
  split's own draw is the token (exact over all V tokens); from ROW_DRAW_MIN_ROWS rows,
  ``kernels/row_draw.py`` draws by inverse CDF instead, one program per row, one launch;
* top-k (then top-p): eos merged into the ranked candidates by its exact ζ_eos,
  the truncation, and an inverse-CDF draw;
* top-p alone: rejection rounds — draw a token, accept it when the mass ranked before it is
  below p, else redraw from the tokens ranked before it (about two reads of the row). From
  TOP_P_ROW_DRAW_MIN_ROWS rows ``kernels/row_draw.py`` runs them in one program per row (one launch;
  bounds from the lane maxima settle most rounds without a read: about one read on peaked rows);
  fewer rows spread each row over V-split programs (``kernels/split_top_p.py``: the drawing
  scan, then one launch per round); ``kernels/nucleus.py`` narrows the nucleus cut down by value
  for repeated rows and as the fallback.

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


# Plain sampling of at least this many rows: one program per row drawing by inverse CDF
# (``kernels/row_draw.py``: one launch) instead of the split-V scan's draw plus the select kernel,
# which needs the split over V to fill a GPU when there are few rows. 128: about one row per SM.
# H200 (RESULTS.md, fourteenth session): at B = 256 the row draw and the split scan take the same
# time (2.23x / 2.24x the floor at V = 50257); a row-draw program streams its row at a rate of its
# own, so a few rows would leave most SMs idle for as long as a full batch takes.
ROW_DRAW_MIN_ROWS = 128
# Top-p alone of at least this many rows: the row draw's rejection rounds (one launch; the lane
# bounds settle most rounds without a read) instead of the split rounds (the drawing scan, then one
# launch per round, each over every split of every row). Why 2: on the H200 the split rounds took
# 115-185 µs at B = 32 (3 to 5 launches of ~30 µs), while the row draw served 256 rows in 38-91 µs —
# and fewer rows cannot take the row draw longer (the same per-row work, one wave instead of two,
# less contention). One row keeps the split rounds (31 µs at B = 1), which spread it over the GPU.
TOP_P_ROW_DRAW_MIN_ROWS = 2


def samples_by_row_draw(rows: int, top_p: bool = False) -> bool:
    """Whether sampling ``rows`` rows — plain, or top-p alone (``top_p``) — takes the row-draw
    kernel (else the split-V paths: the scan's draw, or the split rounds)."""
    return rows >= (TOP_P_ROW_DRAW_MIN_ROWS if top_p else ROW_DRAW_MIN_ROWS)


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
    from kernels.row_scan import scan_partials  # lazy: Triton picks interpret mode at import

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
    from kernels.row_select import select_from_scan
    from kernels.scan_select import scan_select

    logits, kernel_steps, kernel_state = _prepare(logits, head, eos_index, eps, steps, state, temperature)
    seed = None if greedy else _seed(generator, logits.device)
    if not greedy and samples_by_row_draw(logits.shape[0]):
        from kernels.row_draw import draw_rows

        picked, _ = draw_rows(logits, head=head, eos_index=eos_index, eps=eps, temperature=temperature,
                              steps=kernel_steps, state=kernel_state, seed=seed)
        if _check_flags(picked.flags, logits.shape[0]):
            return FusedSelection(picked.tokens, picked.log_probs, picked.state)
        # fp32 rounding left some row without a token 32 times: draw the batch by the split scan.
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
    from kernels.row_scan import HAS_TOPK, MAX_CANDIDATES

    return HAS_TOPK and top_k <= MAX_CANDIDATES


def _split_rounds(logits: torch.Tensor, args: dict) -> Optional[FusedSelection]:
    """Top-p by rejection rounds on the split-V layout (``kernels/split_top_p.py``): a first batch of
    rounds, then more on the same chain while some row is still rejected (one host sync per batch;
    top-p 0.9 rarely needs a second). None: a row still rejected after its MAX_ROUNDS."""
    from kernels.split_top_p import MAX_ROUNDS, SplitTopP

    # A traced step cannot read the flags between batches of rounds: launch them all at once, so a
    # row is left unresolved only as rarely as in the row draw's one kernel (P ≤ (1 − p)^32).
    tracing = torch.compiler.is_compiling()
    draw = SplitTopP(logits, rounds=MAX_ROUNDS if tracing else None, **args)
    if not tracing and not _served(*draw.finish(), logits.shape[0]):
        return None
    picked = draw.selection
    return FusedSelection(picked.tokens, picked.log_probs, picked.state)


def _nucleus(logits: torch.Tensor, **args) -> Optional[FusedSelection]:
    """Top-p alone. Rows repeated with stride 0 (one prompt, several continuations): one cut serves
    them all. Otherwise rejection rounds (one to two reads per row): one program per row from
    TOP_P_ROW_DRAW_MIN_ROWS rows (``kernels/row_draw.py``), else the row spread over V-split programs
    (``kernels/split_top_p.py``); a batch with a row still rejected after the rounds' limit is
    drawn from the cut instead (a further host sync, only then). None: the cut did not converge
    either."""
    from kernels.nucleus import nucleus_select, shares_one_cut
    from kernels.row_draw import draw_rows

    B = logits.shape[0]
    if not shares_one_cut(logits, args["steps"], args["state"]):
        if samples_by_row_draw(B, top_p=True):
            picked, _ = draw_rows(logits, **args)
            if _check_flags(picked.flags, B):
                return FusedSelection(picked.tokens, picked.log_probs, picked.state)
        else:
            picked = _split_rounds(logits, args)
            if picked is not None:
                return picked
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

    Top-p alone: rejection rounds (``kernels/row_draw.py``), or the nucleus cut
    (``kernels/nucleus.py``) for repeated rows and rows rejection leaves unresolved; any nucleus
    size. With top-k: the scan keeps the K >= top_k most probable non-eos tokens;
    eos joins them by its exact ζ_eos, which makes them the K + 1 most probable tokens overall.
    Returns None when some row could not be served (a nucleus bracket that did not converge);
    the caller then takes the torch path.
    """
    from kernels.row_select import select_candidates_from_scan
    from kernels.scan_select import fits_one_launch, scan_select

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
    from kernels.row_scan import MAX_CANDIDATES, row_scan

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
