"""The step t of every token of a batch, from its labels, its positions or its attention mask.

t = 1 at a sequence's first generated (supervised) token and counts on from there; t <= 0 is context, where
p(eos) = 0. Every function returns (B, T) int64 aligned with its input.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...settings import HeadSettings
from ...validation import check_int_tensor


def steps_from_positions(positions: torch.Tensor, context_length: int = 0) -> torch.Tensor:
    """t of every token from its position in its own sequence (0-based; negative: padding):
    t = position − context_length + 1, 0 on the first ``context_length`` tokens (context) and on padding.
    ``position_ids`` of packed sequences restart at 0 per document, so t restarts too. (B, T) int64."""
    check_int_tensor("positions", positions)
    return (positions.long() - context_length + 1).clamp(min=0)


def steps_from_attention_mask(attention_mask: torch.Tensor, context_length: int = 0) -> torch.Tensor:
    """t of every token of a (left- or right-) padded batch: positions count each row's real tokens
    (mask 1) from its first one, as HF derives ``position_ids``; padding gets t = 0. (B, T) int64."""
    check_int_tensor("attention_mask", attention_mask)
    mask = attention_mask.long()
    positions = torch.where(mask > 0, mask.cumsum(-1) - 1, -1)
    return steps_from_positions(positions, context_length)


def _segment_starts(shape: torch.Size, position_ids: Optional[torch.Tensor], device) -> torch.Tensor:
    """bool (B, T): where a sequence starts — the row's first token and, for packed rows, every
    position_id 0."""
    starts = torch.zeros(shape, dtype=torch.bool, device=device)
    if position_ids is not None:
        starts |= position_ids.to(device).expand(shape) == 0
    starts[..., 0] = True
    return starts


def steps_from_labels(labels: torch.Tensor, *, position_ids: Optional[torch.Tensor] = None,
                      ignore_index: int = -100) -> torch.Tensor:
    """t of every token from the supervision itself: t = 1 at each sequence's first supervised token
    (label ≠ ``ignore_index``, never a sequence's first token, which nothing predicts), counting on
    along the sequence; 0 before it. A chat prompt masked with -100, left padding labelled -100 and
    the documents of a packed row (``position_ids`` restarting at 0) each get their own t = 1.
    (B, T) int64, aligned with ``labels``."""
    check_int_tensor("labels", labels)
    starts = _segment_starts(labels.shape, position_ids, labels.device)
    supervised = (labels != ignore_index) & ~starts
    index = torch.arange(labels.shape[-1], device=labels.device).expand(labels.shape)
    start = torch.where(starts, index, 0).cummax(-1).values  # each position's sequence start
    counted = supervised.long().cumsum(-1)
    in_sequence = counted - (counted - supervised.long()).gather(-1, start)  # supervised so far in the sequence
    first = torch.where(supervised & (in_sequence == 1), index, -1).cummax(-1).values
    return torch.where(first >= start, index - first + 1, 0)


def default_steps(labels: torch.Tensor, settings: HeadSettings, *, attention_mask: Optional[torch.Tensor] = None,
                  position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rule the patched forward uses when no ``nmst_steps`` is given, for ``labels`` aligned with the input
    ids (column i is token i): with a fixed ``context_length`` (the paper's setup), t from each token's position
    in its own sequence (``position_ids``, else the attention mask, else the column); without one, from the
    labels (:func:`steps_from_labels`)."""
    context = settings.context_length
    if context is None:
        return steps_from_labels(labels, position_ids=position_ids)
    if position_ids is not None:
        return steps_from_positions(position_ids.expand(labels.shape), context)
    if attention_mask is not None:
        return steps_from_attention_mask(attention_mask, context)
    return steps_from_positions(torch.arange(labels.shape[-1], device=labels.device).expand(labels.shape), context)


def scored_steps(labels: torch.Tensor, settings: HeadSettings, *, shifted: bool,
                 attention_mask: Optional[torch.Tensor] = None,
                 position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`default_steps` for labels in either layout: ``shifted`` — ``labels`` aligned with the input ids
    (position i scores ``labels[:, i + 1]``; the result is aligned with them too); not ``shifted`` — position i
    scores ``labels[:, i]`` (BART-style decoders, TRL's ``shift_labels``): the labels are read in the shifted
    layout, one column on, with the mask and positions carried along. (B, T) int64 aligned with ``labels``."""
    if shifted:
        return default_steps(labels, settings, attention_mask=attention_mask, position_ids=position_ids)
    ignored = labels.new_full((labels.shape[0], 1), -100)
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, attention_mask[:, -1:]], dim=1)
    if position_ids is not None:
        position_ids = position_ids.expand(labels.shape)
        position_ids = torch.cat([position_ids, position_ids[:, -1:] + 1], dim=1)
    aligned = torch.cat([ignored, labels], dim=1)
    return default_steps(aligned, settings, attention_mask=attention_mask, position_ids=position_ids)[:, 1:]
