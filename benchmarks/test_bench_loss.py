"""pytest-benchmark suite for the fused loss.

    pytest benchmarks                       # quick CPU shape (512x256x8192)
    NMST_BENCH_FULL=1 pytest benchmarks     # the issue's CPU shape 4096x768x50257 (minutes)

GPU shapes (bf16) run when CUDA is present. Compare rows of one run: the
"three GEMMs (floor)" row is what every other row should be divided by.
`python -m benchmarks.report` prints those ratios and peak memory directly.
"""

import os

import pytest
import torch

from benchmarks.cases import CPU_DEFAULT, CPU_SMALL, GPU_SHAPES, cases_for, make_inputs

SHAPES = [CPU_DEFAULT if os.environ.get("NMST_BENCH_FULL") == "1" else CPU_SMALL]
if torch.cuda.is_available():
    SHAPES += list(GPU_SHAPES)

PARAMS = [pytest.param(shape, name, id=f"{shape.label()}-{name}")
          for shape in SHAPES for name in cases_for(shape.device)]


@pytest.mark.parametrize("shape,name", PARAMS)
def test_fwd_bwd(benchmark, shape, name):
    inputs = make_inputs(shape)
    step = cases_for(shape.device)[name]
    benchmark.group = shape.label()

    def run():
        step(inputs)
        if shape.device == "cuda":
            torch.cuda.synchronize()

    benchmark.pedantic(run, warmup_rounds=1, rounds=3 if shape is CPU_SMALL else 2, iterations=1)
    assert torch.isfinite(inputs.hidden.grad).all()
