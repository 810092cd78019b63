"""pytest-benchmark suite for per-step selection (``pytest benchmarks``)."""

import pytest
import torch

from benchmarks.decoding_cases import STRATEGIES, fast, make_logits, sort_based

SHAPES = [(32, 33278), (256, 50257)]


@pytest.mark.parametrize("B,V", SHAPES)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("impl", ["fast", "sort-based"])
def test_select(benchmark, B, V, strategy, impl):
    logits = make_logits(B, V)
    k, p = STRATEGIES[strategy]
    step = (fast if impl == "fast" else sort_based)(k, p)
    gen = torch.Generator().manual_seed(0)
    benchmark.group = f"select B={B} V={V} {strategy}"
    tokens = benchmark.pedantic(step, args=(logits, gen), warmup_rounds=1, rounds=5, iterations=1)
    assert tokens.shape == (B,)
