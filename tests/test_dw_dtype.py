"""``dw_dtype=``: the opt-in bf16 / fp16 dW accumulator (the default sums dW over chunks in fp32). The
accumulator takes the asked dtype on the chunked and Triton backends, in the forward's gradient and
in reduction="none"'s recomputed backward, and under fake tensors; dW stays within bf16's rounding of
the float64 reference; other dtypes are refused before anything runs."""

import pytest
import torch

import nmst_fast
from nmst_fast import fused


def _case(seed: int, N=96, H=16, V=67):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=gen, dtype=torch.float64)
    W = 0.3 * torch.randn(V, H, generator=gen, dtype=torch.float64)
    y = torch.randint(0, V, (N,), generator=gen)
    y[::7] = 5  # eos
    y[3::11] = -100
    return h, W, y, torch.randint(1, 30, (N,), generator=gen)


def _dw(impl, case, dtype, dw_dtype, reduction="sum"):
    h, W, y, steps = case
    leaf = W.to(dtype).detach().requires_grad_()
    loss = nmst_fast.linear_nmst_loss(h.to(dtype), leaf, y, eos_index=5, eps=0.05, steps=steps, impl=impl,
                                      dw_dtype=dw_dtype, chunk_size=16, reduction=reduction)
    (loss.sum() if reduction == "none" else loss).backward()
    return leaf.grad.double()


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("impl", ["chunked", "triton"])
def test_bf16_accumulation_is_taken_and_stays_within_bf16_rounding(monkeypatch, impl, reduction):
    seen = []
    original = fused._accumulate_dw_

    def spy(acc, dz, h, first):
        seen.append(acc.dtype)
        return original(acc, dz, h, first)

    monkeypatch.setattr(fused, "_accumulate_dw_", spy)
    case = _case(len(impl) + len(reduction))
    want = _dw("reference", case, torch.float64, None)
    default = _dw(impl, case, torch.bfloat16, None, reduction)
    assert set(seen) == {torch.float32}
    seen.clear()
    low = _dw(impl, case, torch.bfloat16, torch.bfloat16, reduction)
    assert set(seen) == {torch.bfloat16} and len(seen) == 6  # 96 rows in chunks of 16
    error = lambda got: float((got - want).norm() / want.norm())  # noqa: E731
    # bf16 rounds to 2^-9 relative; six chunk sums add at most a few such roundings.
    assert error(default) < 1e-2 and error(low) < 2e-2, (error(default), error(low))


def test_the_fake_kernel_gives_the_asked_accumulator():
    from torch._subclasses.fake_tensor import FakeTensorMode

    h, W, y, steps = (t.to(torch.bfloat16) if t.is_floating_point() else t for t in _case(0))
    args = (h, W, None, y, steps, 1, "nmst", 5, 0.1, -100, "sum", "chunked", 16, True, True, False, None, None, 0,
            torch.bfloat16)
    real = torch.ops.nmst_fast.linear_loss(*args)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.ops.nmst_fast.linear_loss(*args)
    assert real[3].dtype == fake[3].dtype == torch.bfloat16


def test_other_dtypes_are_refused():
    h, W, y, steps = _case(1)
    with pytest.raises(TypeError, match="dw_dtype"):
        nmst_fast.linear_nmst_loss(h, W, y, eos_index=5, steps=steps, dw_dtype="bf16")
    with pytest.raises(ValueError, match="dw_dtype"):
        nmst_fast.linear_nmst_loss(h.bfloat16(), W.bfloat16(), y, eos_index=5, steps=steps, dw_dtype=torch.float16)
    with pytest.raises(ValueError, match="dw_dtype"):
        nmst_fast.linear_nmst_loss(h.float(), W.float(), y, eos_index=5, steps=steps, dw_dtype=torch.bfloat16)
    # The default spelled out is accepted.
    nmst_fast.linear_nmst_loss(h.float(), W.float(), y, eos_index=5, steps=steps, dw_dtype=torch.float32)
