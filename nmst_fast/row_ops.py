"""Split-softmax row passes over one chunk of logits, in place.

A row pass turns a chunk of logits z (rows × V) into the logit gradient dz,
overwriting z, and reports the per-row scalars the head math needs. Three
implementations share one contract so the chunk driver is backend-agnostic:

* :class:`CpuRowOps` — the C++ kernels of ``nmst_fast/kernels/cpu/loss_rows.cpp`` (the CPU backend).
* :class:`TorchRowOps` — vectorized in-place torch ops (CUDA's "chunked" backend, and the CPU's where the C++
  kernels cannot be built).
* :class:`TritonRowOps` — the kernels in ``nmst_fast/kernels/split_softmax.py``.

Contract:
  ``lse_and_grad_(z, targets, eos_index, coefficients)`` returns (L, z_target, sparse), L and z_target each (rows,):
  L = logsumexp over non-eos columns in float64 (the loss L − z_target keeps its digits at large
  |L|; NaN on a row with a NaN or infinite logit, before any cap: the fused loss's data check), z_target in at
  least float32. If ``coefficients``
  is given it is called with L and must return :class:`GradCoefficients`;
  z is then overwritten with dz (see :mod:`nmst_fast.head_math`), but for ``sparse``: None, or a
  :class:`SparseGrad`, entries of dz the pass left out of the chunk (0 there) for the driver to add to
  the gradients outside the GEMMs.
  ``eos_index`` -1: the chunk holds no eos column (a vocabulary shard without it).
  ``grad_from_lse_(z, lse, targets, eos_index, coefficients)`` writes dz when
  L is already known (the recompute backward) and returns ``sparse`` likewise.
  Both take ``filtered``, None or a :class:`FilterOut` the pass fills for the gradient filter: for each column v,
  the largest |dz| of the column the chunk holds, over the chunk's rows, divided by the largest |coef_lse| of the
  rows (so that for unit row weights it is the largest probability of the token), and each row's sum of dz over
  each block of columns. With it the pass keeps eos's column and the targets' one-hot terms out of the chunk, in
  ``sparse``, where they dominate their entry (the target's p <= 1/2); a one-hot term it keeps in the chunk marks
  its column inf. The filter, which skips the blocks of columns it finds small, then never drops them, and keeps a
  block for a target only where the target is probable anyway.
  ``lse_and_statistics(z, targets, eos_index)`` (no gradient): (L, z_target, sums), sums (rows, 5) float64 of
  Σ e^(y−L)·y, Σ e^(2(y−L)), Σ y, max y and its first column over the non-eos columns, what
  :func:`nmst_fast.head_math.row_statistics` turns into the head's per-token statistics.

  With ``softcap`` c (given to the constructor) z holds the raw logits x, the head sees
  y = c · tanh(x / c): L, z_target and the coefficients are y's, and the dz written is the
  gradient with respect to x (y's gradient times sech²(x / c)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .head_math import GradCoefficients

CoefficientsFn = Callable[[torch.Tensor], GradCoefficients]


@dataclass
class SparseGrad:
    """Entries of a chunk's dz that its row pass left out of the chunk (0 there): ``target_values`` (rows,)
    float64 at each row's column ``targets`` (rows,) int64 (0 where nothing was left out), and ``eos_values``
    (rows,) float64 at column ``eos_index`` (None: no eos column in the chunk)."""

    targets: torch.Tensor
    target_values: torch.Tensor
    eos_index: int
    eos_values: Optional[torch.Tensor]


@dataclass
class FilterOut:
    """A row pass's report to the gradient filter: ``entry_max`` (V,) float32, each column's largest |dz| over the
    chunk's rows relative to the rows' largest |coef_lse|, and ``block_sums`` (ceil(V / block), rows) float32, each
    row's sum of dz over each ``block`` columns (what the chunk holds: no one-hot terms, 0 at eos)."""

    entry_max: torch.Tensor
    block_sums: torch.Tensor
    block: int


