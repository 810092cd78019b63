"""Shared builders and comparison rules for the correctness tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nmst_fast

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Draws of the Triton kernels' G-tests: 10⁶ on a GPU; 2·10⁵ in the CPU interpreter, which checks the
# kernels' logic at a fifth of the cost (still flagging a 6% error in a token of probability 0.05 at
# p < 10⁻⁵, where 10⁶ draws flag 3%).
KERNEL_DRAWS = 1_000_000 if DEVICE == "cuda" else 200_000
# The fast set's G-tests (the default `pytest tests`): one per kernel at 2·10⁴ draws, a tenth of the
# interpreter's size, which still flags a 28% error in a token of probability 0.05 at p < 10⁻⁵ with
# power 0.99 (an off-by-one in a kernel's pick or tiles moves whole tokens' mass); the full size runs under
# -m slow.
FAST_DRAWS = 20_000


def slow(*values, **kwargs):
    """A parametrize case behind the ``slow`` marker (deselected unless ``-m slow``)."""
    return pytest.param(*values, marks=pytest.mark.slow, **kwargs)


FAST_IMPLS = ("chunked", "triton")


@dataclass
class Case:
    hidden: torch.Tensor  # float64 master copies; each impl gets its own cast leaf
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    targets: torch.Tensor
    steps: Optional[torch.Tensor]
    eos_index: int
    eps: float
    head: str


def make_case(
    gen: torch.Generator,
    *,
    head: str,
    shape: tuple[int, ...],
    H: int,
    V: int,
    bias: bool,
    ignore_frac: float = 0.2,
    eos_frac: float = 0.1,
    logit_scale: float = 1.0,
    eps: float = 0.05,
    steps: Optional[torch.Tensor] = None,
) -> Case:
    """Random hidden/weight/targets; some targets ignored (one whole row when (B, T)), some eos."""
    eos_index = int(torch.randint(0, V, (1,), generator=gen))
    hidden = torch.randn(*shape, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64) * (logit_scale / H**0.5)
    b = torch.randn(V, generator=gen, dtype=torch.float64) * logit_scale if bias else None
    targets = torch.randint(0, V, shape, generator=gen)
    targets[torch.rand(shape, generator=gen) < eos_frac] = eos_index
    targets[torch.rand(shape, generator=gen) < ignore_frac] = -100
    if len(shape) == 2 and shape[0] > 1:
        targets[0] = -100  # a sequence with every target ignored
    return Case(hidden, weight, b, targets.to(DEVICE), steps, eos_index, eps, head)


def run(case: Case, impl: str, dtype: torch.dtype, *, reduction: str = "mean", chunk_size=None,
        grad_out: Optional[torch.Tensor] = None, **options):
    """Loss and grads (hidden, weight, bias) of one impl in ``dtype``, returned as float64; ``options``: more
    keyword arguments of ``linear_nmst_loss`` (softcap, ...)."""
    leaves = [t.to(DEVICE, dtype).requires_grad_() if t is not None else None
              for t in (case.hidden, case.weight, case.bias)]
    hidden, weight, bias = leaves
    loss = nmst_fast.linear_nmst_loss(
        hidden, weight, case.targets, eos_index=case.eos_index, eps=case.eps, head=case.head,
        steps=case.steps, bias=bias, reduction=reduction, impl=impl, chunk_size=chunk_size, **options,
    )
    if grad_out is None:
        grad_out = torch.ones_like(loss)
    inputs = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(loss, inputs, grad_out.to(loss.dtype))
    return [loss.detach().double()] + [g.double() for g in grads]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def assert_matches_truth(fast, naive, truth, *, factor: float = 4.0, rel_atol: float = 1e-6, what: str = ""):
    """The fast result's error vs float64 truth is at most ``factor`` × the error of plain torch
    in the same dtype, plus a small tolerance relative to the truth's magnitude (the criterion
    fused-loss libraries use: being no worse than what users run today)."""
    for name, f, n, t in zip(["loss", "d_hidden", "d_weight", "d_bias"], fast, naive, truth):
        assert torch.isfinite(f).all(), f"{what} {name}: non-finite values"
        scale = max(t.abs().max().item(), 1e-30) if t.numel() else 1.0
        bound = factor * max_err(n, t) + rel_atol * scale
        assert max_err(f, t) <= bound, f"{what} {name}: error {max_err(f, t):.3e} > bound {bound:.3e}"


def torchrun(script: str, ranks: int, *flags: str, module: bool = False, timeout: float = 600):
    """``torchrun --standalone --nproc_per_node ranks tests/distributed/<script> flags`` (``module``:
    ``-m <script>``, e.g. ``-m train``) on gloo, with this checkout first on the path and Triton in
    its interpreter; the finished process (``timeout`` seconds at most)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    target = ["-m", script] if module else [str(repo / "tests" / "distributed" / script)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               *target, *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=repo)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (``.largest``, in elements) while it is on."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


# The p-value a G-test on a fresh seed must exceed. A fast run makes about 350 of them; the G statistic's
# chi-square tail, Williams-corrected, still runs up to 2x heavy where cells expect 5-20 draws (simulated:
# multinomial draws of 4000 over 500 cells, P(p < 1e-5) = 1.9e-5). At 1e-5 a correct sampler failed about one run in
# 150; at 1e-8, one in about 100000, while a wrong distribution at these draw counts gives p far below it.
G_TEST_MIN_P = 1e-8


def g_test(counts, probs: torch.Tensor) -> tuple[float, int]:
    """G statistic and degrees of freedom of token ``counts`` (a Counter, or a (V,) tensor of counts) against
    ``probs`` (V,): cells of expected count below 5 pooled; a draw of a token of probability 0 fails at once. The
    statistic carries Williams' correction (divided by 1 + (k² − 1) / (6 n (k − 1)) over k cells and n draws), which
    brings its tail near the chi-square's where cells expect few draws. Sum the statistics of independent tests,
    then ``scipy.stats.chi2.sf(g, df)``."""
    import math

    if isinstance(counts, torch.Tensor):
        counts = {token: int(c) for token, c in enumerate(counts.tolist()) if c}
    n = sum(counts.values())
    impossible = [token for token, c in counts.items() if c and probs[token] == 0]
    assert not impossible, f"drew tokens of probability 0: {impossible}"
    expected = probs.double() * n
    big = (expected >= 5).nonzero().view(-1).tolist()
    observed = [counts.get(token, 0) for token in big]
    cells = [float(expected[token]) for token in big]
    rest_observed, rest_expected = n - sum(observed), n - sum(cells)
    if rest_expected > 1e-9:
        observed.append(rest_observed)
        cells.append(rest_expected)
    g = 2 * sum(o * math.log(o / e) for o, e in zip(observed, cells) if o > 0)
    k = len(observed)
    if k > 1:
        g /= 1 + (k * k - 1) / (6 * n * (k - 1))
    return g, k - 1


def g_test_p(draws: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of :func:`g_test` for the tokens ``draws`` (any shape) against ``probs`` (V,) (1 with a single cell)."""
    from scipy import stats

    g, df = g_test(torch.bincount(draws.reshape(-1).cpu(), minlength=probs.numel()), probs.cpu())
    return float(stats.chi2.sf(g, df)) if df > 0 else 1.0
