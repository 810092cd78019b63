"""The Triton row kernels on their own (interpreter on CPU, real GPU when present)."""

import pytest
import torch

from nmst_fast.kernels.split_softmax import split_lse, split_softmax_grad_

from helpers import DEVICE


def _reference_stats(z, targets, eos):
    z64 = z.double()
    masked = z64.clone()
    masked[:, eos] = float("-inf")
    return torch.logsumexp(masked, 1), z64.gather(1, targets[:, None]).squeeze(1)


@pytest.mark.parametrize("V,eos", [(2, 0), (37, 36), (4097, 4096), (4100, 7), (5000, 4999)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_lse(V, eos, dtype):
    """V not a multiple of the block, including a last tile that holds only eos."""
    gen = torch.Generator().manual_seed(V)
    z = (torch.randn(6, V, generator=gen) * 20).to(DEVICE, dtype)
    targets = torch.randint(0, V, (6,), generator=gen).to(DEVICE)
    lse, zt = split_lse(z, targets, eos)
    exp_lse, exp_zt = _reference_stats(z, targets, eos)
    torch.testing.assert_close(lse.double(), exp_lse, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(zt.double(), exp_zt)


@pytest.mark.parametrize("V,eos", [(37, 0), (4100, 4099)])
def test_split_softmax_grad(V, eos):
    gen = torch.Generator().manual_seed(1)
    rows = 5
    z = (torch.randn(rows, V, generator=gen) * 5).to(DEVICE)
    targets = torch.tensor([0, 3, eos, V - 1, 1]).to(DEVICE)
    lse, _ = split_lse(z, targets, eos)
    coef, grad_eos, grad_target = (torch.randn(rows, generator=gen).to(DEVICE) for _ in range(3))
    expected = coef[:, None].double() * torch.exp(z.double() - lse[:, None].double())
    expected[:, eos] = grad_eos.double()
    expected[torch.arange(rows), targets] += grad_target.double()
    split_softmax_grad_(z, targets, lse, coef, grad_eos, grad_target, eos)
    torch.testing.assert_close(z.double(), expected, rtol=1e-5, atol=1e-6)


def test_rejects_strided_rows():
    z = torch.randn(8, 4, device=DEVICE).t()
    with pytest.raises(ValueError, match="unit stride"):
        split_lse(z, torch.zeros(4, dtype=torch.long, device=DEVICE), 0)


@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_scale_cast_matches_one_rounding(dst_dtype, scale_dtype):
    """(src · scale) computed in fp32 and rounded once to the output dtype, for sizes around the block."""
    from nmst_fast.kernels.scale_cast import scale_cast

    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    for n in (1, 4095, 4096, 4097, 3 * 4096 + 5):
        src = (torch.randn(n, generator=gen) * torch.logspace(-20, 3, n)).to(DEVICE)
        scale = (torch.rand((), generator=gen) * 4 - 2).to(DEVICE, scale_dtype)
        got = scale_cast(src, scale, dst_dtype)
        expected = (src.float() * scale.float()).to(dst_dtype)
        assert got.dtype == dst_dtype and got.shape == src.shape
        assert torch.equal(got, expected), f"seed={seed} n={n}"
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.4e38, -3.39e38, -0.0, 0.0, 1e-45, 1e-39,
                            1.0 + 2**-8, 1.0 + 3 * 2**-8], device=DEVICE)  # last two: ties to even
    got = scale_cast(special, torch.tensor(1.0, device=DEVICE, dtype=scale_dtype), dst_dtype)
    expected = special.float().to(dst_dtype)
    assert torch.equal(got.isnan(), expected.isnan())
    number = ~expected.isnan()
    assert torch.equal(got[number], expected[number]) and torch.equal(got[number].signbit(), expected[number].signbit())
    v = torch.ones(2, 3, device=DEVICE)
    assert scale_cast(v, torch.tensor([2.0], device=DEVICE), torch.bfloat16).shape == (2, 3)
    with pytest.raises(ValueError, match="contiguous"):
        scale_cast(v.t(), torch.tensor(2.0, device=DEVICE), torch.bfloat16)
    with pytest.raises(ValueError, match="scale"):
        scale_cast(v, torch.ones(2, device=DEVICE), torch.bfloat16)
    for src_dtype in (torch.bfloat16, torch.float16):  # the loss's dh, scaled in its own dtype
        src = (torch.randn(5000, generator=gen) * 100).to(DEVICE, src_dtype)
        scale = torch.tensor(1 / 3000.0, device=DEVICE, dtype=torch.float64)
        assert torch.equal(scale_cast(src, scale, src_dtype), (src.float() * scale.float()).to(src_dtype))
    for src, dtype in [(v.double(), torch.float64), (v.bfloat16(), torch.float64), (v.double(), torch.bfloat16)]:
        with pytest.raises(TypeError, match="fp32/bf16/fp16"):
            scale_cast(src, torch.tensor(2.0, device=DEVICE), dtype)