def _block_sums_(out: torch.Tensor, dz: torch.Tensor, block: int) -> None:
    """out (ceil(V / block), rows) = each row's sum of the (rows, V) dz over each block of columns, in float32."""
    V = dz.shape[1]
    full = V // block
    if full:
        out[:full] = dz[:, :full * block].unflatten(1, (full, block)).sum(2, dtype=torch.float32).t()
    if V % block:
        out[full] = dz[:, full * block:].sum(1, dtype=torch.float32)


def _relative_peaks_(entry_max: torch.Tensor, coefs: GradCoefficients) -> None:
    """entry_max /= the rows' largest |coef_lse| (GradCoefficients.largest; a chunk of rows without any leaves its
    zeros as they are)."""
    entry_max.div_(coefs.largest().to(entry_max.dtype).clamp(min=torch.finfo(entry_max.dtype).tiny))


def _report_(filtered: FilterOut, dz: torch.Tensor, coefs: GradCoefficients) -> None:
    """``filtered`` as the contract says, from a written (rows, V) dz (its one-hot terms, if any, keep their blocks:
    :func:`_keep_blocks_of_`)."""
    filtered.entry_max.copy_(torch.linalg.vector_norm(dz, float("inf"), dim=0))
    _relative_peaks_(filtered.entry_max, coefs)
    _block_sums_(filtered.block_sums, dz, filtered.block)


def _dominated(smooth_target: torch.Tensor, coefs: GradCoefficients, targets: torch.Tensor,
               eos_index: int) -> torch.Tensor:
    """(rows,) bool: the target's one-hot term dominates its entry of dz (|d + g| >= |d|, the target's p <= 1/2), so
    it goes apart; elsewhere the chunk keeps d + g, the smaller entry, and its block is kept."""
    one_hot = coefs.grad_target.to(torch.float64)
    smooth = smooth_target.to(torch.float64)
    return ((smooth + one_hot).abs() >= smooth.abs()) & (targets != eos_index)


def _apart(coefs: GradCoefficients, targets: torch.Tensor, eos_index: int, dominated: torch.Tensor,
           sech_target: Optional[torch.Tensor] = None, sech_eos: Optional[torch.Tensor] = None) -> SparseGrad:
    """The dominated one-hot terms of the targets and eos's column as a :class:`SparseGrad` (times the cap's sech² at
    those columns, where given), for a row pass that keeps them out of the chunk so that the gradient filter never
    keeps a block for them, nor drops them."""
    on_eos = targets == eos_index
    one_hot = torch.where(dominated, coefs.grad_target.to(torch.float64), 0.0)
    eos_values = None
    if eos_index >= 0:
        eos_values = coefs.grad_eos.to(torch.float64) + torch.where(on_eos, coefs.grad_target.double(), 0.0)
        if sech_eos is not None:
            eos_values = eos_values * sech_eos.to(torch.float64)
    if sech_target is not None:
        one_hot = one_hot * sech_target.to(torch.float64)
    return SparseGrad(targets, one_hot, eos_index, eos_values)


def _keep_blocks_of_(filtered: FilterOut, targets: torch.Tensor, dominated: torch.Tensor, eos_index: int) -> None:
    """The blocks of the one-hot terms that stayed in the chunk are kept (the filter must not drop them)."""
    filtered.entry_max.index_fill_(0, targets[~dominated & (targets != eos_index)], float("inf"))


def _finite_rows(z: torch.Tensor) -> torch.Tensor:
    """(rows,) bool: every logit of the row finite (eos's too), from its min and max (NaN propagates to both)."""
    return torch.isfinite(z.amin(dim=1)) & torch.isfinite(z.amax(dim=1))


