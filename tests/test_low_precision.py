"""bf16 and fp16 on the CPU backend: the fused loss's gradients are no further from float64 than the materialized
computation's in the same dtype (autograd through the (N, V) logits in that dtype, ``impl="reference"``), although
they are summed over many chunks: dW adds each chunk's product, rounded once to the dtype, in float32, and the row
pass leaves the terms that dominate a row out of those products (row_ops.CpuRowOps). Flat rows (random targets at
small logits, where the one-hot terms dominate the gradient) and peaked ones (targets drawn from the model's own
distribution at large logits), every head, a bias, a softcap."""

from __future__ import annotations

import pytest
import torch

import nmst_fast
from nmst_fast import fused

from helpers import Case, make_case, run


def relative_error(got: torch.Tensor, truth: torch.Tensor) -> float:
    return float((got - truth).norm() / truth.norm().clamp(min=1e-300))


def rounded(case: Case, dtype: torch.dtype) -> Case:
    """The case with its inputs rounded to ``dtype`` (as float64): the truth both computations are measured
    against, so only their arithmetic differs."""
    def cast(t):
        return t.to(dtype).double() if torch.is_tensor(t) and t.is_floating_point() else t

    return Case(cast(case.hidden), cast(case.weight), cast(case.bias), case.targets, case.steps, case.eos_index,
                case.eps, case.head)


def peaked_targets(case: Case, gen: torch.Generator) -> None:
    """Targets drawn from the softmax of the case's own logits (a trained model's rows), ignored ones kept."""
    z = case.hidden @ case.weight.T + (case.bias if case.bias is not None else 0.0)
    drawn = torch.multinomial(torch.softmax(z.reshape(-1, z.shape[-1]), -1), 1, generator=gen).view(z.shape[:-1])
    case.targets.copy_(torch.where(case.targets == -100, -100, drawn))


# float16 runs its products natively where the CPU has fp16 arithmetic, in float32 elsewhere: both ways on any CPU.
DTYPES = [torch.bfloat16, pytest.param(torch.float16, id="float16-native"),
          pytest.param(torch.float16, id="float16-in-float32")]


