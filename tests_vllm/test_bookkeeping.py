"""The processor's request bookkeeping, driven by vLLM's own BatchUpdate records without an engine:
ST's running sum follows each request through adds, removes, one-way moves, swaps, a slot reused
without a removal, preemption and re-entry, and partial-prefill rows; settings checks that need no
engine (speculative decoding)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from head_reference import EOS, V, no_values_read, row_path
from head_reference import Reference as _Reference
from head_reference import engine_config as _config


@pytest.mark.parametrize("scalars", ["kernel", "host", "mixed", "device"])
def test_st_state_follows_requests_through_batch_changes(scalars, monkeypatch):
    """Every way of computing the head's scalars: in the CPU row kernel with the row pass (the CPU's
    where the kernel is built), and without it as floats (small groups), as CPU tensors with the sums
    kept as floats (large groups; "mixed" switches the size limit every step, so that each step's sums
    are made one way and read the other), and as tensors on the logits' device (every other device's;
    run here on CPU tensors)."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from nmst_fast.integrations.vllm import NMSTLogitsProcessor, persistent_batch

    kernel_calls = row_path(scalars == "kernel", monkeypatch)
    rng = random.Random(0)
    torch.manual_seed(0)
    processor = NMSTLogitsProcessor(_config(), torch.device("cpu"), False)
    assert processor.head.host_scalars  # the CPU's default
    processor.head.host_scalars = scalars != "device"
    ways = {"host": 0, "tensors": 0}
    if scalars == "mixed":
        for name, way in (("host_eos_value", "host"), ("device_eos_values", "tensors")):
            def counted(*args, _way=way, _function=getattr(persistent_batch, name)):
                ways[_way] += 1
                return _function(*args)
            monkeypatch.setattr(persistent_batch, name, counted)
    requests = []
    for i in range(6):
        head = "st" if i % 2 == 0 else "nmst"
        params = SamplingParams(temperature=[0.0, 0.7, 1.5][i % 3],
                                extra_args={"nmst_head": head, "nmst_eps": 0.01, "nmst_eos_token_id": EOS})
        requests.append(_Reference(params, head, 0.01))
    slots: list = [None] * 6  # batch index -> request
    waiting = list(requests)

    def add(index, request):
        slots[index] = request
        return (index, request.params, None, request.output)

    checked = 0
    for step in range(40):
        if scalars == "mixed":
            monkeypatch.setattr(persistent_batch, "HOST_SCALAR_ROWS", [0, 6][step % 2])
        removed, added, moved = [], [], []
        # Requests leave (preemption / not scheduled) and re-enter; a slot may be reused without a removal.
        if step % 5 == 3:
            live = [i for i, r in enumerate(slots) if r is not None]
            gone = rng.choice(live)
            waiting.append(slots[gone])
            slots[gone] = None
            if step % 10 == 3:
                removed.append(gone)  # listed; otherwise the slot is just taken below
        for index in range(6):
            if slots[index] is None and waiting and (step < 2 or rng.random() < 0.7):
                added.append(add(index, waiting.pop(0)))
            elif step % 5 == 3 and index == 5 and waiting and slots[5] is not None:
                waiting.append(slots[5])  # slot 5 reused: its occupant leaves unlisted
                added.append(add(5, waiting.pop(0)))
        if step % 3 == 1:
            a, b = rng.sample(range(6), 2)
            if slots[a] is not None and slots[b] is not None:
                slots[a], slots[b] = slots[b], slots[a]
                moved.append((a, b, MoveDirectionality.SWAP))
            elif slots[a] is not None:
                slots[b], slots[a] = slots[a], None
                moved.append((a, b, MoveDirectionality.UNIDIRECTIONAL))
        processor.update_state(BatchUpdate(batch_size=6, removed=removed, added=added, moved=moved)
                               if removed or added or moved else None)
        # A partial prefill first: the row passes through apply on logits that are then discarded.
        for partial in (True, False):
            logits = torch.randn(6, V) * 3
            before = logits.clone()
            out = processor.apply(logits)
            for index, request in enumerate(slots):
                if request is None:
                    continue
                assert torch.equal(out[index, :EOS], before[index, :EOS]) and \
                    torch.equal(out[index, EOS + 1:], before[index, EOS + 1:])
                if partial and request.output:
                    continue
                value, state = request.expected(before[index])
                assert math.isclose(float(out[index, EOS]), value, rel_tol=1e-5, abs_tol=1e-4), (step, index)
                checked += 1
                if not partial:
                    request.state = state
        for request in slots:
            if request is not None:
                request.output.append(rng.randrange(V))
    assert checked > 150
    assert ("write_eos_column" in kernel_calls) == (scalars == "kernel")
    if scalars == "mixed":
        assert ways["host"] > 100 and ways["tensors"] > 50, ways


