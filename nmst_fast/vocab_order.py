"""The gradient filter's vocabulary order: the fused loss runs on the vocabulary sorted by its mean logit over the
call's rows, so that the tokens probable somewhere in a chunk share few blocks of :data:`~nmst_fast.grad_filter.
FILTER_BLOCK` entries and the filter skips the rest.

A real tokenizer's ids do not follow a corpus's frequencies: on GPT-2's 50257-token vocabulary and a model trained
on WikiText-2, the filter's chunks keep 96-100% of the vocabulary in GPT-2's id order and 27.5% sorted by mean logit
(``python -m benchmarks.grad_filter --workloads trained``). Cut Cross-Entropy sorts its backward the same way (by
the forward's average logit).

A tighter order skips more of each row's tail, whose sum the block means do not carry: on a GPT-2-vocabulary model
after one epoch on WikiText-2 (5.7 nats), sorted by each token's largest log-probability over 128 of 4096 rows the
chunks would keep 5% of the vocabulary, but most rows then hold over 1/8 of their gradient mass in skipped blocks
(the filter forms those rows' products exactly: the dense step), and with that guard off dh's bf16 error is 4.7x the
unfiltered one's; sorted by the sampled rows' summed probability, 15% kept and 1.14x the error; by mean logit, 22%
kept and the unfiltered error.

The mean logit over the rows is W · mean(h) (+ b): one (V, H) product with a vector, no pass over the logits. The
loss is invariant under the permutation (targets and eos are renumbered), and the gradients come back in the
caller's order; rows whose mean logits hardly spread (random rows: nothing to cluster, nothing skipped) keep the
identity and pay only that product.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch

from .grad_filter import FILTER_BLOCK

# The standard deviation (nats) of the mean logits under which the vocabulary keeps its order: random N(0, 1) rows
# against N(0, 1/H) weights spread them by about 1/sqrt(N) (0.02 at 4096 rows); benchmarks.grad_filter's synthetic
# rows, whose shared Zipf prior a trained model's rows carry too, by 1.1-1.2 nats.
ORDER_SPREAD = 0.5
# The likely tokens: the 1/LIKELY_SHARE of the vocabulary with the highest mean logits. The identity stays where they
# touch at most PACKED times the blocks they fill in the order: on benchmarks.grad_filter's frequency-numbered
# synthetic rows they touch 1.3-3x, with the same ids shuffled 15-16x.
LIKELY_SHARE = 16
PACKED = 4


@contextlib.contextmanager
def ids_kept() -> Iterator[None]:
    """Within the block, the vocabulary keeps its ids' order (what the benchmarks time beside the sort, and what a
    vocabulary-parallel call, whose shards keep it, is compared with on one process)."""
    global ORDER_SPREAD
    saved, ORDER_SPREAD = ORDER_SPREAD, math.inf
    try:
        yield
    finally:
        ORDER_SPREAD = saved


@torch.no_grad()
def vocabulary_order(hidden: torch.Tensor, weight: torch.Tensor,
                     bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """(V,) int64: the vocabulary by descending mean logit over ``hidden``'s rows (N, H), or None (the identity)
    where the mean logits spread less than :data:`ORDER_SPREAD` nats or the identity already packs the likely tokens
    (:data:`PACKED`). ``weight`` (V, H) and ``bias`` (V,) as the loss takes them."""
    V = weight.shape[0]
    mean_logit = torch.mv(weight, hidden.mean(0).to(weight.dtype)).float()
    if bias is not None:
        mean_logit = mean_logit + bias.float()
    if not float(mean_logit.std()) >= ORDER_SPREAD:  # a host sync; NaN keeps the identity too
        return None
    order = mean_logit.argsort(descending=True)
    # The likely tokens, by mean logit: where the identity already packs them into about as few blocks as the order
    # would (a vocabulary numbered by frequency), the order gains little and the identity stays.
    likely = order[: max(FILTER_BLOCK, V // LIKELY_SHARE)]
    blocks = torch.zeros(-(-V // FILTER_BLOCK), dtype=torch.bool, device=weight.device)
    blocks[likely // FILTER_BLOCK] = True
    if int(blocks.sum()) <= PACKED * -(-len(likely) // FILTER_BLOCK):  # a second sync, where the rows spread
        return None
    return order


class _Rows(torch.autograd.Function):
    """``x[order]`` along the first dimension, whose gradient comes back as ``grad[inverse]`` (a gather, not a
    scatter into zeros)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def ordered(order: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
            eos_index: int) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, int]:
    """(weight, bias, targets, eos_index) in ``order``'s numbering: rows of ``weight`` / ``bias`` permuted (autograd
    returns their gradients in the original order), targets in [0, V) renumbered (others, ignored or out of range,
    left for the loss's checks), eos renumbered."""
    V = weight.shape[0]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(V, device=order.device)
    in_range = (targets >= 0) & (targets < V)
    targets = torch.where(in_range, inverse[targets.clamp(0, V - 1)], targets)
    weight = _Rows.apply(weight, order, inverse)
    bias = None if bias is None else _Rows.apply(bias, order, inverse)
    return weight, bias, targets, int(inverse[eos_index])
