"""bf16 and fp16 on the CPU backend: the fused loss's gradients are no further from float64 than the materialized
computation's in the same dtype (autograd through the (N, V) logits in that dtype, ``impl="reference"``), although
they are summed over many chunks: dW adds each chunk's product, rounded once to the dtype, in float32, and the row
pass leaves the terms that dominate a row out of those products (row_ops.CpuRowOps). Flat rows (random targets at
small logits, where the one-hot terms dominate the gradient) and peaked ones (targets drawn from the model's own
distribution at large logits), every head, a bias, a softcap."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head", ["nmst", "st", "va"])
@pytest.mark.parametrize("rows, logit_scale", [("flat", 1.0), ("peaked", 8.0)])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_chunked_gradients_are_no_worse_than_the_materialized_ones(dtype, head, rows, logit_scale, softcap):
    seed = torch.seed() % 2**31  # fresh every run; printed on failure
    gen = torch.Generator().manual_seed(seed)
    case = make_case(gen, head=head, shape=(6, 100), H=64, V=3001, bias=True, logit_scale=logit_scale, eps=0.05)
    if rows == "peaked":
        peaked_targets(case, gen)
    kwargs = dict(softcap=softcap) if softcap else {}
    ours = run(case, "chunked", dtype, chunk_size=97, **kwargs)  # 7 chunks of dW summed
    materialized = run(case, "reference", dtype, **kwargs)
    truth = run(rounded(case, dtype), "reference", torch.float64, **kwargs)
    # The loss, one number rounded to the dtype at the end: within one rounding of the materialized one's error.
    unit = torch.finfo(dtype).eps / 2
    assert (ours[0] - truth[0]).abs() <= (materialized[0] - truth[0]).abs() + unit * truth[0].abs(), f"seed={seed}"
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
