"""The torch row pass (``row_ops.TorchRowOps``: CUDA's "chunked" backend, and the CPU's where the C++ kernels cannot
be built) against the float64 reference on CPU: the fused-loss tests of the chunked backend again, with the C++
kernels off."""

import pytest
import torch

from nmst_fast import fused, row_ops

import test_fused_loss as loss_tests
import test_softcap as softcap_tests


@pytest.fixture(autouse=True)
def torch_row_pass(monkeypatch):
    monkeypatch.setattr(fused, "row_kernels", lambda: None)
    assert isinstance(fused.row_ops_for("chunked", torch.device("cpu")), row_ops.TorchRowOps)


@pytest.mark.parametrize("head", loss_tests.HEADS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_random_shapes_fp32(head, reduction, bias):
    loss_tests.test_random_shapes_fp32("chunked", head, reduction, bias)


@pytest.mark.parametrize("head", loss_tests.HEADS)
def test_float64_is_exact(head):
    loss_tests.test_float64_is_exact("chunked", head)


@pytest.mark.parametrize("head", loss_tests.HEADS)
def test_bf16(head):
    loss_tests.test_bf16("chunked", head)


@pytest.mark.parametrize("head", loss_tests.HEADS)
def test_extreme_logits(head):
    loss_tests.test_extreme_logits("chunked", head)


def test_st_long_sequence_and_context():
    loss_tests.test_st_long_sequence_and_context("chunked")


@pytest.mark.parametrize("head", softcap_tests.HEADS)
@pytest.mark.parametrize("transform", softcap_tests.TRANSFORMS)
def test_softcap_matches_the_float64_expression(head, transform):
    softcap_tests.test_matches_the_float64_expression("chunked", head, transform)


def test_the_memory_bound_holds_with_a_softcap():
    softcap_tests.test_the_memory_bound_holds_with_a_softcap()
