"""The head's llama.cpp sampler (nmst_fast/kernels/cpu/llama_sampler.cpp) called as llama.cpp calls it, on
candidate records built here, against the float64 reference: NMST, ST and VA, temperatures, odd vocabularies, eos
anywhere, large t, tiny and large ε, extreme and non-finite logits; ST's running sum over steps; the failures it
keeps (NaN, no distribution, candidates that are not the whole row) with the candidates left as they were; the draw
from the context's logits row (``nmst_head_sampler_sample``, with llama.h's functions stood in for here) equals the
draw through the records."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch

from nmst_fast.decoding import step_log_probs
from nmst_fast.decoding.eos_column import MAX_EOS_LOGIT_GAP
from nmst_fast.kernels.cpu.llama_sampler import (
    LlamaCalls,
    SamplerState,
    apply_address,
    make_state,
    name_address,
    sample_function,
    state_error,
)

RECORD = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])  # llama_token_data


class TokenDataArray(ctypes.Structure):  # llama_token_data_array
    _fields_ = [("data", ctypes.c_void_p), ("size", ctypes.c_size_t), ("selected", ctypes.c_int64),
                ("sorted", ctypes.c_bool)]


class Sampler(ctypes.Structure):  # llama_sampler
    _fields_ = [("iface", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


APPLY = ctypes.CFUNCTYPE(None, ctypes.POINTER(Sampler), ctypes.POINTER(TokenDataArray))


def sampler_apply():
    address = apply_address()
    assert address is not None, "the CPU kernels did not build (see the warning logged above)"
    return APPLY(address)


def apply(state: SamplerState, logits: np.ndarray, *, ids=None, sorted_=False) -> np.ndarray:
    """One llama.cpp step: the records of ``logits`` (V,) float32 in token order (``ids``: others) through the
    sampler; returns the records' logits after it."""
    records = np.zeros(len(logits), dtype=RECORD)
    records["id"] = np.arange(len(logits)) if ids is None else ids
    records["logit"] = logits
    candidates = TokenDataArray(records.ctypes.data, len(records), -1, sorted_)
    sampler = Sampler(None, ctypes.cast(ctypes.pointer(state), ctypes.c_void_p))
    sampler_apply()(ctypes.byref(sampler), ctypes.byref(candidates))
    return records["logit"].copy()


def check_step(out: np.ndarray, logits: np.ndarray, head: str, eps: float, eos: int, t: int, temperature: float,
               state=None):
    """softmax of the sampler's row equals the head's step distribution at temperature T (float64 reference)."""
    want, after = step_log_probs(torch.from_numpy(logits).double()[None], head=head, eos_index=eos, eps=eps,
                                 steps=t, state=state, temperature=temperature)
    got = torch.log_softmax(torch.from_numpy(out).double(), dim=0)
    finite = want[0] > -700  # beyond: probabilities below float64's range, compared as zero
    # the eos entry is a float32 logit: rounded to an ulp of the row's magnitude (2^-24 relative, twice over)
    atol = 2e-5 + 2 * 2.0**-24 * float(np.abs(logits[np.isfinite(logits)]).max())
    torch.testing.assert_close(got[finite], want[0][finite], atol=atol, rtol=1e-5)
    assert (got[~finite].exp() < 1e-30).all()
    return after


@pytest.mark.parametrize("head", ["nmst", "st", "va"])
@pytest.mark.parametrize("V,eos", [(2, 0), (3, 2), (37, 5), (1000, 999), (32001, 0), (50257, 50256)])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7])
def test_one_step_is_the_heads_tempered_distribution(head, V, eos, temperature):
    rng = np.random.default_rng([V, eos, int(temperature * 10)])
    eps = 0.05
    for t in (1, 2, 9):
        logits = (rng.standard_normal(V) * 4).astype(np.float32)
        state = make_state(head, eps, eos, V, MAX_EOS_LOGIT_GAP)
        state.temperature, state.step = temperature, t
        out = apply(state, logits)
        assert state_error(state) is None and state.step == t + 1
        check_step(out, logits, head, eps, eos, t, temperature)


