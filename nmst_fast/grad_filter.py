"""The fused loss's gradient filter: dh's and dW's products skip the blocks of vocabulary entries whose gradient
entries, on every row of a chunk, fall below a threshold, and add back what those blocks carry on average.

A trained model's softmax puts nearly all of a row's mass on a few hundred tokens, and the tokens that are probable
anywhere in a chunk of rows cluster in the frequent part of the vocabulary. Cut Cross-Entropy skips such blocks
outright (its ε = finfo(dtype).eps / 32, below bf16's resolution of a single product). Dropping them drops each
row's tail mass too, and where the skipped rows of W share a component (a model's rare tokens do: their rows are
pushed together along the unigram prior's direction), the dropped sum does not cancel: on peaked Zipf rows whose
prior is such a component, dropping gave dh 30x the error of the unfiltered bf16 products. So for each skipped
block b and row r this filter keeps the block's sum S_rb = Σ_{v∈b} dz_rv (the row pass reports it, at no extra read
of the chunk) and adds

    dh_r += Σ_b S_rb · mean_{v∈b} W_v          dW_v += (1 / |b|) Σ_r S_rb · h_r  (v ∈ b)

which makes each skipped block's share of dh and its total share of dW exact for its mean weight row, and leaves
only the entries' deviations from the block means (small, and of random sign). Both are products of the number of
blocks, not of V: (rows × blocks) · (blocks × H) per chunk, and one pass over the corrected rows of dW at the end.

Never filtered: the targets' one-hot terms and eos's column (the row pass hands them to the driver apart) and db.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.distributed

from .kernels.cpu import row_kernels
from .row_ops import FilterOut, SparseGrad

# Vocabulary entries per block of the gradient filter: a skipped block spares a (rows × block) · (block × H) product
# of dh and of dW; adjacent kept blocks are multiplied together.
FILTER_BLOCK = 256

# The largest share of a row's gradient mass (Σ |dz| over its non-eos entries) its skipped blocks may hold before
# the row's skipped products are formed exactly (see GradFilter.plan): rows of 2.4 nats hold 4% there on average,
# 14% at most (benchmarks.grad_filter's synthetic rows), flat rows most of it.
TAIL_SHARE = 1 / 8


# The list :func:`recorded_kept_shares` is recording into, or None.
_kept_shares: Optional[list[float]] = None


@contextlib.contextmanager
def recorded_kept_shares() -> Iterator[list[float]]:
    """Within the block, each filtered chunk's share of the vocabulary whose dh and dW products are kept, in the order
    the chunks run (what the benchmarks report and the tests check of the filter's effect)."""
    global _kept_shares
    outer, _kept_shares = _kept_shares, []
    try:
        yield _kept_shares
    finally:
        _kept_shares = outer


def _block_runs(blocks: list[int]) -> list[tuple[int, int]]:
    """The [b0, b1) runs of adjacent block numbers in the ascending list ``blocks``."""
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs


def kept_runs(keep: list[bool], V: int) -> list[tuple[int, int]]:
    """The [v0, v1) runs of adjacent blocks of a V-column vocabulary whose ``keep`` flag (one per block) is set."""
    return [(b0 * FILTER_BLOCK, min(V, b1 * FILTER_BLOCK))
            for b0, b1 in _block_runs([b for b, kept in enumerate(keep) if kept])]


def _heavy_lanes(dz: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(V, len(rows)): the chunk's dz (R, V) at ``rows``, vocabulary-major (each vocabulary entry's values for those
    rows side by side), the layout of dW's product dzᵀ · h. From a vocabulary-major chunk (the CPU row pass's: dz a
    transposed view of a (V, R) buffer) a contiguous copy in one sweep of the buffer: at 2048 x 256000 bf16, 246 rows
    took 0.2 s by advanced indexing along its rows' axis, 1.7 s by index_select of rows of the transposed view."""
    if dz.stride(1) != 1:
        return dz.t()[:, rows]
    return dz.index_select(0, rows).t()  # a row-major chunk's (Triton's): its rows, transposed


