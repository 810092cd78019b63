"""The fused loss's C++ row pass (nmst_fast/kernels/cpu/loss_rows.cpp) against float64: L and the max of each
token's logits over every vocabulary entry but eos, and the gradient it writes, on vocabulary-major chunks of every
dtype, odd widths (a thread's last, partial vector), any eos (or none), a softcap, strided chunks, extreme and
non-finite logits; and the layouts it refuses."""

from __future__ import annotations

import pytest
import torch

from nmst_fast.kernels import cpu

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# Error of L: float32's exp (float64: its own) on the terms, float32 sums of a block merged in float64.
LSE_ATOL = {torch.float32: 4e-6, torch.float64: 1e-12, torch.bfloat16: 4e-6, torch.float16: 4e-6}
# Error of a gradient entry relative to its size: one rounding to the chunk's dtype, on top of float32's math
# (float16: plus its subnormals' absolute step below 6e-5).
GRAD_RTOL = {torch.float32: 4e-6, torch.float64: 1e-12, torch.bfloat16: 2**-8 + 4e-6, torch.float16: 2**-11 + 4e-6}
GRAD_ATOL = {torch.float32: 1e-30, torch.float64: 1e-300, torch.bfloat16: 1e-30, torch.float16: 2**-25}


def kernels():
    ops = cpu.row_kernels()
    assert ops is not None, "the CPU row kernels did not build (see the warning logged above)"
    return ops