@pytest.mark.parametrize("eps", [1e-9, 1e-5, 0.5])
@pytest.mark.parametrize("t", [1, 100, 10**6])
@pytest.mark.parametrize("offset", [0.0, 1e4, -1e4])
def test_large_t_tiny_and_large_eps_and_extreme_logits(eps, t, offset):
    rng = np.random.default_rng([int(-math.log10(eps)), t, int(offset + 1e4)])
    V, eos = 4099, 17
    logits = (rng.standard_normal(V) * 30 + offset).astype(np.float32)
    logits[eos] = offset + 60.0 * (t % 2) - 30.0
    state = make_state("nmst", eps, eos, V, MAX_EOS_LOGIT_GAP)
    state.step = t
    out = apply(state, logits)
    assert state_error(state) is None
    check_step(out, logits, "nmst", eps, eos, t, 1.0)


def test_st_keeps_its_running_sum_over_the_steps():
    rng = np.random.default_rng(5)
    V, eos, eps = 301, 300, 1e-3
    state = make_state("st", eps, eos, V, MAX_EOS_LOGIT_GAP)
    state.temperature = 0.8
    reference_state = None
    for t in range(1, 12):
        logits = (rng.standard_normal(V) * 3).astype(np.float32)
        logits[eos] += 2.0
        out = apply(state, logits)
        reference_state = check_step(out, logits, "st", eps, eos, t, 0.8, reference_state)
        assert math.isclose(state.st_sum, float(reference_state[0]), rel_tol=1e-12, abs_tol=1e-12)
    assert state.step == 12


def test_banned_tokens_and_a_certain_eos():
    V, eos = 500, 3
    logits = np.random.default_rng(1).standard_normal(V).astype(np.float32)
    logits[100:] = -np.inf  # banned: the head renormalises over the rest
    state = make_state("nmst", 0.1, eos, V, MAX_EOS_LOGIT_GAP)
    check_step(apply(state, logits), logits, "nmst", 0.1, eos, 1, 1.0)
    only_eos = np.full(V, -np.inf, dtype=np.float32)
    only_eos[eos] = 2.0  # no other finite logit: the row keeps its logits, eos is certain
    state = make_state("nmst", 0.1, eos, V, MAX_EOS_LOGIT_GAP)
    out = apply(state, only_eos)
    assert state_error(state) is None and np.array_equal(out, only_eos)


@pytest.mark.parametrize("head", ["nmst", "st", "va"])
def test_failures_are_kept_and_leave_the_candidates_as_they_were(head):
    V, eos = 64, 7
    cases = {
        "hold NaN": lambda x: x.__setitem__(40, np.nan),
        "give no distribution": lambda x: x.__setitem__(slice(None), -np.inf),
    }
    if head != "va":
        cases["hold NaN (eos)"] = lambda x: x.__setitem__(eos, np.nan)
    for message, spoil in cases.items():
        logits = np.random.default_rng(2).standard_normal(V).astype(np.float32)
        spoil(logits)
        state = make_state(head, 0.05, eos, V, MAX_EOS_LOGIT_GAP)
        state.step, state.temperature = 4, 0.5
        out = apply(state, logits)
        assert np.array_equal(out, logits, equal_nan=True) and state.step == 4
        assert f"step t=4 {message.split(' (')[0]}" in str(state_error(state))
        healthy = np.zeros(V, dtype=np.float32)
        assert np.array_equal(apply(state, healthy), healthy)  # nothing done until the state is reset
    V = 10
    for kwargs, size in [(dict(ids=np.arange(V)[::-1].copy()), V), (dict(sorted_=True), V), ({}, V + 1)]:
        state = make_state(head, 0.05, 3, size, MAX_EOS_LOGIT_GAP)
        logits = np.arange(V, dtype=np.float32)
        assert np.array_equal(apply(state, logits, **kwargs), logits)
        assert "not the model's whole row" in str(state_error(state))


def test_an_eos_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="eos_token_id 10 is outside the vocabulary of 10"):
        make_state("nmst", 0.1, 10, 10, MAX_EOS_LOGIT_GAP)


def test_the_sampler_names_itself():
    name = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)(name_address())
    assert name(None) == b"nmst-head"


def drawing_state(head: str, V: int, eos: int, *, top_k=0, cut=2.0, min_p=0.0, temperature=1.0, seed=7):
    state = make_state(head, 1e-3, eos, V, MAX_EOS_LOGIT_GAP)
    state.draw, state.top_k, state.cut, state.min_p = 1, top_k, cut, min_p
    state.temperature, state.rng = temperature, seed
    return state