def _block_row_sums(weight: torch.Tensor, blocks: int) -> torch.Tensor:
    """(blocks, H) float32: the sums of each FILTER_BLOCK rows of ``weight`` (V, H), the last block's the rest: on CPU
    by the kernels' ``block_row_sums`` in one read of W (torch's sum over the middle dimension of a bf16 (blocks,
    block, H) view first copies W to float32: 87 ms at 50257 x 768, about a sixth of a filtered step on AMX)."""
    kernels = row_kernels() if weight.device.type == "cpu" else None
    if kernels is not None and weight.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return kernels.block_row_sums(weight.contiguous(), FILTER_BLOCK)
    V, H = weight.shape
    full = V // FILTER_BLOCK
    sums = torch.empty(blocks, H, dtype=torch.float32, device=weight.device)
    if full:
        sums[:full] = weight[: full * FILTER_BLOCK].view(full, FILTER_BLOCK, H).sum(1, dtype=torch.float32)
    if V % FILTER_BLOCK:
        sums[full] = weight[full * FILTER_BLOCK:].sum(0, dtype=torch.float32)
    return sums


class GradFilter:
    """One fused call's filter state over its chunks: the row pass's report buffers, which of dW's blocks hold a
    product yet, and the skipped blocks' sums for dW (see the module's docstring).

    Args:
        threshold: g in (0, 1): a block is skipped where every entry's |dz| is below g times the chunk's largest row
            coefficient (for unit row weights: every row's probability of each of its tokens is below g).
        weight: (V, H), the chunk loop's; ``eos_column``: eos's row in it, or -1 (no eos in this vocabulary shard):
            it is left out of its block's mean and of the spread.
        chunk_rows: the most rows of a chunk.
        group: the process group a vocabulary-parallel weight is split over, or None: each row's gradient mass and
            its skipped share (what makes a row heavy, see :meth:`plan`) are summed over it, so that every shard
            decides as one process on the whole vocabulary would.
    """

    def __init__(self, threshold: float, weight: torch.Tensor, chunk_rows: int, eos_column: int,
                 group: Any = None) -> None:
        V, H = weight.shape
        self.threshold = threshold
        self.weight = weight
        self.eos_column = eos_column
        self.blocks = -(-V // FILTER_BLOCK)
        device = weight.device
        self._entry_max = torch.empty(V, dtype=torch.float32, device=device)
        self._sums = torch.empty(self.blocks * chunk_rows, dtype=torch.float32, device=device)
        self.written = [False] * self.blocks  # dW's blocks some chunk has stored its product in
        self._spread = torch.zeros(self.blocks, H, dtype=torch.float32, device=device)  # Σ_r S_rb · h_r
        self._spread_any = [False] * self.blocks
        self._means: Optional[torch.Tensor] = None
        counts = torch.full((self.blocks,), FILTER_BLOCK, dtype=torch.float32, device=device)
        counts[-1] = V - (self.blocks - 1) * FILTER_BLOCK
        if eos_column >= 0:
            counts[eos_column // FILTER_BLOCK] -= 1
        self._counts = counts.clamp(min=1)
        self._heavy: list[tuple[torch.Tensor, torch.Tensor]] = []  # heavy rows' skipped dz and hidden states
        self._sparse: list[tuple[torch.Tensor, SparseGrad]] = []  # the chunks' left-out entries, for finish_dw_
        self._chunk_rows = chunk_rows
        self._group = group

    def report(self, rows: int) -> FilterOut:
        """The buffers a chunk of ``rows`` rows' pass fills."""
        return FilterOut(self._entry_max, self._sums[: self.blocks * rows].view(self.blocks, rows), FILTER_BLOCK)

    def plan(self, out: FilterOut) -> tuple[list[tuple[int, int]], list[int], Optional[torch.Tensor]]:
        """(the kept runs, the skipped blocks, the heavy rows or None) of the chunk whose pass filled ``out`` (one
        host sync).

        A row whose skipped blocks hold more than :data:`TAIL_SHARE` of its gradient's mass (a flat row: the
        softmax's own tilt towards its hidden state lives in that tail, and no block mean carries it) is heavy: its
        skipped products are formed exactly (:meth:`heavy_`) and its sums leave the means' correction. Where most
        rows are heavy the chunk skips nothing."""
        V = out.entry_max.shape[0]
        padded = torch.nn.functional.pad(out.entry_max, (0, self.blocks * FILTER_BLOCK - V))
        below = padded.view(self.blocks, FILTER_BLOCK).amax(1) < self.threshold  # a NaN peak keeps its block
        sums = out.block_sums.abs()
        masses = torch.stack([(sums * below.unsqueeze(1)).sum(0), sums.sum(0)])  # each row's skipped and whole mass
        if self._group is not None:
            torch.distributed.all_reduce(masses, group=self._group)
        heavy_mask = masses[0] > TAIL_SHARE * masses[1]
        flags = torch.cat([below, heavy_mask]).tolist()  # the plan's one host sync
        skip, heavy_rows = flags[: self.blocks], [r for r, f in enumerate(flags[self.blocks:]) if f]
        if 2 * len(heavy_rows) > len(flags) - self.blocks:  # mostly flat rows: the dense products
            skip = [False] * self.blocks
        runs = kept_runs([not s for s in skip], V)
        if _kept_shares is not None:
            _kept_shares.append(sum(v1 - v0 for v0, v1 in runs) / max(V, 1))
        skipped = [b for b, s in enumerate(skip) if s]
        heavy = None
        if skipped and heavy_rows:
            heavy = torch.tensor(heavy_rows, device=sums.device)
            out.block_sums[:, heavy] = 0  # their skipped entries are multiplied exactly
        return runs, skipped, heavy

    def heavy_(self, dh: Optional[torch.Tensor], dz: torch.Tensor, h: torch.Tensor, heavy: torch.Tensor,
               runs: list[tuple[int, int]], dw: Optional[torch.Tensor], accumulate) -> None:
        """The heavy rows' skipped entries, multiplied exactly: dh[heavy] += them · W now (one product over V), and
        for dW they are kept (the chunk's kept columns zeroed) and multiplied with their hidden states in one
        product over V when enough rows are held (:meth:`flush_heavy_`), so dW's accumulator is not swept per
        chunk. ``accumulate(acc, dz, h, first)`` sums a product into dW."""
        lanes = _heavy_lanes(dz, heavy)  # (V, heavy)
        for v0, v1 in runs:
            lanes[v0:v1] = 0
        if dh is not None:
            dh.index_add_(0, heavy, torch.mm(lanes.t(), self.weight).to(dh.dtype))
        if dw is not None:
            self._heavy.append((lanes, h[heavy]))
            if sum(x.shape[0] for _, x in self._heavy) >= self._chunk_rows:
                self.flush_heavy_(dw, accumulate)

    def flush_heavy_(self, dw: torch.Tensor, accumulate) -> None:
        """dW += the held heavy rows' skipped entries times their hidden states (dW's unwritten blocks zeroed
        first)."""
        if not self._heavy:
            return
        self.store_zeros_(dw, range(self.blocks))
        held, self._heavy = self._heavy, []
        if held[0][0].is_contiguous():  # a vocabulary-major chunk's lanes: (V, held rows), dzᵀ of the product
            rows = torch.cat([lanes for lanes, _ in held], dim=1).t()
        else:  # a row-major chunk's rows (Triton's), (held rows, V)
            rows = torch.cat([lanes.t() for lanes, _ in held])
        accumulate(dw, rows, torch.cat([x for _, x in held]), False)

    def block_means(self) -> torch.Tensor:
        """(blocks, H) float32: each block's mean row of W (eos's row left out), computed once."""
        if self._means is None:
            sums = _block_row_sums(self.weight, self.blocks)
            if self.eos_column >= 0:
                sums[self.eos_column // FILTER_BLOCK] -= self.weight[self.eos_column].float()
            self._means = sums / self._counts.unsqueeze(1)
        return self._means

    def correct_dh_(self, dh: torch.Tensor, out: FilterOut, skipped: list[int]) -> None:
        """dh (rows, H) += the skipped blocks' sums times their mean rows of W."""
        index = torch.tensor(skipped, device=dh.device)
        dh.add_((out.block_sums[index].t() @ self.block_means()[index]).to(dh.dtype))

    def spread_(self, h: torch.Tensor, out: FilterOut, skipped: list[int]) -> None:
        """Keep Σ_r S_rb · h_r of the chunk's skipped blocks, for :meth:`finish_dw_`."""
        index = torch.tensor(skipped, device=h.device)
        self._spread.index_add_(0, index, out.block_sums[index] @ h.float())
        for b in skipped:
            self._spread_any[b] = True

    def first_writes(self, runs: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
        """``runs`` split where dW's blocks change from unwritten to written: (v0, v1, first) with ``first`` for a
        stretch no earlier chunk wrote (the product is stored there, not added); marks them written."""
        out: list[tuple[int, int, bool]] = []
        for v0, v1 in runs:
            for b in range(v0 // FILTER_BLOCK, -(-v1 // FILTER_BLOCK)):
                first = not self.written[b]
                self.written[b] = True
                lo, hi = b * FILTER_BLOCK, min(v1, (b + 1) * FILTER_BLOCK)
                if out and out[-1][1] == lo and out[-1][2] == first:
                    out[-1] = (out[-1][0], hi, first)
                else:
                    out.append((lo, hi, first))
        return out

    def store_zeros_(self, dw: torch.Tensor, blocks) -> None:
        """Zero those of dW's ``blocks`` that no chunk has written yet, and mark them written."""
        unwritten = [b for b in blocks if not self.written[b]]
        for b0, b1 in _block_runs(unwritten):
            dw[b0 * FILTER_BLOCK:b1 * FILTER_BLOCK].zero_()
        for b in unwritten:
            self.written[b] = True

    def sparse_blocks(self, sparse: SparseGrad) -> list[int]:
        """The blocks that a row pass's left-out entries fall in (one host sync)."""
        blocks = set((sparse.targets // FILTER_BLOCK).unique().tolist())
        if sparse.eos_values is not None:
            blocks.add(sparse.eos_index // FILTER_BLOCK)
        return sorted(blocks)

    def hold_sparse(self, h: torch.Tensor, sparse: SparseGrad) -> None:
        """Keep the left-out entries (its targets' one-hot terms, eos's column) and hidden states of a chunk that
        skipped blocks for :meth:`finish_dw_` (a chunk that skipped none adds them at once, as the unfiltered loop)."""
        self._sparse.append((h, sparse))

    def finish_dw_(self, dw: torch.Tensor, accumulate, add_sparse) -> None:
        """dW's rows of every block some chunk skipped += that block's kept sum spread evenly over its rows (eos's
        left out); rows of blocks no chunk wrote hold only that (or 0); then the chunks' left-out entries
        (``add_sparse(dw, h, sparse)``) and the held heavy rows' products."""
        self._spread_blocks_(dw)
        for h, sparse in self._sparse:
            add_sparse(dw, h, sparse)
        self._sparse = []
        self.flush_heavy_(dw, accumulate)

    def _spread_blocks_(self, dw: torch.Tensor) -> None:
        """dW's rows of each block += its spread (a block some chunk wrote), = its spread (one no chunk wrote), or
        = 0 (neither written nor skipped), by runs of adjacent blocks alike: one op per run, not per block (into dW's
        fresh memory, 256000 x 2304 bf16 took 3-7 s by blocks of 256 rows, 0.45 s as one broadcast copy)."""
        spread = (self._spread / self._counts.unsqueeze(1)).to(dw.dtype)
        kinds = ["add" if self.written[b] and self._spread_any[b] else "set" if self._spread_any[b]
                 else None if self.written[b] else "zero" for b in range(self.blocks)]
        eos_block = self.eos_column // FILTER_BLOCK if self.eos_column >= 0 else -1
        # eos's row takes no share of the spread: its own gradient came apart, exact (0 where no chunk wrote it)
        eos_row = None
        if eos_block >= 0 and kinds[eos_block] is not None:
            eos_row = dw[self.eos_column].clone() if self.written[eos_block] else torch.zeros_like(dw[0])
        for kind in ("add", "set", "zero"):
            for b0, b1 in _block_runs([b for b in range(self.blocks) if kinds[b] == kind]):
                rows = dw[b0 * FILTER_BLOCK:b1 * FILTER_BLOCK]
                if kind == "zero":
                    rows.zero_()
                    continue
                full = rows.shape[0] // FILTER_BLOCK  # the vocabulary's last block may be short
                parts = [(rows[: full * FILTER_BLOCK].view(full, FILTER_BLOCK, rows.shape[1]),
                          spread[b0:b0 + full].unsqueeze(1))]
                if rows.shape[0] > full * FILTER_BLOCK:
                    parts.append((rows[full * FILTER_BLOCK:], spread[b0 + full]))
                for target, source in parts:
                    if kind == "add":
                        target.add_(source)
                    else:
                        target.copy_(source.expand_as(target))
        if eos_row is not None:
            dw[self.eos_column] = eos_row
        self.written = [True] * self.blocks