def test_rows_without_a_head_are_untouched_and_cost_no_copy():
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from nmst_fast.integrations.vllm import NMSTLogitsProcessor

    processor = NMSTLogitsProcessor(_config(), torch.device("cpu"), False)
    processor.update_state(BatchUpdate(batch_size=2, removed=[], moved=[],
                                       added=[(0, SamplingParams(), None, []), (1, SamplingParams(), None, [])]))
    logits = torch.randn(2, V)
    before = logits.clone()
    assert processor.apply(logits) is logits and torch.equal(logits, before)
    assert processor.head.rows == {}


def test_second_instance_of_one_engine_stays_idle():
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from nmst_fast.integrations.vllm import NMSTLogitsProcessor

    config = _config({"head": "nmst", "eps": 0.1, "context_length": None, "eos_token_id": EOS})
    first = NMSTLogitsProcessor(config, torch.device("cpu"), False)
    second = NMSTLogitsProcessor(config, torch.device("cpu"), False)
    update = BatchUpdate(batch_size=1, removed=[], moved=[], added=[(0, SamplingParams(), None, [])])
    first.update_state(update)
    second.update_state(update)
    logits = torch.randn(1, V)
    once = first.apply(logits.clone())
    assert torch.equal(second.apply(once.clone()), once)
    assert not torch.equal(once, logits)


def test_speculative_decoding_is_refused():
    from vllm import SamplingParams

    from nmst_fast.integrations.vllm import NMSTLogitsProcessor, request_settings
    from nmst_fast.integrations.vllm.settings import ModelInfo

    recorded = {"head": "nmst", "eps": 0.1, "context_length": None, "eos_token_id": EOS}
    with pytest.raises(ValueError, match="speculative"):  # a model-wide head: the engine does not start
        NMSTLogitsProcessor(_config(recorded, speculative=object()), torch.device("cpu"), False)
    NMSTLogitsProcessor(_config(speculative=object()), torch.device("cpu"), False)  # a plain model starts
    model = ModelInfo({"head": "nmst", "eps": 0.1}, EOS, V, speculative=True)
    with pytest.raises(ValueError, match="speculative"):
        request_settings(SamplingParams(), model)
    # A plain request on a plain model is not the processor's business, speculative or not.
    assert request_settings(SamplingParams(), ModelInfo({}, EOS, V, speculative=True)) is None


def test_model_wide_settings_and_their_refusals():
    from vllm import SamplingParams

    from nmst_fast.integrations.vllm import HeadSettings, request_settings
    from nmst_fast.integrations.vllm.settings import ModelInfo

    st_model = ModelInfo({"head": "st", "eps": 0.1, "context_length": None, "eos_token_id": EOS}, EOS, V)
    assert request_settings(SamplingParams(), st_model) == HeadSettings("st", 0.1, EOS)
    with pytest.raises(ValueError, match="min_tokens"):  # a model-wide ST head refuses bans too
        request_settings(SamplingParams(min_tokens=2), st_model)
    assert request_settings(SamplingParams(min_tokens=2, extra_args={"nmst_head": "nmst"}), st_model) == \
        HeadSettings("nmst", 0.1, EOS)
    assert request_settings(SamplingParams(extra_args={"nmst_head": "va"}), st_model) is None
    plain = ModelInfo({}, None, V)  # a plain model whose config names several eos ids
    with pytest.raises(ValueError, match="nmst_eos_token_id"):
        request_settings(SamplingParams(extra_args={"nmst_head": "nmst"}), plain)
    with pytest.raises(ValueError, match="without nmst_head"):
        request_settings(SamplingParams(extra_args={"nmst_eps": 0.1}), plain)