def draw_through_records(state: SamplerState, logits: np.ndarray) -> int:
    records = np.zeros(len(logits), dtype=RECORD)
    records["id"], records["logit"] = np.arange(len(logits)), logits
    candidates = TokenDataArray(records.ctypes.data, len(records), -1, False)
    sampler = Sampler(None, ctypes.cast(ctypes.pointer(state), ctypes.c_void_p))
    sampler_apply()(ctypes.byref(sampler), ctypes.byref(candidates))
    return candidates.selected


class FakeContext:
    """llama.h's functions over one logits row (``row``; None: llama.cpp has none) and a backend sampler's results
    (``sampled``: "token", "logits" or "probs"), with the tokens the chain accepted."""

    def __init__(self, row, sampled=None):
        self.row, self.sampled, self.accepted, self.indices = row, sampled, [], []
        pointer = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)

        def logits_ith(context, idx):
            self.indices.append(idx)
            return None if self.row is None else self.row.ctypes.data

        def backend(kind):
            return lambda context, idx: self.row.ctypes.data if self.sampled == kind else None

        self._functions = [pointer(logits_ith),
                           ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32)(
                               lambda context, idx: 5 if self.sampled == "token" else -1),
                           pointer(backend("logits")), pointer(backend("probs")),
                           ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)(
                               lambda chain, token: self.accepted.append((chain, token)))]
        self.calls = LlamaCalls(*(ctypes.cast(f, ctypes.c_void_p).value for f in self._functions))

    def sample(self, state: SamplerState, idx: int = -1) -> int:
        sampler = Sampler(None, ctypes.cast(ctypes.pointer(state), ctypes.c_void_p))
        return sample_function()(ctypes.addressof(sampler), 1234, 5678, idx, ctypes.byref(self.calls))


@pytest.mark.parametrize("head", ["nmst", "st", "va"])
@pytest.mark.parametrize("V,eos,cuts", [(2, 1, {}), (37, 0, dict(top_k=1)), (1000, 500, dict(top_k=40, cut=0.9)),
                                        (32001, 32000, dict(top_k=40, cut=0.95 - 1e-6, min_p=0.05, temperature=0.8)),
                                        (4099, 17, dict(min_p=0.1, temperature=1.7))])
def test_the_draw_from_the_logits_row_is_the_draw_through_the_records(head, V, eos, cuts):
    rng = np.random.default_rng([V, eos])
    direct, through_records = drawing_state(head, V, eos, **cuts), drawing_state(head, V, eos, **cuts)
    for t in range(1, 30):
        logits = (rng.standard_normal(V) * 3).astype(np.float32)
        logits[eos] += 1.0
        context = FakeContext(logits)
        token = context.sample(direct, idx=-1)
        assert token == draw_through_records(through_records, logits)
        assert context.accepted == [(1234, token)] and context.indices == [-1]
        assert (direct.step, direct.st_sum, direct.rng) == (through_records.step, through_records.st_sum,
                                                            through_records.rng) and direct.step == t + 1
    assert state_error(direct) is None


def test_the_draw_from_the_logits_row_keeps_its_failures():
    V, eos = 64, 7
    cases = [(FakeContext(None), "no logits for the output the step at t=3 samples"),
             (FakeContext(np.full(V, np.nan, dtype=np.float32)), "logits at step t=3 hold NaN"),
             (FakeContext(np.full(V, -np.inf, dtype=np.float32)), "logits at step t=3 give no distribution")]
    cases += [(FakeContext(np.zeros(V, dtype=np.float32), sampled=kind), "not the model's whole row")
              for kind in ("token", "logits", "probs")]
    for context, message in cases:
        state = drawing_state("nmst", V, eos, top_k=40)
        state.step = 3
        assert context.sample(state) == 0 and context.accepted == [] and state.step == 3
        assert message in str(state_error(state))
        context.row, context.sampled = np.zeros(V, dtype=np.float32), None
        assert context.sample(state) == 0 and context.accepted == []  # nothing done until the state is reset
    state = drawing_state("nmst", V, eos)
    state.draw = 0  # a sampler that does not draw leaves the step to the chain's apply
    context = FakeContext(np.zeros(V, dtype=np.float32))
    assert context.sample(state) == 0 and context.accepted == [] and state.step == 1