@pytest.fixture
def fp16_products(request, monkeypatch):
    """Pin the float16 product path the test's id names."""
    name = request.node.callspec.id
    if "float16-" in name:
        monkeypatch.setattr(nmst_fast.loss, "cpu_has_fp16_arithmetic", lambda: "float16-native" in name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head", ["nmst", "st", "va"])
@pytest.mark.parametrize("rows, logit_scale", [("flat", 1.0), ("peaked", 8.0)])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("chunk_size", [97, None])  # 7 chunks of dW summed; one chunk (bf16: dW of one GEMM)
def test_chunked_gradients_are_no_worse_than_the_materialized_ones(dtype, head, rows, logit_scale, softcap,
                                                                     chunk_size, fp16_products):
    seed = torch.seed() % 2**31  # fresh every run; printed on failure
    gen = torch.Generator().manual_seed(seed)
    case = make_case(gen, head=head, shape=(6, 100), H=64, V=3001, bias=True, logit_scale=logit_scale, eps=0.05)
    if rows == "peaked":
        peaked_targets(case, gen)
    kwargs = dict(softcap=softcap) if softcap else {}
    ours = run(case, "chunked", dtype, chunk_size=chunk_size, **kwargs)
    materialized = run(case, "reference", dtype, **kwargs)
    truth = run(rounded(case, dtype), "reference", torch.float64, **kwargs)
    # The loss, one number rounded to the dtype at the end: within one unit in the last place of the materialized
    # one's error (the two round a value within float32's error of each other: near a midpoint, to either side).
    ulp = torch.finfo(dtype).eps
    assert (ours[0] - truth[0]).abs() <= (materialized[0] - truth[0]).abs() + ulp * truth[0].abs(), f"seed={seed}"
    # Flat rows: the gradients' error is their own arithmetic's, and the chunks' sum is no worse (measured: at
    # most 0.92× the materialized error on dh and dW, 1.00× on db, over 300 seeded cases). Peaked rows: the error is
    # the logits' own rounding to the dtype (3% in bf16 at logits of 10-20), which both computations share up to
    # their GEMMs' summation order: within 10% of each other (measured: at most 1.04×, db).
    factor = 1.02 if rows == "flat" else 1.10
    for name, got, plain, want in zip(("dh", "dW", "db"), ours[1:], materialized[1:], truth[1:]):
        assert relative_error(got, want) <= factor * relative_error(plain, want), (
            f"seed={seed} {name}: {relative_error(got, want):.3e} against materialized "
            f"{relative_error(plain, want):.3e}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dw_products_in_vocabulary_blocks_sum_to_the_whole(dtype, monkeypatch):
    """A low-precision dW is multiplied in blocks of DW_BLOCK_ROWS vocabulary rows (float32 in one product): at a
    block of 7 rows the gradients equal the one-block computation's."""
    gen = torch.Generator().manual_seed(3)
    case = make_case(gen, head="nmst", shape=(3, 20), H=16, V=50, bias=True, eps=0.05)
    whole = run(case, "chunked", dtype, chunk_size=9)
    monkeypatch.setattr(fused, "DW_BLOCK_ROWS", 7)
    blocks = run(case, "chunked", dtype, chunk_size=9)
    for a, b in zip(whole, blocks):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_one_chunk_of_bf16_forms_dw_without_an_accumulator(reduction):
    """Where every row fits one chunk, a bf16 weight's dW is one bf16 GEMM (no float32 V × H accumulator) and
    "mean"'s 1/N is in the forward's gradients: any upstream gradient still scales all three, and a second
    backward through the same graph gives the same gradients."""
    from nmst_fast.fused import default_chunk_rows, direct_dw

    gen = torch.Generator().manual_seed(9)
    case = make_case(gen, head="nmst", shape=(4, 30), H=32, V=701, bias=True, logit_scale=3.0)
    N, V, H = 120, 701, 32
    rows = default_chunk_rows(N, V, torch.bfloat16, torch.device("cpu"), accumulator_bytes=V * H * 4)
    assert rows == N and direct_dw(N, rows, torch.bfloat16, torch.device("cpu"), None)
    grad_out = torch.tensor(-1.7)
    fast = run(case, "chunked", torch.bfloat16, reduction=reduction, grad_out=grad_out)
    naive = run(case, "reference", torch.bfloat16, reduction=reduction, grad_out=grad_out)
    truth = run(rounded(case, torch.bfloat16), "reference", torch.float64, reduction=reduction, grad_out=grad_out)
    for name, got, plain, want in zip(("dh", "dW", "db"), fast[1:], naive[1:], truth[1:]):
        assert relative_error(got, want) <= 1.10 * relative_error(plain, want), name
    leaves = [t.to(torch.bfloat16).requires_grad_() for t in (case.hidden, case.weight, case.bias)]
    loss = nmst_fast.linear_nmst_loss(leaves[0], leaves[1], case.targets, eos_index=case.eos_index, eps=case.eps,
                                      steps=case.steps, bias=leaves[2], reduction=reduction)
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(loss, leaves)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dw_dtype", [None, torch.float16])
def test_float16_products_keep_the_inputs_dtypes(native, dw_dtype, monkeypatch):
    """Products in float32 (a CPU without fp16 arithmetic) or in float16: the loss, dh, dW and db come back in
    float16 either way, and the float32 products' gradients are the float64 reference's rounded (dw_dtype, a
    float16 accumulator, has nothing to choose there)."""
    monkeypatch.setattr(nmst_fast.loss, "cpu_has_fp16_arithmetic", lambda: native)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = make_case(gen, head="nmst", shape=(3, 40), H=32, V=517, bias=True, eps=0.05)
    leaves = [t.to(torch.float16).requires_grad_() for t in (case.hidden, case.weight, case.bias)]
    loss = nmst_fast.linear_nmst_loss(leaves[0], leaves[1], case.targets, bias=leaves[2], eos_index=case.eos_index,
                                      eps=case.eps, impl="chunked", chunk_size=37, dw_dtype=dw_dtype)
    loss.backward()
    assert loss.dtype == torch.float16 and all(t.grad.dtype == torch.float16 for t in leaves)
    options = nmst_fast.loss._Options(head="nmst", eps=case.eps, eos_index=case.eos_index, ignore_index=-100,
                                      reduction="mean", chunk_size=None, softcap=None, logit_scale=None,
                                      temperature=1.0, dw_dtype=dw_dtype, grad_filter=None, vocab_size=517,
                                      group=None, vocab_start=0)
    *products, used = nmst_fast.loss._product_dtype_inputs(*leaves, options)
    assert [t.dtype for t in products] == [torch.float16 if native else torch.float32] * 3
    assert used.dw_dtype == (dw_dtype if native else None)
    truth = run(rounded(case, torch.float16), "reference", torch.float64)
    tolerance = 2e-3 if native else 1e-3  # float16's half ulp, plus the native products' own rounding
    for got, want in zip([loss.detach()] + [t.grad for t in leaves], truth):
        assert relative_error(got.double(), want) <= tolerance


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("chunk_size", [97, 600, None])
def test_the_chunk_loop_reads_only_what_it_wrote(dtype, chunk_size, monkeypatch):
    """Every tensor the fused path allocates with torch.empty starts as NaN: a GEMM or kernel reading memory it
    was not given (oneDNN's bf16 GEMMs read past K in an A operand whose row stride exceeds K, torch 2.13, where a
    padded chunk was tried) leaks NaN into the loss or the gradients."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = make_case(gen, head="nmst", shape=(6, 100), H=64, V=3001, bias=True, eps=0.05)
    want = run(case, "reference", torch.float64)
    monkeypatch.setattr(torch, "empty", nan_empty)
    got = run(case, "chunked", dtype, chunk_size=chunk_size)
    monkeypatch.undo()
    for name, g, w in zip(("loss", "dh", "dW", "db"), got, want):
        assert bool(torch.isfinite(g).all()), name
        assert relative_error(g, w) < 0.05, name


@pytest.mark.parametrize("N", [1, 31, 4096, 4097, 100_003])
@pytest.mark.parametrize("V", [3001, 50257, 256000])
def test_chunks_of_several_hold_whole_cache_lines_of_tokens(N, V):
    """Several chunks: each a multiple of LANE_ALIGN rows, within the byte budget, balanced (the last no thinner
    than needed); one chunk: all the rows."""
    for dtype in (torch.bfloat16, torch.float32):
        rows = fused.default_chunk_rows(N, V, dtype, torch.device("cpu"), accumulator_bytes=V * 768 * 4)
        chunks = -(-N // rows)
        if chunks > 1:
            budget = fused.chunk_budget(torch.device("cpu"), V * 768 * 4)
            assert rows % fused.LANE_ALIGN == 0 and rows * V * dtype.itemsize <= budget
            assert N - (chunks - 1) * rows > 0
        else:
            assert rows == N


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("chunk_size", [97, None])
def test_dh_from_the_transposed_weight_or_the_weight(transposed, chunk_size, monkeypatch):
    """dh's bf16 GEMM from a contiguous Wᵀ (what AMX CPUs take) or from W (the others), on any CPU: both no further
    from float64 than the materialized bf16 backward."""
    monkeypatch.setattr(fused, "dh_from_transposed_weight", lambda weight: transposed)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = make_case(gen, head="nmst", shape=(6, 100), H=64, V=3001, bias=True, eps=0.05)
    ours = run(case, "chunked", torch.bfloat16, chunk_size=chunk_size)
    materialized = run(case, "reference", torch.bfloat16)
    truth = run(rounded(case, torch.bfloat16), "reference", torch.float64)
    assert relative_error(ours[1], truth[1]) <= 1.02 * relative_error(materialized[1], truth[1])


@pytest.mark.parametrize("V,H", [(1, 37), (15, 16), (16, 15), (63, 48), (65, 37), (3 * 64 + 7, 2 * 16 + 5), (300, 1),
                                 (1100, 1001)])  # the last: 2.2 MB, in huge pages
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernels", [True, False])
def test_the_blocked_transpose_is_the_transpose(V, H, dtype, kernels, monkeypatch):
    """Wᵀ by the kernels' 16 x 16 blocks in stretches of 64 rows, or by torch's copies of 128-row blocks where the
    kernels are not built, V and H not multiples of them: every entry in place, bit for bit (NaN payloads and signed
    zeros included)."""
    assert fused.row_kernels() is not None, "the CPU row kernels did not build"
    if not kernels:
        monkeypatch.setattr(fused, "row_kernels", lambda: None)
    weight = torch.randn(V, H).to(dtype)
    weight.view(-1)[::7] = -0.0
    bits = weight.view(torch.int16)
    bits.view(-1)[3::11] = 0x7FC1  # NaNs with a payload
    out = fused.transposed_weight(weight)
    assert out.is_contiguous() and out.shape == (H, V) and torch.equal(out.view(torch.int16), bits.t())