class CpuRowOps:
    """The C++ row pass over vocabulary-major chunks (``nmst_fast/kernels/cpu/loss_rows.cpp``): one read of the
    chunk for L, one read and write for dz, in float32 (float64 for a float64 chunk), dz rounded once to the
    chunk's dtype.

    The chunk receives the smooth part of dz, coef · exp(y − L), with the eos column 0 and, on each row where the
    target's one-hot term would grow the target's entry (|d + g| ≥ |d|: the term dominates), without that term:
    :class:`SparseGrad` hands those back, and the driver adds them to dh, dW and db in at least float32. The bf16 /
    fp16 GEMMs then round only the smooth part, whose products are small where the one-hot terms dominate, so
    dW's sum of per-chunk bf16 products loses no more than one bf16 product over all rows would
    (tests/test_low_precision.py compares with the materialized bf16 backward)."""

    name = "chunked"

    def __init__(self, kernels: Any, softcap: Optional[float] = None) -> None:
        self._kernels = kernels
        self.softcap = softcap

    @staticmethod
    def vocab_major(device: torch.device) -> bool:
        return True  # the kernels take a chunk's tokens as contiguous lanes

    def _capped(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """float64 (y, sech²(x / c)) of raw logits x (sech² None without a cap)."""
        x = x.to(torch.float64)
        if self.softcap is None:
            return x, None
        u = x / self.softcap
        return self.softcap * torch.tanh(u), torch.cosh(u).square().reciprocal()  # cosh's overflow: 0

    def _gather(self, z: torch.Tensor, targets: torch.Tensor, eos_index: int):
        """The raw logits of each row's target and eos, read before dz overwrites them."""
        raw_target = z.gather(1, targets.unsqueeze(1)).squeeze(1)
        raw_eos = z[:, eos_index].to(torch.float64, copy=True) if eos_index >= 0 else None
        return raw_target, raw_eos

    def lse_and_grad_(
        self, z: torch.Tensor, targets: torch.Tensor, eos_index: int, coefficients: Optional[CoefficientsFn],
        filtered: Optional[FilterOut] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[SparseGrad]]:
        raw_target, raw_eos = self._gather(z, targets, eos_index)
        lse, row_max = self._kernels.chunk_lse(z.t(), eos_index, self.softcap or 0.0)
        y_target, sech_target = self._capped(raw_target)
        z_target = y_target.to(torch.promote_types(z.dtype, torch.float32))
        if coefficients is None:
            return lse, z_target, None
        coefs = coefficients(lse)
        # exp(y − L) as exp(y − m) · exp(m − L): the chunk's max m is a value of its dtype, exact as the shift
        sparse = self._write_grad_(z, row_max, coefs.coef_lse * torch.exp(row_max - lse), lse, coefs, targets,
                                   eos_index, y_target, sech_target, raw_eos, filtered)
        return lse, z_target, sparse

    def lse_and_statistics(self, z: torch.Tensor, targets: torch.Tensor,
                           eos_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lse, z_target, _ = self.lse_and_grad_(z, targets, eos_index, None)  # z is left as it is
        return lse, z_target, self._kernels.chunk_statistics(z.t(), eos_index, self.softcap or 0.0, lse.contiguous())

    def grad_from_lse_(
        self, z: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, eos_index: int, coefs: GradCoefficients,
        filtered: Optional[FilterOut] = None,
    ) -> SparseGrad:
        raw_target, raw_eos = self._gather(z, targets, eos_index)
        y_target, sech_target = self._capped(raw_target)
        lse = lse.to(torch.float64)
        return self._write_grad_(z, lse, coefs.coef_lse, lse, coefs, targets, eos_index, y_target, sech_target,
                                 raw_eos, filtered)

    def _write_grad_(self, z, shift, scale, lse, coefs: GradCoefficients, targets, eos_index, y_target, sech_target,
                     raw_eos, filtered: Optional[FilterOut]) -> SparseGrad:
        on_eos = targets == eos_index
        smooth = torch.where(on_eos, 0.0, coefs.coef_lse * torch.exp(torch.where(on_eos, 0.0, y_target - lse)))
        # sech² (the cap's chain factor) is a common positive factor of both terms: it leaves the rule unchanged
        left_out = _dominated(smooth, coefs, targets, eos_index)
        values = torch.where(left_out, smooth, smooth + coefs.grad_target.to(torch.float64))
        if sech_target is not None:
            values = values * sech_target
        report = () if filtered is None else (filtered.entry_max, filtered.block_sums, filtered.block)
        self._kernels.chunk_grad_(z.t(), shift, scale, eos_index, torch.where(on_eos, -1, targets), values,
                                  self.softcap or 0.0, *report)
        if filtered is not None:  # eos's column is 0 in the chunk: its gradient is in the SparseGrad
            _relative_peaks_(filtered.entry_max, coefs)
            _keep_blocks_of_(filtered, targets, left_out, eos_index)
        sech_eos = self._capped(raw_eos)[1] if self.softcap is not None and eos_index >= 0 else None
        return _apart(coefs, targets, eos_index, left_out, sech_target, sech_eos)


class TorchRowOps:
    """In-place torch row pass. Without a softcap it never allocates a second
    rows×V tensor; a softcap's gradient needs x / c kept while dz overwrites the chunk, in one
    reused rows×V buffer (the driver halves that path's chunk, ``default_chunk_rows(buffers=2)``)."""

    name = "chunked"

    def __init__(self, softcap: Optional[float] = None) -> None:
        self.softcap = softcap
        self._scratch: Optional[torch.Tensor] = None  # flat, reused across chunks

    def _scaled_copy(self, z: torch.Tensor) -> torch.Tensor:
        """u = z / c in a buffer laid out like z (a (rows, V) view of either major order)."""
        # The chunk buffers' views are dense up to a padded leading dimension: the scratch spans as many
        # elements, so u gets z's strides (the elementwise ops then walk both alike).
        span = 1 + sum((size - 1) * stride for size, stride in zip(z.shape, z.stride())) if z.numel() else 0
        if self._scratch is None or self._scratch.numel() < span or self._scratch.dtype != z.dtype:
            self._scratch = torch.empty(span, dtype=z.dtype, device=z.device)
        u = self._scratch[:span].as_strided(z.shape, z.stride())
        return torch.div(z, self.softcap, out=u)

    def _cap_(self, z: torch.Tensor, keep_for_grad: bool) -> Optional[torch.Tensor]:
        """z ← c · tanh(z / c) in place; returns u = z / c (raw) when the gradient will need it."""
        if self.softcap is None:
            return None
        if not keep_for_grad:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
            return None
        u = self._scaled_copy(z)
        torch.tanh(u, out=z).mul_(self.softcap)
        return u

    @staticmethod
    def _chain_cap_(dz: torch.Tensor, u: Optional[torch.Tensor]) -> None:
        """dz ← dz · sech²(u), the cap's derivative: accurate in relative terms at any |u| and in
        any dtype (1 − tanh² would round to 0 in bf16 once tanh rounds to 1); cosh's overflow gives 0."""
        if u is not None:
            dz.mul_(u.cosh_().square_().reciprocal_())

    @staticmethod
    def vocab_major(device: torch.device) -> bool:
        # Works on any strided view; the CPU GEMMs are faster with the (V, rows) layout.
        return device.type == "cpu"

    @staticmethod
    def _exp_shifted_(z: torch.Tensor, eos_index: int) -> torch.Tensor:
        # Masking eos with -inf makes every reduction below range over non-eos columns only
        # (eos_index -1: a vocabulary shard without eos).
        if eos_index >= 0:
            z[:, eos_index] = float("-inf")
        row_max = z.amax(dim=1, keepdim=True)
        z.sub_(row_max).exp_()
        return row_max.squeeze(1).to(torch.float64)

    def _finish_grad_(
        self, z: torch.Tensor, scale: torch.Tensor, coefs: GradCoefficients, targets: torch.Tensor, eos_index: int,
        u: Optional[torch.Tensor], filtered: Optional[FilterOut],
    ) -> Optional[SparseGrad]:
        """z (holding exp(z − m)) ← dz; with ``filtered`` (the gradient filter), the dominated one-hot terms and eos's
        column are returned apart (z's eos column 0) and the filter's report written."""
        # scale = coef_L · exp(m − L) turns exp(z − m) into coef_L · exp(z − L).
        z.mul_(scale.to(z.dtype).unsqueeze(1))
        if filtered is None:
            if eos_index >= 0:
                z[:, eos_index] = coefs.grad_eos.to(z.dtype)
            z.scatter_add_(1, targets.unsqueeze(1), coefs.grad_target.to(z.dtype).unsqueeze(1))
            self._chain_cap_(z, u)
            return None
        if eos_index >= 0:
            z[:, eos_index] = 0
        dominated = _dominated(z.gather(1, targets.unsqueeze(1)).squeeze(1), coefs, targets, eos_index)
        z.scatter_add_(1, targets.unsqueeze(1), torch.where(dominated | (targets == eos_index), 0.0,
                                                            coefs.grad_target).to(z.dtype).unsqueeze(1))
        self._chain_cap_(z, u)  # u now holds sech²(u)
        _report_(filtered, z, coefs)
        _keep_blocks_of_(filtered, targets, dominated, eos_index)
        if u is None:
            return _apart(coefs, targets, eos_index, dominated)
        return _apart(coefs, targets, eos_index, dominated, u.gather(1, targets.unsqueeze(1)).squeeze(1),
                      u[:, eos_index] if eos_index >= 0 else None)

    def lse_and_grad_(
        self, z: torch.Tensor, targets: torch.Tensor, eos_index: int, coefficients: Optional[CoefficientsFn],
        filtered: Optional[FilterOut] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[SparseGrad]]:
        stats_dtype = torch.promote_types(z.dtype, torch.float32)
        finite = _finite_rows(z)
        u = self._cap_(z, keep_for_grad=coefficients is not None)
        z_target = z.gather(1, targets.unsqueeze(1)).squeeze(1).to(stats_dtype)
        row_max = self._exp_shifted_(z, eos_index)
        # Sum in z's precision (>= fp32): torch's sum with dtype=float64 is ~20x slower on CPU.
        sum_exp = z.sum(dim=1, dtype=stats_dtype).to(torch.float64)
        lse = torch.where(finite, row_max + torch.log(sum_exp), float("nan"))
        sparse = None
        if coefficients is not None:
            coefs = coefficients(lse)
            sparse = self._finish_grad_(z, coefs.coef_lse / sum_exp, coefs, targets, eos_index, u, filtered)
        return lse, z_target, sparse  # L float64: L − z_target stays exact to the sum's rounding at any |L|

    # Rows per block of the statistics' copies (a (block, V) temporary, not a second chunk).
    _STATISTICS_ROWS = 256

    def lse_and_statistics(self, z: torch.Tensor, targets: torch.Tensor,
                           eos_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = z.shape[0]
        stats_dtype = torch.promote_types(z.dtype, torch.float32)
        lse = torch.empty(rows, dtype=torch.float64, device=z.device)
        z_target = torch.empty(rows, dtype=stats_dtype, device=z.device)
        sums = torch.empty(rows, 5, dtype=torch.float64, device=z.device)
        for r0 in range(0, rows, self._STATISTICS_ROWS):
            r1 = min(r0 + self._STATISTICS_ROWS, rows)
            y = z[r0:r1].to(stats_dtype, copy=True)
            finite = _finite_rows(y)
            if self.softcap is not None:
                y.div_(self.softcap).tanh_().mul_(self.softcap)
            z_target[r0:r1] = y.gather(1, targets[r0:r1].unsqueeze(1)).squeeze(1)
            off_eos = torch.ones(y.shape[1], dtype=torch.bool, device=y.device)
            if eos_index >= 0:
                off_eos[eos_index] = False
            top = y.masked_fill(~off_eos, float("-inf"))
            column = top.argmax(dim=1)  # the first column of the max
            row_max = top.gather(1, column.unsqueeze(1))
            q = torch.exp(top - row_max)
            total = q.sum(dim=1, keepdim=True)
            q.div_(total)
            lse[r0:r1] = torch.where(finite, row_max.squeeze(1).double() + total.squeeze(1).double().log(),
                                     float("nan"))
            kept = y.masked_fill_(~off_eos, 0.0)
            sums[r0:r1, 0] = (q * kept).sum(dim=1, dtype=torch.float64)
            sums[r0:r1, 1] = q.square().sum(dim=1, dtype=torch.float64)
            sums[r0:r1, 2] = kept.sum(dim=1, dtype=torch.float64)
            sums[r0:r1, 3] = row_max.squeeze(1).double()
            sums[r0:r1, 4] = column.double()
        return lse, z_target, sums

    def grad_from_lse_(
        self, z: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, eos_index: int, coefs: GradCoefficients,
        filtered: Optional[FilterOut] = None,
    ) -> Optional[SparseGrad]:
        u = self._cap_(z, keep_for_grad=True)
        # Shift by the row max (exact in z's dtype), not by L, so bf16 never rounds L.
        row_max = self._exp_shifted_(z, eos_index)
        return self._finish_grad_(z, coefs.coef_lse * torch.exp(row_max - lse.to(torch.float64)), coefs, targets,
                                  eos_index, u, filtered)


class TritonRowOps:
    """Row pass by the Triton kernels: one read for L, one read+write for dz."""

    name = "triton"

    @staticmethod
    def vocab_major(device: torch.device) -> bool:
        return False  # the kernels walk a row with unit stride

    def __init__(self, softcap: Optional[float] = None) -> None:
        from nmst_fast.kernels import split_softmax  # imported lazily: triton decides interpret mode at import

        self._kernels = split_softmax
        self.softcap = softcap  # applied on load by the kernels: no second buffer

    def lse_and_grad_(
        self, z: torch.Tensor, targets: torch.Tensor, eos_index: int, coefficients: Optional[CoefficientsFn],
        filtered: Optional[FilterOut] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[SparseGrad]]:
        lse, z_target = self._kernels.split_lse(z, targets, eos_index, self.softcap)
        sparse = None
        if coefficients is not None:
            sparse = self.grad_from_lse_(z, lse, targets, eos_index, coefficients(lse), filtered)
        return lse, z_target, sparse

    def lse_and_statistics(self, z: torch.Tensor, targets: torch.Tensor,
                           eos_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lse, z_target = self._kernels.split_lse(z, targets, eos_index, self.softcap)
        return lse, z_target, self._statistics(z, lse, eos_index)

    def _statistics(self, z: torch.Tensor, lse: torch.Tensor, eos_index: int) -> torch.Tensor:
        out = self._kernels.split_statistics(z, lse, eos_index, self.softcap)
        rounding = torch.exp(lse.float().double() - lse)  # the kernel shifts by L rounded to float32
        rounding = torch.where(torch.isfinite(rounding), rounding, 1.0)
        out[:, 0] *= rounding
        out[:, 1] *= rounding.square()
        return out

    def grad_from_lse_(
        self, z: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, eos_index: int, coefs: GradCoefficients,
        filtered: Optional[FilterOut] = None,
    ) -> Optional[SparseGrad]:
        sparse = None
        grad_eos, grad_target = coefs.grad_eos.float(), coefs.grad_target.float()
        if filtered is not None:  # the dominated one-hot terms and eos's column apart: the kernel writes 0 there
            y = z.gather(1, targets.unsqueeze(1)).squeeze(1).double()
            sech_target = sech_eos = None
            if self.softcap is not None:
                sech_target = torch.cosh(y / self.softcap).square().reciprocal()
                y = self.softcap * torch.tanh(y / self.softcap)
                if eos_index >= 0:
                    sech_eos = torch.cosh(z[:, eos_index].double() / self.softcap).square().reciprocal()
            dominated = _dominated(coefs.coef_lse * torch.exp(y - lse.double()), coefs, targets, eos_index)
            sparse = _apart(coefs, targets, eos_index, dominated, sech_target, sech_eos)
            grad_eos = torch.zeros_like(grad_eos)
            grad_target = torch.where(dominated | (targets == eos_index), 0.0, grad_target)
        self._kernels.split_softmax_grad_(z, targets, lse, coefs.coef_lse.float(), grad_eos, grad_target, eos_index,
                                          self.softcap)
        if filtered is not None:
            _report_(filtered, z, coefs)
            _keep_blocks_of_(filtered, targets, dominated, eos_index)
        return sparse
