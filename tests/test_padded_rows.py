"""Row-major chunk buffers have a row stride of V padded to a multiple of 64 elements (tensor-core
alignment for the GEMMs whatever V is): the row passes read and write the padded views, and the
loss and gradients equal the float64 reference at odd V on the torch row pass and in the Triton
interpreter, for every head, with a bias, a softcap and ignored targets."""

import pytest
import torch

import nmst_fast
from nmst_fast import fused, row_ops
from nmst_fast.fused import ROW_ALIGN, padded_stride


def test_padded_stride():
    assert [padded_stride(n) for n in (1, 63, 64, 65, 50257)] == [64, 64, 64, 128, 50304]
    assert ROW_ALIGN == 64


def _case(seed: int, V: int, head: str):
    gen = torch.Generator().manual_seed(seed)
    B, T, H = 2, 7, 5
    h = torch.randn(B, T, H, generator=gen, dtype=torch.float64)
    W = torch.randn(V, H, generator=gen, dtype=torch.float64)
    b = torch.randn(V, generator=gen, dtype=torch.float64)
    y = torch.randint(0, V, (B, T), generator=gen)
    eos = V // 2
    y[0, 3], y[1, 1], y[1, 5] = eos, -100, -100
    return h, W, b, y, eos


def _loss_and_grads(impl, h, W, b, y, eos, head, softcap, dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in (h, W, b)]
    loss = nmst_fast.linear_nmst_loss(leaves[0], leaves[1], y, bias=leaves[2], eos_index=eos, eps=0.05, head=head,
                                      softcap=softcap, impl=impl, chunk_size=4)
    loss.backward()
    return [loss.detach().double()] + [x.grad.double() for x in leaves]


@pytest.mark.parametrize("head", ["nmst", "st", "va"])
@pytest.mark.parametrize("V,softcap", [(67, None), (129, 2.5), (63, None)])
@pytest.mark.parametrize("impl", ["chunked", "triton"])
def test_padded_row_major_buffers_match_the_reference(monkeypatch, impl, V, softcap, head):
    strides = []
    ops = row_ops.TritonRowOps if impl == "triton" else row_ops.TorchRowOps
    original = ops.lse_and_grad_

    def spy(self, z, *args, **kwargs):
        strides.append((z.shape[1], z.stride()))
        return original(self, z, *args, **kwargs)

    monkeypatch.setattr(ops, "lse_and_grad_", spy)
    if impl == "chunked":  # CUDA's torch row pass, forced here: the row-major layout (the CPU's kernels are not used)
        monkeypatch.setattr(fused, "row_kernels", lambda: None)
        monkeypatch.setattr(row_ops.TorchRowOps, "vocab_major", staticmethod(lambda device: False))
    case = _case(V + len(head), V, head)
    dtype = torch.float64 if impl == "chunked" else torch.float32
    got = _loss_and_grads(impl, *case, head, softcap, dtype)
    want = _loss_and_grads("reference", *case, head, softcap, torch.float64)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)
    for name, g, w in zip(("loss", "dh", "dW", "db"), got, want):
        torch.testing.assert_close(g, w, **tol, msg=lambda m: f"{name}: {m}")
    assert strides and all(width == V and stride == (padded_stride(V), 1) for width, stride in strides)
