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


def _cross_entropy_grads(x):
    """float64 reference: (loss, d loss / d hidden, d loss / d weight) of F.cross_entropy."""
    h, w = x.hidden.detach().double().requires_grad_(), x.weight.detach().double().requires_grad_()
    loss = torch.nn.functional.cross_entropy(h @ w.t(), x.targets)
    return (loss, *torch.autograd.grad(loss, (h, w)))


def test_padded_floor_forms_the_floors_gradients():
    """The floor at V padded to a multiple of 64 computes the floor's products (zero rows of W add
    zero columns to z), once it has built the padded W."""
    from benchmarks.cases import PAD_MULTIPLE, Shape, padded_vocab, three_gemms, three_gemms_padded

    assert [padded_vocab(V) for V in (50257, 256000, 64, 65)] == [50304, 256000, 64, 128] and PAD_MULTIPLE == 64
    x = make_inputs(Shape(48, 16, 509, torch.float64, "cpu"))
    three_gemms(x)
    dh, dw = x.hidden.grad, x.weight.grad
    three_gemms_padded(x)
    assert x.cache["padded_weight"].shape == (512, 16)
    torch.testing.assert_close(x.hidden.grad, dh)
    torch.testing.assert_close(x.weight.grad, dw)


@pytest.mark.parametrize("baseline", ["liger", "cut"])
def test_baselines_are_cross_entropy_of_the_same_inputs(baseline):
    """The GPU report's baselines take our inputs as they are meant to (hidden, weight, targets; mean
    over rows): loss and gradients match the float64 cross-entropy. Liger's kernels run here in
    Triton's interpreter; Cut Cross-Entropy's Triton kernels do not run in it, so its torch fallback
    stands in (the same entry point with impl="torch_compile")."""
    from benchmarks.cases import Shape, cut_linear_ce, liger_linear_ce

    x = make_inputs(Shape(40, 16, 203, torch.float32, "cpu"), seed=3)
    step = liger_linear_ce(torch.float32) if baseline == "liger" else cut_linear_ce(None, impl="torch_compile")
    step(x)
    _, dh, dw = _cross_entropy_grads(x)
    torch.testing.assert_close(x.hidden.grad.double(), dh, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(x.weight.grad.double(), dw, rtol=1e-4, atol=1e-6)


def test_gpu_cases_hold_the_padded_floor_bf16_dw_and_the_baselines_and_cpu_cases_cces_compiled_one():
    from benchmarks.cases import cases_for

    names = list(cases_for("cuda"))
    assert names[0] == "three GEMMs (floor)" and names[1] == "three GEMMs, V padded to 64"
    assert {"nmst triton, bf16 dW", "Liger fused linear CE (va, dW in the weight's dtype)",
            "Liger fused linear CE (va, fp32 dW)", "Cut Cross-Entropy (va, default filter)",
            "Cut Cross-Entropy (va, exact)"} <= set(names)
    cpu = list(cases_for("cpu"))
    assert not any("padded" in n or "Liger" in n or "bf16" in n for n in cpu)
    assert [n for n in cpu if "Cut" in n] == ["Cut Cross-Entropy (va, torch_compile)"]  # the one that runs on CPU


def test_report_rows_give_tflops_and_the_share_of_the_cards_peak():
    from benchmarks.cases import Shape
    from benchmarks.report import dense_bf16_peak, format_table, summarize

    assert dense_bf16_peak("NVIDIA H100 80GB HBM3") == 989.4 and dense_bf16_peak("NVIDIA H100 PCIe") == 756.0
    assert dense_bf16_peak("NVIDIA H200") == 989.4 and dense_bf16_peak("NVIDIA L40S") == 362.0
    assert dense_bf16_peak("NVIDIA A100-SXM4-80GB") == 312.0 and dense_bf16_peak("cpu") is None
    shape = Shape(1024, 512, 1000, torch.bfloat16, "cuda")
    useful = 6 * 1024 * 512 * 1000 / 1e12
    times = {"floor": [2.0, 1.0, 3.0], "va": [4.0, 3.0, 6.0]}
    rows = summarize(shape, times, {"floor": 1.0, "va": 0.5}, peak_tflops=100.0)
    va = rows[1]
    assert va["seconds"] == 4.0 and va["best"] == 3.0 and va["ratio"] == 2.0 and va["ratio_range"] == (2.0, 3.0)
    assert va["tflops"] == pytest.approx(useful / 4.0) and va["peak_share"] == pytest.approx(useful / 4.0 / 100.0)
    table = format_table(shape, rows, 3, "NVIDIA H200", 100.0)
    assert f"| va | 4.000 | 3.000 | 2.000 | 2.000–3.000 | {useful / 4:.4g} | {useful / 4:.1f} | 0.500 |" in table
    assert "NVIDIA H200, dense bf16 peak 100 TFLOP/s" in table
    unknown = format_table(shape, summarize(shape, times, {"floor": 1.0, "va": 0.5}, None), 3, "cpu", None)
    assert f"| {useful / 4:.4g} | — | 0.500 |" in unknown and "peak unknown" in unknown


def test_a_case_that_cannot_run_leaves_nan_and_the_report_goes_on(monkeypatch, capsys):
    import benchmarks.report as report
    from benchmarks.cases import Shape, three_gemms

    def broken(x):
        raise RuntimeError("no kernel for this card")

    monkeypatch.setattr(report, "cases_for", lambda device: {"floor": three_gemms, "broken": broken})
    times = report.measure_times(Shape(32, 16, 100, torch.float32, "cpu"), rounds=2)
    assert len(times["floor"]) == 2 and all(t > 0 for t in times["floor"])
    assert len(times["broken"]) == 2 and all(t != t for t in times["broken"])
    assert "broken does not run: RuntimeError: no kernel for this card" in capsys.readouterr().err


def test_a_case_that_did_not_run_is_not_run_again_for_its_memory(monkeypatch):
    import benchmarks.report as report
    from benchmarks.cases import Shape, three_gemms

    def broken(x):
        raise RuntimeError("no kernel for this card")

    measured = []
    monkeypatch.setattr(report, "cases_for", lambda device: {"floor": three_gemms, "broken": broken})
    monkeypatch.setattr(report, "_memory_in_subprocess", lambda shape, case: measured.append(case) or 0.25)
    rows = report.run_report(Shape(32, 16, 100, torch.float32, "cpu"), rounds=1, peak_tflops=None)
    assert measured == ["floor"]
    assert rows[0]["extra_gb"] == 0.25 and rows[1]["extra_gb"] != rows[1]["extra_gb"]


def test_skipped_cases_are_left_out_and_the_floor_always_runs(monkeypatch):
    import benchmarks.report as report
    from benchmarks.cases import Shape, three_gemms

    monkeypatch.setattr(report, "cases_for", lambda device: {"three GEMMs (floor)": three_gemms,
                                                             "slow peer": three_gemms, "ours": three_gemms})
    times = report.measure_times(Shape(32, 16, 100, torch.float32, "cpu"), rounds=1, skip=("slow", "GEMMs"))
    assert list(times) == ["three GEMMs (floor)", "ours"]