def test_the_device_path_reads_nothing_back():
    """Off the CPU the step computes the head's scalars on the device: no op that reads a tensor's values
    on the host (a device-to-host sync on a GPU) and no tolist / numpy, over NMST and ST rows, greedy and
    tempered, through several steps and a banned eos; the eos column equals the host path's."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from nmst_fast.integrations.vllm import NMSTLogitsProcessor

    processors = [NMSTLogitsProcessor(_config(), torch.device("cpu"), False) for _ in range(2)]
    processors[1].head.host_scalars = False
    outputs = [[] for _ in range(4)]
    added = [(i, SamplingParams(temperature=[0.0, 0.7][i % 2],
                                extra_args={"nmst_head": ["nmst", "st"][i // 2], "nmst_eps": 0.01,
                                            "nmst_eos_token_id": EOS}), None, outputs[i]) for i in range(4)]
    for processor in processors:
        processor.update_state(BatchUpdate(batch_size=4, removed=[], moved=[], added=added))
    reads = []
    torch.manual_seed(1)
    for step in range(5):
        logits = torch.randn(4, V) * 3
        if step == 2:
            logits[3, EOS] = -math.inf  # an ST row with eos banned: unchanged, its sum skips the step
        host = processors[0].apply(logits.clone())
        with no_values_read() as step_reads:
            device = processors[1].apply(logits.clone())
        reads += step_reads
        torch.testing.assert_close(device, host, rtol=1e-6, atol=1e-5)
        assert host[3, EOS] == -math.inf if step == 2 else torch.isfinite(host[:, EOS]).all()
        for output in outputs:
            output.append(1)
    assert reads == []


@pytest.mark.parametrize("scalars", ["kernel", "host", "tensors", "device"])
def test_rows_without_a_distribution_keep_their_logits(scalars, monkeypatch):
    """A row with a NaN logit (eos or not), a +inf logit, no finite non-eos logit (eos then certain) or
    eos banned by another control keeps its logits, eos column included, in every way of computing the scalars,
    and ST's running sum skips that step; the rows beside them are not disturbed."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from nmst_fast.integrations.vllm import NMSTLogitsProcessor, persistent_batch

    kernel_calls = row_path(scalars == "kernel", monkeypatch)
    processor = NMSTLogitsProcessor(_config(), torch.device("cpu"), False)
    processor.head.host_scalars = scalars != "device"
    if scalars == "tensors":
        monkeypatch.setattr(persistent_batch, "HOST_SCALAR_ROWS", 0)
    requests = [_Reference(SamplingParams(temperature=[0.0, 0.7][i % 2],
                                          extra_args={"nmst_head": ["st", "nmst"][i // 6], "nmst_eps": 0.05,
                                                      "nmst_eos_token_id": EOS}), ["st", "nmst"][i // 6], 0.05)
                for i in range(12)]
    processor.update_state(BatchUpdate(batch_size=12, removed=[], moved=[],
                                       added=[(i, r.params, None, r.output) for i, r in enumerate(requests)]))
    torch.manual_seed(2)
    for step in range(4):
        logits = torch.randn(12, V) * 3
        if step == 1:  # rows 0-4 (ST) and 6-10 (NMST) have no distribution this step; rows 5 and 11 do
            for first in (0, 6):
                logits[first, 3] = math.nan
                logits[first + 1, 3] = math.inf
                logits[first + 2, :EOS] = logits[first + 2, EOS + 1:] = -math.inf
                logits[first + 3, EOS] = -math.inf
                logits[first + 4, EOS] = math.nan
        before = logits.clone()
        out = processor.apply(logits)
        for index, request in enumerate(requests):
            if step == 1 and index % 6 != 5:
                torch.testing.assert_close(out[index], before[index], rtol=0, atol=0, equal_nan=True)
            else:
                value, request.state = request.expected(before[index])
                assert math.isclose(float(out[index, EOS]), value, rel_tol=1e-5, abs_tol=1e-4), (step, index)
            request.output.append(1)
    assert ("write_eos_column" in kernel_calls) == (scalars == "kernel")


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_that_are_not_the_heads_are_refused(mode, caplog):
    """Admission (validate_params, the engine's config held by its caller as vLLM's InputProcessor holds
    it) under every logprobs_mode: under a head (model-wide or per request) prompt log-probs are refused
    always, sampled-token log-probs under the raw modes, each with the fix; "va" requests, plain models
    and requests without log-probs are admitted. A request that reached the runner anyway is logged."""
    from vllm import SamplingParams

    from nmst_fast.integrations.vllm import NMSTLogitsProcessor

    recorded = {"head": "nmst", "eps": 0.1, "context_length": None, "eos_token_id": EOS}
    nmst = {"nmst_head": "nmst", "nmst_eps": 0.1, "nmst_eos_token_id": EOS}
    st = {"nmst_head": "st", "nmst_eps": 0.1, "nmst_eos_token_id": EOS}

    class Frontend:  # what vLLM's InputProcessor holds when it runs validate_params
        def __init__(self, model_recorded):
            self.vllm_config = _config(model_recorded, logprobs_mode=mode)

        def admit(self, **params):
            NMSTLogitsProcessor.validate_params(SamplingParams(**params))

    raw = mode.startswith("raw")
    for frontend, head in ((Frontend(recorded), None), (Frontend(None), nmst), (Frontend(recorded), st)):
        extra = {"extra_args": head} if head else {}
        frontend.admit(**extra)
        frontend.admit(logprobs=2, extra_args={"nmst_head": "va"}, prompt_logprobs=1)
        for asked in (dict(prompt_logprobs=0), dict(prompt_logprobs=3, logprobs=2)):
            with pytest.raises(ValueError, match="prompt_logprobs would be the model's plain softmax.*nmst_head='va'"):
                frontend.admit(**asked, **extra)
        for asked in (dict(logprobs=0), dict(logprobs=5), dict(logprob_token_ids=[1, 2])):
            if raw:
                with pytest.raises(ValueError, match=f"logprobs_mode='{mode}'.*--logprobs-mode processed_logprobs"):
                    frontend.admit(**asked, **extra)
            else:
                frontend.admit(**asked, **extra)
    Frontend(None).admit(logprobs=2, prompt_logprobs=2)  # a plain model: vLLM's own log-probs
    with pytest.raises(ValueError, match="prompt_logprobs"):  # no engine config found: the request's head alone
        NMSTLogitsProcessor.validate_params(SamplingParams(prompt_logprobs=1, extra_args=nmst))

    # In the runner (admission bypassed): the request decodes its head, and its log-probs are logged as not the head's.
    from vllm.v1.sample.logits_processor import BatchUpdate

    caplog.clear()
    with caplog.at_level("WARNING", logger="nmst_fast.integrations.vllm"):  # a model-wide head starts, with a warning
        NMSTLogitsProcessor(_config(recorded, logprobs_mode=mode), torch.device("cpu"), False)
    assert ("requests for log-probs are refused" in caplog.text) is raw
    processor = NMSTLogitsProcessor(_config(logprobs_mode=mode), torch.device("cpu"), False)
    caplog.clear()
    with caplog.at_level("ERROR", logger="nmst_fast.integrations.vllm"):
        params = SamplingParams(logprobs=1, extra_args=nmst)
        processor.update_state(BatchUpdate(batch_size=1, removed=[], added=[(0, params, None, [])], moved=[]))
    assert 0 in processor.head.rows
    assert ("admission did not refuse" in caplog.text) is raw