def capped(z: torch.Tensor, softcap) -> torch.Tensor:
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def reference_lse(z: torch.Tensor, eos: int, softcap) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (L, max) over the rows of z (V, R) but eos."""
    y = capped(z.double(), softcap)
    if eos >= 0:
        y = torch.cat([y[:eos], y[eos + 1:]])
    return torch.logsumexp(y, dim=0), y.amax(dim=0)


def chunk(V: int, R: int, dtype, gen, *, scale=3.0, ld=None) -> torch.Tensor:
    """A (V, R) chunk of N(0, scale²) logits, rounded to ``dtype``; with ``ld``, a view of a buffer whose rows are
    ``ld`` long (the driver's chunks are views of one buffer)."""
    values = (torch.randn(V, R, generator=gen, dtype=torch.float64) * scale).to(dtype)
    if ld is None:
        return values
    buffer = torch.full((V, ld), float("nan"), dtype=dtype)
    buffer[:, :R] = values
    return buffer[:, :R]


def check_lse(z, eos, softcap=None):
    lse, row_max = kernels().chunk_lse(z, eos, softcap or 0.0)
    want_lse, want_max = reference_lse(z, eos, softcap)
    assert lse.dtype == row_max.dtype == torch.float64 and lse.shape == (z.shape[1],)
    torch.testing.assert_close(lse, want_lse, atol=LSE_ATOL[z.dtype], rtol=0)
    torch.testing.assert_close(row_max, want_max, atol=LSE_ATOL[z.dtype], rtol=0)
    return lse, row_max


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V, R", [(2, 1), (5, 3), (37, 16), (131, 33), (1000, 64), (2049, 67), (300, 517)])
def test_lse_and_max_of_every_shape_and_eos(dtype, V, R):
    gen = torch.Generator().manual_seed(V * 1000 + R)
    z = chunk(V, R, dtype, gen)
    for eos in sorted({-1, 0, V // 2, V - 1}):
        check_lse(z, eos)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lse_with_a_softcap_and_a_strided_chunk(dtype):
    gen = torch.Generator().manual_seed(5)
    z = chunk(700, 45, dtype, gen, scale=20.0, ld=64)
    for softcap in (2.5, 30.0):
        check_lse(z, 11, softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_extreme_and_non_finite_logits(dtype, softcap):
    """Extreme finite logits keep L exact; a token with any NaN or infinite logit but eos's (before the cap, which
    would make an infinite one finite) gets L and m NaN: the fused loss's data check."""
    gen = torch.Generator().manual_seed(9)
    z = chunk(600, 40, dtype, gen, scale=3e3)
    check_lse(z, 0, softcap)
    z[:, 3] = float("-inf")  # every logit
    z[17, 4] = float("inf")  # one
    z[100:, 5] = float("-inf")  # blocks of -inf only after the first
    z[8, 7] = float("nan")
    z[0, 8] = float("inf")  # eos's row: not the pass's
    lse, row_max = kernels().chunk_lse(z, 0, softcap or 0.0)
    bad = torch.zeros(40, dtype=torch.bool)
    bad[[3, 4, 5, 7]] = True
    assert lse[bad].isnan().all() and row_max[bad].isnan().all()
    want_lse, want_max = reference_lse(z[:, ~bad], 0, softcap)
    torch.testing.assert_close(lse[~bad], want_lse, atol=LSE_ATOL[dtype], rtol=0)
    torch.testing.assert_close(row_max[~bad], want_max, atol=LSE_ATOL[dtype], rtol=0)


def reference_grad(z, shift, scale, eos, targets, values, softcap) -> torch.Tensor:
    y = capped(z.double(), softcap)
    dz = scale[None] * torch.exp(y - shift[None])
    if softcap is not None:
        dz = dz / torch.cosh(z.double() / softcap) ** 2
    if eos >= 0:
        dz[eos] = 0.0
    for r, t in enumerate(targets.tolist()):
        if t >= 0:
            dz[t, r] = values[r]
    return dz


# logits near 0, and near 3000 (float16 holds none there finer than 2)
@pytest.mark.parametrize("dtype, offset", [(dtype, 0.0) for dtype in DTYPES] +
                         [(dtype, 3000.0) for dtype in DTYPES if dtype != torch.float16])
@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("V, R, ld", [(3, 2, None), (97, 31, None), (1500, 70, 80), (257, 300, None)])
def test_the_gradient_it_writes(dtype, offset, softcap, V, R, ld):
    """dz = scale · exp(y − shift) · sech², rounded once; eos 0; the given values at the targets. The shift either
    the max (exact in the chunk's dtype) or L itself (rounded by the kernel, its scale corrected: at L ≈ 3000 a
    float32 L is up to 1.2e-4 off)."""
    gen = torch.Generator().manual_seed(V + R)
    z = chunk(V, R, dtype, gen, scale=6.0, ld=ld)
    z += offset
    eos = V // 3
    lse, row_max = kernels().chunk_lse(z, eos, softcap or 0.0)
    coef = torch.rand(R, generator=gen, dtype=torch.float64) * 2 - 1
    targets = torch.randint(0, V, (R,), generator=gen)
    targets[::4] = -1
    values = torch.randn(R, generator=gen, dtype=torch.float64)
    for shift, scale in ((row_max, coef * torch.exp(row_max - lse)), (lse, coef)):
        got = z.clone()
        kernels().chunk_grad_(got, shift, scale, eos, targets, values, softcap or 0.0)
        want = reference_grad(z, lse, coef, eos, targets, values, softcap)
        torch.testing.assert_close(got.double(), want, rtol=GRAD_RTOL[dtype], atol=GRAD_ATOL[dtype])
    if ld is not None:  # the buffer's columns beyond the chunk are untouched
        assert z._base[:, R:].isnan().all()


def test_layouts_and_arguments_it_refuses():
    z = torch.randn(10, 4)
    ops = kernels()
    with pytest.raises(RuntimeError, match="unit stride along R"):
        ops.chunk_lse(z.t(), 0, 0.0)
    with pytest.raises(RuntimeError, match="float32, float64, bfloat16 or float16"):
        ops.chunk_lse(z.int(), 0, 0.0)
    with pytest.raises(RuntimeError, match="eos must be a row of the chunk"):
        ops.chunk_lse(z, 10, 0.0)
    ones, none = torch.ones(4, dtype=torch.float64), torch.full((4,), -1)
    with pytest.raises(RuntimeError, match="shift must be a contiguous"):
        ops.chunk_grad_(z, ones.float(), ones, 0, none, ones, 0.0)
    with pytest.raises(RuntimeError, match="target 10 is not a row of the chunk"):
        ops.chunk_grad_(z, ones, ones, 0, torch.full((4,), 10), ones, 0.0)


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 31, 32, 33, 100_003])
def test_scale_cast_rounds_the_product_once(source, dtype, n):
    """A float32 accumulator (or a bf16 dW of one GEMM) times a scale in float32, rounded once to the gradient's
    dtype (as torch's float32 product cast), NaN and inf kept."""
    gen = torch.Generator().manual_seed(n)
    acc = (torch.randn(n, generator=gen) * 100).to(source)
    acc[0] = float("nan") if n > 1 else acc[0]
    acc[-1] = float("inf") if n > 2 else acc[-1]
    got = kernels().scale_cast(acc, 1 / 3, dtype)
    torch.testing.assert_close(got, (acc.float() * torch.tensor(1 / 3)).to(dtype), rtol=0, atol=0, equal_nan=True)
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        kernels().scale_cast(acc, 1.0, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V, H, block", [(1, 1, 256), (255, 37, 256), (256, 32, 256), (257, 33, 256),
                                         (3001, 100, 256), (10, 5, 3)])
def test_block_row_sums_sum_each_block_of_rows(dtype, V, H, block):
    """Each ``block`` rows' sum in float32 (the last block the rest), H not a multiple of the vector, against
    float64; a bad weight or block is refused."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    w = (torch.randn(V, H, generator=gen) * 4).to(dtype)
    got = kernels().block_row_sums(w, block)
    want = torch.stack([w[b:b + block].double().sum(0) for b in range(0, V, block)])
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="block must be positive"):
        kernels().block_row_sums(w, 0)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels().block_row_sums(w.double(), block)
