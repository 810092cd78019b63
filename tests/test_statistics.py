"""The head's per-token statistics from the fused loss's own pass (linear_nmst_loss_with_statistics: entropy,
log Σ p², the mean effective logit, top-1) against the float64 materialized reference, in every backend (the C++
row kernels, torch's row ops, Triton's kernels in the interpreter), every head, at odd V, eos first / inside /
last, temperatures, a softcap, large t, tiny and large ε, extreme logits and ignored targets; and that they
cost no second product."""

from __future__ import annotations

import pytest
import torch

from nmst_fast import linear_nmst_loss, linear_nmst_loss_with_statistics
from nmst_fast.kernels import cpu
from nmst_fast.statistics import materialized_statistics

NAMES = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.fixture(params=["cpu_kernels", "torch_ops", "triton"])
def backend(request, monkeypatch):
    return _backend(request.param, monkeypatch)


@pytest.fixture(params=["cpu_kernels", "torch_ops"])
def cpu_backend(request, monkeypatch):
    return _backend(request.param, monkeypatch)


def _backend(name: str, monkeypatch) -> str:
    """The impl to call, with the CPU row kernels on or off."""
    if name == "torch_ops":
        monkeypatch.setattr("nmst_fast.fused.row_kernels", lambda: None)
    elif name == "cpu_kernels":
        assert cpu.row_kernels() is not None, "the CPU row kernels did not build"
    return "triton" if name == "triton" else "chunked"


def _case(seed: int, head: str, V: int, eos: int, dtype: torch.dtype, *, scale: float = 1.0, large_t: bool = False):
    gen = torch.Generator().manual_seed(seed)
    B, T, H = 3, 5, 8
    h = (torch.randn(B, T, H, generator=gen, dtype=torch.float64) * scale).to(dtype)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64).to(dtype)
    bias = torch.randn(V, generator=gen, dtype=torch.float64).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=gen)
    targets[0, 1] = -100
    targets[1, 2] = eos
    steps = None
    if head == "nmst":
        steps = torch.arange(-1, T - 1).clamp(min=0).expand(B, T).clone()
        if large_t:
            steps = steps + 10**6
    return h, weight, bias, targets, steps


def _check(fast: dict, truth: torch.Tensor, targets: torch.Tensor, atol: float) -> None:
    active = targets.reshape(-1) != -100
    truth = torch.where(active.unsqueeze(1), truth, 0.0)
    for k, name in enumerate(NAMES):
        got = fast[name].reshape(-1)
        if name == "is_top1":
            assert got.dtype == torch.bool
            assert torch.equal(got, truth[:, k] > 0.5), name
        else:
            assert got.dtype == torch.float64
            torch.testing.assert_close(got, truth[:, k], atol=atol * (1 + truth[:, k].abs().max().item()), rtol=0,
                                       msg=name)


@pytest.mark.parametrize("head", ["nmst", "st", "va"])
@pytest.mark.parametrize(("V", "eos"), [(2, 0), (37, 36), (515, 200)])
@pytest.mark.parametrize("options", [dict(), dict(temperature=0.7, softcap=6.0), dict(eps=1e-7, temperature=1.3),
                                     dict(eps=0.5, scale=8.0, large_t=True)])
def test_statistics_match_the_float64_reference(backend, head, V, eos, options):
    options = dict(options)
    scale, large_t = options.pop("scale", 1.0), options.pop("large_t", False)
    dtypes = (torch.float32,) if backend == "triton" else (torch.float32, torch.float64)
    for dtype in dtypes:
        h, weight, bias, targets, steps = _case(V + len(options), head, V, eos, dtype, scale=scale, large_t=large_t)
        kw = dict(eos_index=eos, head=head, steps=steps, bias=bias, **options)
        nll, stats = linear_nmst_loss_with_statistics(h, weight, targets, impl=backend, chunk_size=4, **kw)
        torch.testing.assert_close(nll, linear_nmst_loss(h, weight, targets, reduction="none", impl=backend,
                                                         chunk_size=4, **kw))
        truth = materialized_statistics(h.double(), weight.double(), bias.double(), targets,
                                        None if head == "va" else (steps if steps is not None else
                                                                   torch.arange(1, 6).expand(3, 5)),
                                        head=head, eos_index=eos, eps=options.get("eps", 1e-5),
                                        temperature=options.get("temperature", 1.0), softcap=options.get("softcap"),
                                        logit_scale=None)
        _check(stats, truth, targets, 2e-5 if dtype == torch.float32 else 1e-10)


@pytest.mark.parametrize("head", ["nmst", "va"])
def test_statistics_of_bfloat16_logits(cpu_backend, head):
    """bf16 chunks (the CPU's bf16 products; the Triton kernels compute in float32 whatever the storage, as the
    float32 case checks): the statistics of the bf16-rounded logits, to their rounding; top-1 on most rows (near
    ties flip)."""
    backend = cpu_backend
    h, weight, bias, targets, steps = _case(7, head, 301, 150, torch.bfloat16, scale=2.0)
    kw = dict(eos_index=150, head=head, steps=steps, bias=bias)
    _, stats = linear_nmst_loss_with_statistics(h, weight, targets, impl=backend, chunk_size=8, **kw)
    truth = materialized_statistics(h.double(), weight.double(), bias.double(), targets,
                                    steps, head=head, eos_index=150, eps=1e-5, temperature=1.0, softcap=None,
                                    logit_scale=None)
    active = targets.reshape(-1) != -100
    for k, name in enumerate(NAMES[:3]):
        want = torch.where(active, truth[:, k], 0.0)
        torch.testing.assert_close(stats[name].reshape(-1), want, atol=0.05, rtol=0.02, msg=name)
    assert (stats["is_top1"].reshape(-1) == (truth[:, 3] > 0.5) & active).float().mean() > 0.9


def _products(call) -> list[tuple]:
    """The input shapes of every matrix product (mm, addmm, bmm) ``call()`` runs, inside the fused op too."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        call()
    return sorted(str(event.input_shapes) for event in prof.events()
                  if event.name in ("aten::mm", "aten::addmm", "aten::bmm"))


def test_the_statistics_take_no_second_product(backend):
    h, weight, bias, targets, steps = _case(3, "nmst", 515, 200, torch.float32)
    kw = dict(eos_index=200, head="nmst", steps=steps, bias=bias, impl=backend, chunk_size=4)
    plain = _products(lambda: linear_nmst_loss(h, weight, targets, reduction="none", **kw))
    with_statistics = _products(lambda: linear_nmst_loss_with_statistics(h, weight, targets, **kw))
    assert with_statistics == plain
    assert sum("515" in shapes for shapes in plain) == 4  # one (chunk, V) product per chunk of 4 of the 15 rows


def test_bad_arguments_are_refused_before_any_kernel():
    h, weight, bias, targets, steps = _case(3, "nmst", 37, 3, torch.float32)
    with pytest.raises(ValueError, match="eos_index"):
        linear_nmst_loss_with_statistics(h, weight, targets, eos_index=37, steps=steps)
    targets[0, 0] = 37
    with pytest.raises(ValueError, match="targets"):
        linear_nmst_loss_with_statistics(h, weight, targets, eos_index=3, steps=steps)
