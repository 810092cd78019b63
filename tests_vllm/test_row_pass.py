"""The processor's V-wide part (``tempered_non_eos_lse``) on both of its paths, the CPU row kernels and
torch ops (the path of other devices, and of a machine where the kernels do not build), against a
float64 reference; the processor's eos column the same on either path, and the kernel's head scalars
equal to the library's float formulas."""

from __future__ import annotations

import math

import pytest
import torch
from head_reference import EOS, Reference, V, row_path
from head_reference import engine_config as _config

from nmst_fast.decoding import eos_column


@pytest.fixture(params=["kernel", "torch ops"])
def row_pass(request, monkeypatch):
    """Which path the CPU takes: the row kernels (checked to be built and called) or torch ops."""
    calls = row_path(request.param == "kernel", monkeypatch)
    yield request.param
    assert bool(calls) == (request.param == "kernel")


def reference(rows: torch.Tensor, eos: int, temperatures) -> torch.Tensor:
    z = rows.double() / torch.tensor(temperatures, dtype=torch.float64)[:, None]
    return torch.logsumexp(torch.cat([z[:, :eos], z[:, eos + 1:]], dim=1), dim=1)


@pytest.mark.parametrize("width,eos", [(40, 7), (50257, 50256), (50257, 0), (128256, 128001)])
@pytest.mark.parametrize("offset", [0.0, 1e4, -1e4])
def test_the_row_pass_equals_float64(row_pass, width, eos, offset):
    gen = torch.Generator().manual_seed(width + eos)
    temperatures = [1.0, 0.7, 1.0, 0.05, 2.5, 1.0]
    rows = torch.randn(6, width, generator=gen) * 4 + offset
    rows[2, : width // 3] = -math.inf  # banned tokens
    for inverse in (None, eos_column.inverse_temperatures(temperatures, rows.device)):
        ts = [1.0] * 6 if inverse is None else temperatures
        got = eos_column.tempered_non_eos_lse(rows.clone(), eos, inverse)
        torch.testing.assert_close(got, reference(rows, eos, ts), atol=1e-5, rtol=1e-7)


def test_the_processor_writes_the_same_column_on_either_path(row_pass):
    """Both paths, every row type (greedy, tempered, NMST and ST) against the library's effective logits."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from nmst_fast.integrations.vllm import NMSTLogitsProcessor

    processor = NMSTLogitsProcessor(_config(), torch.device("cpu"), False)
    requests = [Reference(SamplingParams(temperature=[0.0, 0.7, 1.3][i % 3],
                                         extra_args={"nmst_head": ["nmst", "st"][i % 2], "nmst_eps": 0.05,
                                                     "nmst_eos_token_id": EOS}), ["nmst", "st"][i % 2], 0.05)
                for i in range(8)]
    processor.update_state(BatchUpdate(batch_size=8, removed=[], moved=[],
                                       added=[(i, r.params, None, r.output) for i, r in enumerate(requests)]))
    torch.manual_seed(4)
    for step in range(5):
        logits = torch.randn(8, V) * 3
        before = logits.clone()
        out = processor.apply(logits)
        for index, request in enumerate(requests):
            value, request.state = request.expected(before[index])
            assert math.isclose(float(out[index, EOS]), value, rel_tol=1e-6, abs_tol=1e-5), (step, index)
            request.output.append(1)
        torch.testing.assert_close(torch.cat([out[:, :EOS], out[:, EOS + 1:]], 1),
                                   torch.cat([before[:, :EOS], before[:, EOS + 1:]], 1), rtol=0, atol=0)


@pytest.mark.parametrize("head", ["nmst", "st"])
def test_the_kernels_eos_column_is_the_float_formulas(head):
    """write_eos_column against host_eos_value row by row on the kernel's own L_T (so only the head's
    scalars are compared), rows indexed in a shuffled table: every row type, context rows (t <= 0),
    large t, tiny and large ε, extreme and non-finite eos logits, rows without a distribution; equal to
    the last bit of the float32 column, and nothing else of the table written."""
    from nmst_fast.integrations.vllm.settings import HeadSettings

    kernels = eos_column.row_kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(11)
    A, width, eos = 40, 301, 17
    rows = torch.randn(A, width, generator=gen) * 5
    rows[:, eos] = torch.tensor([0.0, 30.0, -30.0, 200.0, -200.0, 1e4, -1e4, math.inf, -math.inf, math.nan] * 4)
    rows[5, :eos] = rows[5, eos + 1:] = -math.inf  # no finite non-eos logit
    rows[6, 40] = math.nan
    rows[7, 41] = math.inf
    temperatures = torch.tensor([1.0, 0.7, 0.05, 2.5] * 10, dtype=torch.float64)
    steps = torch.tensor([1, 2, 0, -3, 69315, 10**7, 5, 1] * 5)
    before = -torch.rand(A, generator=gen, dtype=torch.float64) * 3 if head == "st" else None
    for eps in (1e-9, 1e-5, 0.3, 0.999):
        settings = HeadSettings(head, eps, eos)
        order = torch.randperm(A, generator=gen)  # the group's rows in any order of the table's
        table = rows[order].clone()
        after = kernels.write_eos_column(table, torch.argsort(order), eos, temperatures, steps, before, eps,
                                         eos_column.MAX_EOS_LOGIT_GAP)
        values = table[torch.argsort(order)][:, eos]
        lse = kernels.non_eos_lse(rows, eos, 1.0 / temperatures)
        for a in range(A):
            T, t, s = float(temperatures[a]), int(steps[a]), float(rows[a, eos])
            value, state = eos_column.host_eos_value(settings, float(lse[a]), s, t, T,
                                                     float(before[a]) if head == "st" else 0.0)
            want = s if value is None else value
            assert float(values[a]) == float(torch.tensor(want, dtype=torch.float32)) or math.isnan(s) and \
                math.isnan(values[a]), a
            if head == "st":
                assert float(after[a]) == state, a
        assert after.shape == ((A,) if head == "st" else (0,))
        others = torch.ones(width, dtype=torch.bool)
        others[eos] = False  # only eos is written
        torch.testing.assert_close(table[torch.argsort(order)][:, others], rows[:, others], rtol=0, atol=0,
                                   equal_nan=True)
