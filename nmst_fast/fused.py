"""The chunked linear + split-softmax driver behind the "chunked" and "triton" backends.

Rows of the flat (N, H) hidden states are processed in chunks: one GEMM writes
the chunk's logits into a reused (chunk, V) buffer, a row pass (torch or
Triton, see :mod:`nmst_fast.row_ops`) turns them into the logit gradient in
place, and two GEMMs fold that into dh and dW. So extra memory is
O(chunk·V + N) plus an fp32 dW accumulator for low-precision weights, never N×V,
and training costs three GEMMs per chunk (the gradient is formed in the same
pass as the loss, for reductions "mean"/"sum").

Everything head-specific is O(N) scalar math (:mod:`nmst_fast.head_math`).
s = z_eos comes from one cheap GEMV up front, which gives "st" its whole-sequence
eos gradients before the V-wide pass starts.

With a logit softcap c (``HeadConfig.softcap``; Gemma 2/3) the heads see y = c · tanh(z / c): the
chunk buffer still receives the raw z from the GEMM, the row pass caps it (L, z_target, dy on y)
and leaves dz = dy · sech²(z / c) for the two gradient GEMMs, and s is the capped eos logit.
A logit scale is not seen here: the public entry point folds it into hidden and bias. Neither is a
temperature, but for ``HeadConfig.eos_scale``: the entry point folds 1/T into the logits and the cap, and
the NMST/ST heads read eos's logit back at T times the folded one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from . import head_math, logits
from .backends import cpu_has_amx
from .grad_filter import GradFilter
from .kernels.cpu import row_kernels
from .row_ops import CpuRowOps, FilterOut, SparseGrad, TorchRowOps, TritonRowOps
from .settings import HeadSettings
from .vocab_shard import VocabShard

# The chunk's byte budget: on CUDA the (chunk, V) logits' own; on CPU the call's extra memory, which a dW accumulator
# shares (chunk_budget).
_CHUNK_BYTES = {"cpu": 320 * 2**20, "cuda": 1024 * 2**20}


@dataclass(frozen=True)
class HeadConfig:
    """One call's configuration: the head (:class:`~nmst_fast.settings.HeadSettings`) and how the call lays
    out and post-processes its rows."""

    settings: HeadSettings
    ignore_index: int
    seq_len: int  # T of the (B, T) layout the flat rows come from; "st" sums along it
    softcap: Optional[float] = None  # c > 0: the heads see c·tanh(z / c) instead of z
    # The eos logit the head reads is eos_scale times the one in the chunk's logits. A temperature T of
    # "nmst"/"st" divides the non-eos logits only: the entry point folds 1/T into every logit, and
    # eos_scale = T takes eos's back (s = T·s', and dℓ/ds' = T·dℓ/ds goes in the eos column).
    eos_scale: float = 1.0

    @property
    def head(self) -> str:
        return self.settings.head

    @property
    def eos_index(self) -> int:
        return self.settings.eos_index

    @property
    def eps(self) -> float:
        return self.settings.eps


def default_chunk_rows(
    num_rows: int, vocab_size: int, dtype: torch.dtype, device: torch.device, *, buffers: int = 1,
    accumulator_bytes: int = 0,
) -> int:
    """Rows per chunk so the (chunk, V) logits buffer stays within :func:`chunk_budget`.

    On CPU each chunk adds its dW product into the wider accumulator (the accumulator read and written once per
    chunk: V·H·8 bytes of memory traffic against 2·rows·V·H FLOPs of the chunk's GEMM), so where the accumulator
    is large (Gemma's 256000 × 2304 in float32: 2.4 GB) the chunks grow with it, and the traffic stays a few
    percent of the GEMMs; and where all the rows' logits take no more than the accumulator and the fixed budget
    together (on CPU: the larger of the two), they are one chunk, whose dW needs no accumulator
    (:func:`direct_dw`). Chunks are balanced (4096 rows at <= 1001 per chunk become 4 x 832 + 768, not 4 x 1001 +
    92: a thin last chunk runs its three GEMMs at poor efficiency), in multiples of :data:`LANE_ALIGN` rows where
    there are several. ``buffers``: how many (chunk, V) tensors the row pass holds at once (2 for the torch row pass
    with a softcap): they share the budget.
    """
    base = _CHUNK_BYTES["cuda" if device.type == "cuda" else "cpu"]
    element = torch.empty((), dtype=dtype).element_size()
    # One chunk where its logits take no more than the accumulator it spares (direct_dw) beside the budget; on CPU,
    # whose budget is the call's whole extra memory, no more than the larger of the two.
    one_chunk = base + accumulator_bytes if device.type == "cuda" else max(base, accumulator_bytes)
    if accumulator_bytes and num_rows * vocab_size * element * buffers <= one_chunk:
        return max(1, num_rows)
    budget = chunk_budget(device, accumulator_bytes) // buffers
    max_rows = max(1, budget // (vocab_size * element))
    if max_rows >= LANE_ALIGN:  # chunks of a multiple of LANE_ALIGN rows within the budget
        max_rows -= max_rows % LANE_ALIGN
    num_chunks = max(1, -(-num_rows // max_rows))  # 0 rows (an empty batch): one empty chunk
    rows = max(1, -(-num_rows // num_chunks))
    # a multiple of LANE_ALIGN tokens where there are several chunks (each row of a vocabulary-major chunk then
    # starts a cache line: the CPU kernels' threads share none; see _chunk_loop); no more than max_rows, itself such
    # a multiple
    return rows if num_chunks == 1 or max_rows < LANE_ALIGN else -(-rows // LANE_ALIGN) * LANE_ALIGN


def chunk_budget(device: torch.device, accumulator_bytes: int = 0) -> int:
    """The bytes of a call's (chunk, V) logits: on CUDA a fixed budget; on CPU what the call's budget of extra memory
    leaves beside a dW accumulator of ``accumulator_bytes`` (0: none, dW is the weight's dtype), but at least half of
    it. Either way at least half the accumulator, where that is more (the chunks grow with a large one).

    On CPU larger chunks run the three GEMMs faster (4096 x 768 x 50257 in fp32 on a Xeon with AMX: the chunks'
    products 3.13 s in chunks of 832 rows, 2.91 s in 1376, against 3.09 s for the floor's three)."""
    base = _CHUNK_BYTES["cuda" if device.type == "cuda" else "cpu"]
    if device.type != "cuda":
        base = max(base - accumulator_bytes, base // 2)
    return max(base, accumulator_bytes // 2)


# A chunk buffer's leading dimension is padded to a multiple of this many elements (128 bytes in bf16):
# cuBLAS runs tensor-core GEMMs at full rate only when the output's leading dimension is aligned, and
# an odd V (GPT-2's 50257) would otherwise leave every (chunk, V) GEMM misaligned.
ROW_ALIGN = 64


# Chunks of several hold a multiple of this many tokens: 64 bytes of a vocabulary-major bf16 row, a cache line.
LANE_ALIGN = 32


def padded_stride(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ROW_ALIGN` (a chunk buffer's row stride)."""
    return -(-n // ROW_ALIGN) * ROW_ALIGN


def row_ops_for(backend: str, device: torch.device, softcap: Optional[float] = None):
    """The row pass of ``backend`` on ``device``: Triton's kernels, the C++ kernels on CPU (where they build), or
    torch ops."""
    if backend == "triton":
        return TritonRowOps(softcap)
    if device.type == "cpu" and (kernels := row_kernels()) is not None:
        return CpuRowOps(kernels, softcap)
    return TorchRowOps(softcap)


def direct_dw(num_rows: int, chunk_rows: int, weight_dtype: torch.dtype, device: torch.device,
              dw_dtype: Optional[torch.dtype]) -> bool:
    """Whether a bf16 weight's dW comes out of one GEMM in its own dtype, with no wider accumulator: on CPU, where
    every row fits one chunk and the default accumulator was asked for. The one product rounds once, as the
    materialized backward's does, and the V × H float32 accumulator (2.4 GB at Gemma's vocabulary), the writes of
    its fresh pages and its cast are saved (the rows the row pass's left-out entries touch are summed in float32
    and rounded once); "mean"'s 1/N joins the row weights, so backward's upstream scale (1 in training) rounds
    nothing."""
    return device.type == "cpu" and weight_dtype == torch.bfloat16 and dw_dtype is None and num_rows <= chunk_rows


def mean_folded(reduction: str, num_rows: int, chunk_rows: int, weight_dtype: torch.dtype, device: torch.device,
                dw_dtype: Optional[torch.dtype]) -> bool:
    """Whether the forward's gradients are "mean"'s own, its 1/N in the row weights, rather than the sum's: on CPU,
    where dz is float32 or wider or dW comes out of one bf16 GEMM (:func:`direct_dw`). Backward's upstream scale (1 in
    training) then needs no pass of its own where the gradients are in the parameters' dtype (fp32 and fp64 dW, a
    direct bf16 one). A bf16 / fp16 dz in chunks keeps unit weights: dz = p_v / N in fp16 underflowed before a
    GradScaler's loss scale could reach it (20-80% error on rarely-targeted rows' dW), and its float32 accumulator
    takes a pass for its cast anyway."""
    wide = weight_dtype in (torch.float32, torch.float64)
    return reduction == "mean" and device.type == "cpu" and (
        wide or direct_dw(num_rows, chunk_rows, weight_dtype, device, dw_dtype))


def chunk_buffers(backend: str, device: torch.device, softcap: Optional[float]) -> int:
    """How many (chunk, V) tensors the row pass of ``backend`` holds at once: 2 for the torch row pass with a
    softcap (it keeps x / c beside the chunk for the cap's gradient), else 1."""
    return 2 if softcap is not None and isinstance(row_ops_for(backend, device), TorchRowOps) else 1


def eos_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eos_index: int,
    softcap: Optional[float] = None, shard: Optional[VocabShard] = None,
) -> torch.Tensor:
    """s = h · W[eos] (+ b[eos]) for every row, in at least float32; c · tanh(s / c) with a softcap c.
    ``eos_index`` is global; with a vocabulary ``shard``, eos's owner computes s and every rank gets it."""
    local = eos_index if shard is None else shard.local(eos_index)
    if local < 0:
        return shard.sum_(hidden.new_zeros(hidden.shape[0], dtype=torch.promote_types(hidden.dtype, torch.float32)))
    s = logits.eos_logits(hidden, weight, bias, local, softcap=softcap)
    return s if shard is None else shard.sum_(s)


def _head_eos_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], cfg: HeadConfig,
                     shard: VocabShard) -> torch.Tensor:
    """The eos logit s the head reads per row (N,): the chunk's own, times ``cfg.eos_scale``."""
    s = eos_logits(hidden, weight, bias, cfg.eos_index, cfg.softcap, shard)
    return s if cfg.eos_scale == 1.0 else s * cfg.eos_scale


def _eos_column_grads(eos_grads: torch.Tensor, cfg: HeadConfig) -> torch.Tensor:
    """dℓ/ds per row as the eos column of the chunk's logits takes it: × ``cfg.eos_scale`` (s = scale · column)."""
    return eos_grads if cfg.eos_scale == 1.0 else eos_grads * cfg.eos_scale


@dataclass
class _RowTargets:
    active: torch.Tensor  # bool (N,): target is not ignore_index
    safe: torch.Tensor  # int64 (N,): target, 0 where ignored or outside the vocabulary (a valid column to gather)
    is_eos: torch.Tensor  # bool (N,): active and target == eos

    @classmethod
    def build(cls, targets: torch.Tensor, cfg: HeadConfig, shard: "VocabShard") -> "_RowTargets":
        """A target outside [0, V) (the caller refuses it after the pass: loss.py) reads column 0 meanwhile; a
        vocabulary shard's kernels see only its own (``VocabShard.local_tokens``)."""
        active = targets != cfg.ignore_index
        readable = active & (targets >= 0)
        if shard.group is None:
            readable &= targets < shard.size
        safe = torch.where(readable, targets, 0).long()
        return cls(active=active, safe=safe, is_eos=active & (safe == cfg.eos_index))


@functools.cache
def _cuda_has_fp32_out_gemm() -> bool:
    """Whether this torch's cuBLAS addmm takes bf16 operands with an fp32 output (torch >= 2.8)."""
    a = torch.ones(2, 2, dtype=torch.bfloat16, device="cuda")
    acc = torch.full((2, 2), float("nan"), device="cuda")
    try:
        torch.mm(a, a, out_dtype=torch.float32, out=acc)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return bool((acc == 4).all())


def dh_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """dh's dtype out of the forward pass for hidden states of ``dtype``: at least float32 on CPU, where the row
    pass's left-out entries (and backward's scale) join each chunk's GEMM product before dh's one rounding to
    ``dtype``; ``dtype`` itself elsewhere."""
    return torch.promote_types(dtype, torch.float32) if device.type == "cpu" else dtype


def dw_accumulator_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """dW sums over chunks in at least fp32, so bf16/fp16 weights lose nothing to per-chunk rounding."""
    return torch.promote_types(weight_dtype, torch.float32)


# Vocabulary rows per product of a low-precision dW on CPU: each (block, H) product is summed into the wider
# accumulator while it is still in cache.
DW_BLOCK_ROWS = 4096


def _accumulate_dw_(acc: torch.Tensor, dz: torch.Tensor, h: torch.Tensor, first: bool) -> None:
    """acc (V, H) = dzᵀ h for the first chunk (no zero-fill pass over acc), else acc += dzᵀ h.

    The sum runs in acc's dtype (fp32 for bf16/fp16 weights). On CPU, whose GEMMs take bf16 / fp16 operands only
    into an output of their own dtype, each block of :data:`DW_BLOCK_ROWS` vocabulary rows is multiplied in the
    operands' dtype (oneDNN's bf16 kernels: AMX, AVX-512-bf16) and its product, rounded once, added to acc."""
    a, b = dz.t(), h
    if acc.dtype != a.dtype and not a.is_cuda:
        block = torch.empty(min(DW_BLOCK_ROWS, a.shape[0]), b.shape[1], dtype=a.dtype, device=a.device)
        kernels = row_kernels() if acc.dtype == torch.float32 else None
        for v0 in range(0, a.shape[0], DW_BLOCK_ROWS):
            v1 = min(v0 + DW_BLOCK_ROWS, a.shape[0])
            product = torch.mm(a[v0:v1], b, out=block[: v1 - v0])
            if kernels is not None:  # one pass: torch's add_ of a bf16 product first copies it into float32
                kernels.accumulate_(acc[v0:v1], product, first)
            elif first:
                acc[v0:v1].copy_(product)
            else:
                acc[v0:v1].add_(product)
        return
    if acc.dtype == a.dtype:
        if first:
            torch.mm(a, b, out=acc)
        else:
            acc.addmm_(a, b)
    elif _cuda_has_fp32_out_gemm():
        # cuBLAS takes bf16 operands and reads/writes the fp32 sum directly: no rounding per chunk.
        if first:
            torch.mm(a, b, out_dtype=acc.dtype, out=acc)
        else:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        # Older torch: each chunk's product is rounded to bf16 once (as a plain bf16 backward's is).
        product = a @ b
        if first:
            acc.copy_(product)
        else:
            acc.add_(product)


def _chunk_loop(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    chunk_rows: int,
    row_pass: Callable[[int, int, torch.Tensor, Optional[FilterOut]], Optional[SparseGrad]],
    need: tuple[bool, bool, bool],
    vocab_major: bool,
    dw_dtype: Optional[torch.dtype] = None,
    grad_filter: Optional[float] = None,
    eos_column: int = -1,
    group: Any = None,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Run ``row_pass(start, stop, z, filtered)`` on each chunk's (rows, V) logits; fold the dz it leaves (and the
    entries it returns as left out of the chunk, if any) into grads.

    With ``grad_filter`` (a threshold in (0, 1)), the row pass also fills ``filtered`` (see :mod:`nmst_fast.row_ops`),
    and the dh and dW products skip every block of vocabulary entries whose entries all fall below the threshold,
    adding back those blocks' sums times their mean rows (:mod:`nmst_fast.grad_filter`; ``eos_column``: eos's row of
    ``weight``, or -1; ``group``: a vocabulary-parallel weight's process group, see :class:`GradFilter`).

    Returns (dh in :func:`dh_dtype`, dW and db in at least fp32: their accumulators; dW in ``dw_dtype``
    when given), each None unless ``need`` asks for it.

    Row-major, the logits are a view of a reused buffer whose row stride is V padded to a multiple
    of :data:`ROW_ALIGN` (whatever V is, every GEMM meets tensor-core alignment). ``vocab_major``
    stores a chunk's logits as (V, rows) and hands the row pass the transposed view: MKL forms
    W·hᵀ (a tall output) ~1.7x faster than h·Wᵀ (a wide one) for the same FLOPs, which outweighs
    the strided row reductions on CPU. Its row stride is the chunk's rows themselves: oneDNN's bf16 GEMMs
    read past K in an A operand whose row stride exceeds K (torch 2.13, small N: tests/test_low_precision.py), so
    the dW products' A = the chunk may carry no padding. :func:`default_chunk_rows` makes the rows a multiple
    of :data:`LANE_ALIGN` instead, so that every vocabulary row starts a cache line and the CPU kernels'
    threads, which split the vocabulary entries, never write to one line.
    Triton's row kernels need unit stride along V, so they use the row-major layout.
    """
    need_dh, need_dw, need_db = need
    N = hidden.shape[0]
    V = weight.shape[0]
    acc_dtype = dw_accumulator_dtype(weight.dtype)
    dh = torch.empty_like(hidden, dtype=dh_dtype(hidden.dtype, hidden.device)) if need_dh else None
    # The first chunk initializes dW (no zero fill); with no rows there is no first chunk.
    dw = None
    if need_dw:
        dw = (torch.empty if N else torch.zeros)(weight.shape, dtype=dw_dtype or acc_dtype, device=weight.device)
    db = (torch.zeros(V, dtype=torch.promote_types(weight.dtype, torch.float32), device=weight.device)
          if need_db else None)
    # One flat buffer, reused: each chunk views a prefix of it in its own shape; row-major, the row
    # stride is V padded to a multiple of ROW_ALIGN elements (see padded_stride).
    ld = padded_stride(V)
    # Wᵀ for dh's products, copied at the first chunk whose products take every column (one the gradient filter
    # thins takes W itself, so a call it thins in every chunk never copies it)
    transposes = need_dh and vocab_major and dh_from_transposed_weight(weight)
    weight_t = None
    buffer = torch.empty(min(chunk_rows, N) * (V if vocab_major else ld), dtype=hidden.dtype, device=hidden.device)
    gate = None
    if grad_filter is not None and (need_dh or need_dw) and N:
        gate = GradFilter(grad_filter, weight, min(chunk_rows, N), eos_column, group)
    for start in range(0, N, chunk_rows):
        stop = min(start + chunk_rows, N)
        h = hidden[start:stop]
        if vocab_major:
            z_vr = buffer[: (stop - start) * V].view(V, stop - start)
            if bias is None:
                torch.mm(weight, h.t(), out=z_vr)
            else:
                torch.addmm(bias.unsqueeze(1), weight, h.t(), out=z_vr)
            z = z_vr.t()
        else:
            z = buffer[: (stop - start) * ld].view(stop - start, ld)[:, :V]
            if bias is None:
                torch.mm(h, weight.t(), out=z)
            else:
                torch.addmm(bias, h, weight.t(), out=z)
        filtered = None if gate is None else gate.report(stop - start)
        sparse = row_pass(start, stop, z, filtered)
        runs, skipped, heavy = ([(0, V)], [], None) if gate is None else gate.plan(filtered)
        whole = runs == [(0, V)]
        if dh is not None:
            if whole and transposes and weight_t is None:
                weight_t = transposed_weight(weight)
            _dh_chunk(dh[start:stop], z, weight, sparse, weight_t if whole else None, None if whole else runs)
            if skipped:
                gate.correct_dh_(dh[start:stop], filtered, skipped)
        if dw is not None:
            if gate is None:
                _accumulate_dw_(dw, z, h, first=start == 0)
            else:
                for v0, v1, first in gate.first_writes(runs):
                    _accumulate_dw_(dw[v0:v1], z[:, v0:v1], h, first=first)
                if skipped:
                    gate.spread_(h, filtered, skipped)
            if sparse is not None:
                if skipped:  # added after the skipped blocks' spread, which then writes whole runs of blocks
                    gate.hold_sparse(h, sparse)
                else:
                    if gate is not None:
                        gate.store_zeros_(dw, gate.sparse_blocks(sparse))
                    _add_sparse_dw_(dw, h, sparse)
        if heavy is not None:
            gate.heavy_(None if dh is None else dh[start:stop], z, h, heavy, runs, dw, _accumulate_dw_)
        if db is not None:
            db += z.sum(dim=0, dtype=acc_dtype)
            if sparse is not None:
                db.index_add_(0, sparse.targets, sparse.target_values.to(db.dtype))
                if sparse.eos_values is not None:
                    db[sparse.eos_index] += sparse.eos_values.sum().to(db.dtype)
    if dw is not None and gate is not None:
        gate.finish_dw_(dw, _accumulate_dw_, _add_sparse_dw_)
    return dh, dw, db  # dW, db still in their accumulators' dtype: the callers cast once, at the end


def dh_from_transposed_weight(weight: torch.Tensor) -> bool:
    """Whether dh's products take Wᵀ (H, V) as a contiguous copy: bf16 on a CPU with AMX, where oneDNN forms
    Wᵀ·dzᵀ from it about 1.9x faster than dz·W from W (and W·hᵀ, the logits, stays as fast), which repays the copy
    (a (V, H) transpose by blocks, V·H·2 bytes of memory while the call runs) from the first chunk on."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and cpu_has_amx()


# Vocabulary rows per block of the fallback's transpose: a block (128 x H) stays in L2 while it is read column by
# column (256000 x 2304 bf16 on a Xeon with AMX: 0.75 s by such blocks, 1.10 s as one copy of the transposed view,
# 0.43 s by the kernels' transpose_rows).
_TRANSPOSE_ROWS = 128


def transposed_weight(weight: torch.Tensor) -> torch.Tensor:
    """Wᵀ (H, V), contiguous: the CPU kernels' ``transpose_rows`` (by 16 x 16 blocks, into huge pages), or torch's
    copies by blocks of vocabulary rows where they are not built."""
    kernels = row_kernels()
    if kernels is not None:
        return kernels.transpose_rows(weight)
    out = torch.empty(weight.shape[1], weight.shape[0], dtype=weight.dtype, device=weight.device)
    for v0 in range(0, weight.shape[0], _TRANSPOSE_ROWS):
        out[:, v0:v0 + _TRANSPOSE_ROWS].copy_(weight[v0:v0 + _TRANSPOSE_ROWS].t())
    return out


def _dh_chunk(out: torch.Tensor, dz: torch.Tensor, weight: torch.Tensor, sparse: Optional[SparseGrad],
              weight_t: Optional[torch.Tensor] = None, runs: Optional[list[tuple[int, int]]] = None) -> None:
    """out (rows, H) = dz · W: the chunk's GEMM in dz's dtype, plus the entries its row pass left out (``sparse``),
    added in out's dtype (:func:`dh_dtype`). With ``weight_t``, Wᵀ (H, V) contiguous
    (:func:`dh_from_transposed_weight`), the GEMM forms (dz · W)ᵀ = Wᵀ · dzᵀ. With ``runs`` (the gradient filter's
    kept [v0, v1) stretches), only those columns' products, each added in out's dtype."""
    same_dtype = weight_t is None and out.dtype == dz.dtype  # the GEMM writes out itself

    def product() -> torch.Tensor:
        return torch.mm(dz, weight) if weight_t is None else torch.mm(weight_t, dz.t()).t()

    left_out = None
    if sparse is not None:
        left_out = weight[sparse.targets].to(out.dtype) * sparse.target_values.to(out.dtype).unsqueeze(1)
        if sparse.eos_values is not None:
            left_out.addr_(sparse.eos_values.to(out.dtype), weight[sparse.eos_index].to(out.dtype))
    if runs is not None:
        out.zero_() if left_out is None else out.copy_(left_out)
        for v0, v1 in runs:
            if out.dtype == dz.dtype:
                out.addmm_(dz[:, v0:v1], weight[v0:v1])
            else:  # each stretch's bf16 / fp16 product, rounded once, joins the sum in float32
                out.add_(torch.mm(dz[:, v0:v1], weight[v0:v1]))
        return
    if left_out is None:
        if same_dtype:
            torch.mm(dz, weight, out=out)
        else:
            out.copy_(product())
        return
    if same_dtype:
        torch.addmm(left_out, dz, weight, out=out)
    else:  # a bf16 / fp16 product, rounded once, joins the left-out entries in float32
        out.copy_(left_out.add_(product()))


def _add_sparse_dw_(acc: torch.Tensor, h: torch.Tensor, sparse: SparseGrad) -> None:
    """acc (V, H) += the left-out entries' part of dzᵀ h (rows × H work), in at least float32: a bf16 / fp16 acc
    (a dW of one GEMM, :func:`direct_dw`, or an opt-in ``dw_dtype``) has the rows it touches read, summed with them
    in float32 and rounded once."""
    wide = torch.promote_types(acc.dtype, torch.float32)
    h = h.to(wide)
    rows, position = torch.unique(sparse.targets, return_inverse=True)
    touched = acc[rows].to(wide)
    touched.index_add_(0, position, h * sparse.target_values.to(wide).unsqueeze(1))
    acc[rows] = touched.to(acc.dtype)
    if sparse.eos_values is not None:
        acc[sparse.eos_index] = torch.addmv(acc[sparse.eos_index].to(wide), h.t(), sparse.eos_values.to(wide))


@dataclass
class _HeadPrep:
    """The per-row scalars the row passes and the loss need, computed once per forward."""

    rows: _RowTargets
    s: torch.Tensor  # eos logit per row, at least fp32
    log_surv: Optional[torch.Tensor]  # log(1 − α_t) per row (None for "va")
    row_weight: torch.Tensor  # float64 weight of each row: 1 if active, else 0
    eos_grads: Optional[torch.Tensor]  # d loss / d s per row (None for "va" or without grads)


def mean_divisor(active: torch.Tensor) -> torch.Tensor:
    """What "mean" divides by: the number of active (non-ignored) rows, at least 1."""
    return active.sum().clamp(min=1)


def _reduce(losses: torch.Tensor, rows: _RowTargets, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return losses
    total = losses.sum()
    return total if reduction == "sum" else total / mean_divisor(rows.active)


def fused_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    steps: Optional[torch.Tensor],
    cfg: HeadConfig,
    *,
    reduction: str,
    backend: str,
    chunk_rows: int,
    need: tuple[bool, bool, bool],
    shard: Optional[VocabShard] = None,
    dw_dtype: Optional[torch.dtype] = None,
    statistics: bool = False,
    grad_filter: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor],
           Optional[torch.Tensor]]:
    """Loss (and, for "mean"/"sum", the gradients) of the fused head.

    Args:
        hidden: (N, H) contiguous; weight (V, H) contiguous; bias (V,) or None.
        targets: (N,) int; steps: (N,) int64 (None for "va").
        need: which of (dh, dW, db) to compute in this pass; must be all False for "none".
        shard: with a process group, ``weight`` / ``bias`` hold the vocabulary rows
            [shard.start, shard.start + V) and ``targets`` / ``cfg.eos_index`` are global: the loss,
            L and dh come out whole on every rank, dW and db for this rank's rows.
        dw_dtype: dW's accumulator dtype (default: at least fp32; the weight's bf16 / fp16 to halve it).
        statistics: also the head's per-token statistics, from the chunks' own logits (no gradient asked, no
            ``shard``): one more read of each chunk, no other product.
        grad_filter: None, or the gradient filter's threshold in (0, 1) (see :func:`_chunk_loop`).
    Returns:
        loss (() or (N,), in at least float32), L (N,) float64 (NaN on a row with a non-finite logit, eos's
        included: the caller's data check), dh (hidden's dtype),
        dW, db (or None), and with ``statistics`` (N, 4) float64: entropy, log Σ p², the mean effective logit and
        whether the target is the most probable token (1 / 0; see :func:`~nmst_fast.head_math.row_statistics`),
        else None. dW and db stay in at least fp32 (their accumulators; dW in bf16 where
        :func:`direct_dw`): backward scales them by the upstream gradient and casts to the parameters' dtype in
        one pass. For "mean" the three are the gradients of the *sum*, which backward divides by the active-row
        count (where :func:`mean_folded`, of the mean itself).
    """
    want_grad = any(need)
    if statistics and (want_grad or (shard is not None and shard.group is not None)):
        raise ValueError("the fused statistics need a pass without gradients and the whole vocabulary")
    shard = shard or VocabShard(0, weight.shape[0])
    direct = direct_dw(hidden.shape[0], chunk_rows, weight.dtype, hidden.device, dw_dtype)
    folded = mean_folded(reduction, hidden.shape[0], chunk_rows, weight.dtype, hidden.device, dw_dtype)

    @functools.cache
    def prep() -> _HeadPrep:
        # The head's O(N) scalar math (a few dozen small kernels) is first asked for by the first
        # row pass, i.e. after the first chunk's GEMM is queued: on a GPU those kernels are
        # launched while that GEMM runs instead of holding it back.
        rows = _RowTargets.build(targets, cfg, shard)
        s = _head_eos_logits(hidden, weight, bias, cfg, shard)
        log_surv = None if cfg.head == "va" else head_math.log_survival(cfg.head, s, steps, cfg.eps, cfg.seq_len)
        # Unit row weights, but where "mean"'s 1/N is folded in (mean_folded): otherwise backward divides the
        # sum's gradients by the row count with the upstream gradient.
        row_weight = rows.active.to(torch.float64)
        if folded:
            row_weight = row_weight / mean_divisor(rows.active)
        eos_grads = None
        if want_grad and cfg.head != "va":
            eos_grads = head_math.eos_logit_grads(cfg.head, s, log_surv, rows.is_eos, row_weight, steps, cfg.seq_len)
            eos_grads = _eos_column_grads(eos_grads, cfg)
        return _HeadPrep(rows, s, log_surv, row_weight, eos_grads)

    N = hidden.shape[0]
    stats_dtype = torch.promote_types(hidden.dtype, torch.float32)
    lse = torch.empty(N, dtype=torch.float64, device=hidden.device)  # O(N): L − z_target needs its digits
    z_target = torch.empty(N, dtype=stats_dtype, device=hidden.device)
    row_ops = row_ops_for(backend, hidden.device, cfg.softcap)
    local_eos = shard.local(cfg.eos_index)  # -1: another rank holds eos
    sums = torch.empty(N, 5, dtype=torch.float64, device=hidden.device) if statistics else None

    def row_pass(start: int, stop: int, z: torch.Tensor, filtered: Optional[FilterOut]) -> Optional[SparseGrad]:
        p = prep()
        targets_here = p.rows.safe[start:stop]

        def coefficients(local_lse: torch.Tensor) -> head_math.GradCoefficients:
            lse[start:stop] = shard.global_lse(local_lse)
            coefs = head_math.grad_coefficients(
                cfg.head,
                lse[start:stop],
                p.s[start:stop],
                p.rows.is_eos[start:stop],
                p.row_weight[start:stop],
                None if p.eos_grads is None else p.eos_grads[start:stop],
            )
            return _local_coefficients(coefs, shard, local_lse, lse[start:stop], targets_here)

        if sums is not None:  # no gradient, no shard
            local_lse, chunk_target, sums[start:stop] = row_ops.lse_and_statistics(z, targets_here, local_eos)
            sparse = None
        else:
            local_lse, chunk_target, sparse = row_ops.lse_and_grad_(
                z, shard.local_tokens(targets_here), local_eos, coefficients if want_grad else None, filtered
            )
        if not want_grad:
            lse[start:stop] = shard.global_lse(local_lse)
        z_target[start:stop] = chunk_target if shard.group is None else torch.where(
            shard.owned(targets_here), chunk_target, 0.0)
        return sparse

    dh, dw, db = _chunk_loop(hidden, weight, bias, chunk_rows, row_pass, need, row_ops.vocab_major(hidden.device),
                             weight.dtype if direct else dw_dtype, grad_filter, local_eos, shard.group)
    shard.sum_(z_target)
    if dh is not None:
        shard.sum_(dh)
    p = prep()
    # L is NaN on a row with a non-finite logit (the row pass's flag); its eos logit, which the pass skips, joins it
    lse = torch.where(torch.isfinite(p.s), lse, float("nan"))
    z_target_exact = torch.where(p.rows.is_eos, p.s.to(stats_dtype), z_target)
    losses = head_math.row_losses(cfg.head, lse, p.s, z_target_exact, p.rows.is_eos, p.log_surv)
    losses = torch.where(p.rows.active, losses, 0.0)
    # At least fp32 (the caller casts it back to hidden's dtype outside autocast): under AMP the loss
    # stays fp32, so a GradScaler's 65536 reaches backward as a finite fp32 upstream gradient.
    loss = _reduce(losses, p.rows, reduction).to(stats_dtype)
    row_stats = None
    if sums is not None:
        entropy, log_sum_sq, mean, top = head_math.row_statistics(cfg.head, lse, p.s, p.log_surv, sums,
                                                                  weight.shape[0], cfg.eos_index)
        row_stats = torch.stack([entropy, log_sum_sq, mean, (top == p.rows.safe).to(torch.float64)], dim=1)
    return loss, lse, dh, dw, db, row_stats


def _local_coefficients(coefs: head_math.GradCoefficients, shard: VocabShard, local_lse: torch.Tensor,
                        lse: torch.Tensor, targets: torch.Tensor) -> head_math.GradCoefficients:
    """A shard's part of the coefficients: its row pass normalizes by its own L (``local_lse``; the
    global L when it has no group), so exp(L_local − L) rescales it, and only the target's owner
    adds grad_target."""
    if shard.group is None:
        return coefs
    return head_math.GradCoefficients(coefs.coef_lse * torch.exp(local_lse - lse), coefs.grad_eos,
                                      torch.where(shard.owned(targets), coefs.grad_target, 0.0), coefs.largest())


def fused_backward_from_lse(
    grad_rows: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    steps: Optional[torch.Tensor],
    lse: torch.Tensor,
    cfg: HeadConfig,
    *,
    backend: str,
    chunk_rows: int,
    need: tuple[bool, bool, bool],
    shard: Optional[VocabShard] = None,
    dw_dtype: Optional[torch.dtype] = None,
    grad_filter: Optional[float] = None,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Gradients for reduction="none": recompute each chunk's logits and weight rows by ``grad_rows`` (N,).
    ``lse`` is the forward's (global) L; ``shard`` and ``grad_filter`` as in :func:`fused_forward`."""
    shard = shard or VocabShard(0, weight.shape[0])
    rows = _RowTargets.build(targets, cfg, shard)
    s = _head_eos_logits(hidden, weight, bias, cfg, shard)
    row_weight = torch.where(rows.active, grad_rows.to(torch.float64), 0.0)
    eos_grads = None
    if cfg.head != "va":
        log_surv = head_math.log_survival(cfg.head, s, steps, cfg.eps, cfg.seq_len)
        eos_grads = head_math.eos_logit_grads(cfg.head, s, log_surv, rows.is_eos, row_weight, steps, cfg.seq_len)
        eos_grads = _eos_column_grads(eos_grads, cfg)
    coefs = head_math.grad_coefficients(cfg.head, lse, s, rows.is_eos, row_weight, eos_grads)
    # The row pass normalizes by the global L here, so a shard only keeps grad_target to the owner.
    coefs = _local_coefficients(coefs, shard, lse, lse, rows.safe)
    direct = direct_dw(hidden.shape[0], chunk_rows, weight.dtype, hidden.device, dw_dtype)
    row_ops = row_ops_for(backend, hidden.device, cfg.softcap)
    local_targets, local_eos = shard.local_tokens(rows.safe), shard.local(cfg.eos_index)

    def row_pass(start: int, stop: int, z: torch.Tensor, filtered: Optional[FilterOut]) -> Optional[SparseGrad]:
        return row_ops.grad_from_lse_(z, lse[start:stop], local_targets[start:stop], local_eos,
                                      coefs.rows(start, stop), filtered)

    dh, dw, db = _chunk_loop(hidden, weight, bias, chunk_rows, row_pass, need, row_ops.vocab_major(hidden.device),
                             weight.dtype if direct else dw_dtype, grad_filter, local_eos, shard.group)
    if dh is not None:
        shard.sum_(dh)
    return (None if dh is None else dh.to(hidden.dtype), None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype))
