"""This rank's slice of a vocabulary split over a process group, and the collectives the fused loss
needs across it (Megatron's vocab-parallel layout: each rank holds the contiguous output rows
[start, start + size) of the weight); without a group, the whole vocabulary and no collectives.

Every head needs only per-row scalars from the V-wide logits, so the split costs O(N) traffic:
L (logsumexp over non-eos logits) from each rank's local one by a MAX and a SUM all-reduce, s from
eos's owner and z_target from the target's owner by SUM all-reduces; dh = Σ_ranks dz_r W_r by one
SUM all-reduce of (N, H). The head math then runs identically on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


def group_name_of(group: Any) -> str:
    """The name a process group is registered under (what the custom op carries: it takes no objects)."""
    return group.group_name


@dataclass(frozen=True)
class VocabShard:
    start: int  # first global vocabulary row held here
    size: int  # rows held here (V_local)
    group: Any = None  # torch.distributed ProcessGroup, or None: one process holds the whole vocabulary

    @classmethod
    def of(cls, group_name: Optional[str], start: int, size: int) -> "VocabShard":
        group = None
        if group_name is not None:
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = _resolve_process_group(group_name)
        return cls(start, size, group)

    def local(self, index: int) -> int:
        """Local row of global vocabulary ``index``, or -1 when another rank holds it."""
        return index - self.start if self.start <= index < self.start + self.size else -1

    def owned(self, tokens: torch.Tensor) -> torch.Tensor:
        """bool: which global ``tokens`` this rank holds."""
        return (tokens >= self.start) & (tokens < self.start + self.size)

    def local_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Local columns of global ``tokens``; 0 (any valid column) where another rank holds them."""
        if self.group is None:
            return tokens
        return torch.where(self.owned(tokens), tokens - self.start, 0)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """Σ over ranks, in place (each rank contributes its owned values, zeros elsewhere)."""
        if self.group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def global_lse(self, local_lse: torch.Tensor) -> torch.Tensor:
        """logsumexp over ranks of each row's local logsumexp (float64): one MAX, one SUM all-reduce."""
        if self.group is None:
            return local_lse
        top = local_lse.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.group)
        shift = torch.where(torch.isfinite(top), top, 0.0)
        total = torch.exp(local_lse - shift)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return shift + torch.log(total)


def check_vocab_shards(group: Any, vocab_start: int, local_rows: int, device: torch.device) -> int:
    """Every rank's rows, gathered once: they must tile [0, V) without gaps or overlaps. Returns V."""
    mine = torch.tensor([vocab_start, local_rows], dtype=torch.int64, device=device)
    extents = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(extents, mine, group=group)
    spans = sorted((int(e[0]), int(e[1])) for e in extents)
    end = 0
    for start, size in spans:
        if start != end:
            raise ValueError(f"the ranks' vocabulary shards (vocab_start, rows) {spans} must tile [0, V) "
                             f"contiguously: rows {end}..{start - 1} are {'missing' if start > end else 'doubled'}")
        end = start + size
    return end
