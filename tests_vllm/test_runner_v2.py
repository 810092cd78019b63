"""The processor under vLLM's Model Runner V2 (GPU vLLM's default): vLLM's own loaders take the
installed plugin under both runners, and the V2 side, driven through vLLM's own ``LogitsContext`` and
``LogitsProcRequestState`` records without an engine (V2 needs Triton, which vLLM's CPU build lacks),
writes the head's eos column with t read from the device positions: through slot reuse, shuffled batch
order, chunked prefill, preemption and resumption, banned eos, greedy and tempered rows, with no value
read back; ST is refused at start and at admission."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from head_reference import EOS, Reference, V, engine_config, no_values_read

SLOTS = 8


def _req_states():
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState

    def buffer():
        cpu = torch.zeros(SLOTS, dtype=torch.int32)
        return SimpleNamespace(cpu=cpu, np=cpu.numpy(), gpu=cpu)  # vLLM's UvaBackedTensor: .np / .gpu views

    return LogitsProcRequestState(device=torch.device("cpu"), max_num_reqs=SLOTS, vocab_size=V, all_token_ids=None,
                                  prompt_len=buffer(), prefill_len=buffer(), total_len=None)


def _context(slots: list[int], positions: list[int]):
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

    idx = torch.tensor(slots, dtype=torch.int32)
    return LogitsContext(expanded_idx_mapping=idx, idx_mapping=idx, idx_mapping_np=np.array(slots, dtype=np.int32),
                         expanded_local_pos=torch.zeros(len(slots), dtype=torch.int32),
                         input_ids=torch.zeros(len(slots), dtype=torch.int32),
                         pos=torch.tensor(positions, dtype=torch.int64),
                         seq_lens_upper_bound_np=np.array(positions, dtype=np.int32) + 1)


def test_both_runners_load_the_installed_plugin():
    """vLLM's V1 and V2 plugin loaders both accept the entry point (V2 refuses V1-only classes, which
    would stop every engine of the environment), and V2's admission check runs the processor's."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.sample.logits_processor import _load_logitsprocs_plugins
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors_params_validator
    from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_plugins

    from nmst_fast.integrations.vllm import NMSTLogitsProcessor

    assert NMSTLogitsProcessor in _load_logitsprocs_plugins()
    assert NMSTLogitsProcessor in _load_v2_logitsprocs_plugins()
    validate = build_custom_logits_processors_params_validator(())
    validate(SamplingParams(extra_args={"nmst_head": "nmst", "nmst_eps": 0.1, "nmst_eos_token_id": EOS}))
    with pytest.raises(VLLMValidationError, match="nmst_eps"):
        validate(SamplingParams(extra_args={"nmst_head": "nmst", "nmst_eps": 1.5}))


def test_constructor_arguments_choose_the_runner():
    from nmst_fast.integrations.vllm import NMSTLogitsProcessor
    from nmst_fast.integrations.vllm.persistent_batch import PersistentBatchHead
    from nmst_fast.integrations.vllm.slots import SlotHead

    assert isinstance(NMSTLogitsProcessor(engine_config(), torch.device("cpu"), False).head, PersistentBatchHead)
    assert isinstance(NMSTLogitsProcessor(engine_config(runner_v2=True), _req_states()).head, SlotHead)
    with pytest.raises(TypeError, match="req_states"):
        NMSTLogitsProcessor(engine_config(), object())
    recorded = {"head": "nmst", "eps": 0.1, "context_length": None, "eos_token_id": EOS}
    with pytest.raises(ValueError, match="speculative"):
        NMSTLogitsProcessor(engine_config(recorded, speculative=object(), runner_v2=True), _req_states())
    # A plain model with a speculative config starts (installing the plugin stops no engine); a request
    # for the head is refused (at admission; here, if it got through, it decodes plain softmax).
    from vllm import SamplingParams

    plain = NMSTLogitsProcessor(engine_config(speculative=object(), runner_v2=True), _req_states())
    assert plain.add_request(0, SamplingParams(extra_args={"nmst_head": "nmst"})) is False


def test_st_is_refused_under_v2():
    """A model-wide ST head stops a V2 engine at start; a per-request one is refused at admission
    (the frontend's config says V2) and, if it got through, decodes plain softmax rather than a wrong ST."""
    from vllm import SamplingParams

    from nmst_fast.integrations.vllm import NMSTLogitsProcessor

    st = {"head": "st", "eps": 0.1, "context_length": None, "eos_token_id": EOS}
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        NMSTLogitsProcessor(engine_config(st, runner_v2=True), _req_states())
    NMSTLogitsProcessor(engine_config(st), torch.device("cpu"), False)  # V1 decodes it

    class Frontend:  # what vLLM's InputProcessor holds when it runs validate_params
        def __init__(self, runner_v2):
            self.vllm_config = engine_config(runner_v2=runner_v2)

        def admit(self, params):
            NMSTLogitsProcessor.validate_params(params)

    params = SamplingParams(extra_args={"nmst_head": "st", "nmst_eps": 0.1})
    Frontend(runner_v2=False).admit(params)
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        Frontend(runner_v2=True).admit(params)
    processor = NMSTLogitsProcessor(engine_config(runner_v2=True), _req_states())
    assert processor.add_request(0, params) is False


def test_unrefused_logprobs_are_logged_under_v2(caplog):
    """A request whose log-probs admission should have refused (raw_logprobs) that reaches a V2 slot anyway
    decodes its head, and is logged: its log-probs are not the head's. Under processed_logprobs nothing is."""
    from vllm import SamplingParams

    from nmst_fast.integrations.vllm import NMSTLogitsProcessor

    params = SamplingParams(logprobs=2, extra_args={"nmst_head": "nmst", "nmst_eps": 0.1, "nmst_eos_token_id": EOS})
    for mode, logged in (("processed_logprobs", False), ("raw_logprobs", True)):
        processor = NMSTLogitsProcessor(engine_config(runner_v2=True, logprobs_mode=mode), _req_states())
        caplog.clear()
        with caplog.at_level("ERROR", logger="nmst_fast.integrations.vllm"):
            assert processor.add_request(0, params)
        assert ("admission did not refuse" in caplog.text) is logged


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slots_follow_requests_through_a_v2_schedule(seed):
    """A simulated V2 schedule: requests of random prompt lengths (NMST with two ε, plain, and "va")
    take free slots, prefill in chunks of up to 4 tokens, decode in a shuffled batch order, finish,
    are preempted and resumed in another slot (prefill of prompt + output). Every row's non-eos logits
    are untouched, rows of other heads entirely, and every sampling row's eos equals the library's
    T·ζ_eos at t = (tokens generated) + 1. No op reads a tensor back."""
    from vllm import SamplingParams

    from nmst_fast.integrations.vllm import NMSTLogitsProcessor

    reads: list[str] = []
    rng = random.Random(seed)
    torch.manual_seed(seed)
    states = _req_states()
    processor = NMSTLogitsProcessor(engine_config(runner_v2=True), states)
    requests = []
    for i in range(20):
        kind = ["nmst", "nmst", "plain", "va"][i % 4]
        eps = [0.01, 0.2][i % 2]
        extra = {"plain": None, "va": {"nmst_head": "va"}}.get(
            kind, {"nmst_head": "nmst", "nmst_eps": eps, "nmst_eos_token_id": EOS})
        params = SamplingParams(temperature=[0.0, 0.7, 1.5][i % 3], extra_args=extra)
        request = Reference(params, "nmst", eps)
        request.kind, request.prompt, request.length = kind, rng.randint(3, 12), rng.randint(4, 12)
        request.resumed = False
        requests.append(request)
    waiting, running, free = list(requests), {}, list(range(SLOTS))
    checked = partial_rows = resumed_rows = 0
    for _ in range(200):
        if not waiting and not running:
            break
        while waiting and free and len(running) < 6:  # admit: a free slot, its prompt length, its prefill
            request, slot = waiting.pop(0), free.pop(rng.randrange(len(free)))
            states.prompt_len.np[slot] = request.prompt
            states.prefill_len.np[slot] = request.prompt + len(request.output)
            request.computed = 0
            assert processor.add_request(slot, request.params) is (request.kind == "nmst")
            running[slot] = request
        if len(running) > 2 and rng.random() < 0.3:  # preempt one: it comes back later in any slot
            slot = rng.choice(list(running))
            running[slot].resumed = bool(running[slot].output)
            waiting.append(running.pop(slot))
            free.append(slot)
        order = list(running)
        rng.shuffle(order)
        positions, real = [], []
        for slot in order:
            request = running[slot]
            prefill = request.prompt + len(request.output)
            if request.computed < prefill:  # a prefill chunk; the row samples only with the prompt's end
                request.computed = min(prefill, request.computed + rng.randint(1, 4))
                positions.append(request.computed - 1)
                real.append(request.computed == prefill)
            else:
                positions.append(prefill - 1)
                real.append(True)
        logits = torch.randn(len(order), V) * 3
        for k in range(len(order)):
            if rng.random() < 0.05:
                logits[k, EOS] = -math.inf  # eos banned by another control: it stays banned
        before = logits.clone()
        context = _context(order, positions)
        with no_values_read() as step_reads:
            out = processor.apply(logits, context)
        reads += step_reads
        for k, slot in enumerate(order):
            request = running[slot]
            if request.kind != "nmst":
                assert torch.equal(out[k], before[k])
                continue
            assert torch.equal(out[k, :EOS], before[k, :EOS]) and torch.equal(out[k, EOS + 1:], before[k, EOS + 1:])
            if not real[k]:
                partial_rows += 1
                continue
            if before[k, EOS] == -math.inf:
                assert out[k, EOS] == -math.inf
            else:
                value, _ = request.expected(before[k])
                assert math.isclose(float(out[k, EOS]), value, rel_tol=1e-5, abs_tol=1e-4), (slot, len(request.output))
                checked += 1
                resumed_rows += request.resumed
        for k, slot in enumerate(order):
            if real[k]:
                request = running[slot]
                request.output.append(rng.randrange(V))
                request.computed += 1
                if len(request.output) >= request.length:
                    del running[slot]
                    free.append(slot)
    assert not waiting and not running
    assert checked > 40 and partial_rows > 10 and resumed_rows > 3
    assert reads == []


def test_greedy_rows_take_the_heads_argmax_under_v2():
    """Past t½ (ε = 0.2: t½ = 4) every greedy NMST row's argmax is eos, whatever its logits; before,
    the argmax is the library's greedy pick."""
    from vllm import SamplingParams

    from nmst_fast.decoding import step_log_probs
    from nmst_fast.integrations.vllm import NMSTLogitsProcessor

    states = _req_states()
    processor = NMSTLogitsProcessor(engine_config(runner_v2=True), states)
    params = SamplingParams(temperature=0.0, extra_args={"nmst_head": "nmst", "nmst_eps": 0.2,
                                                         "nmst_eos_token_id": EOS})
    prompt = 5
    for slot in range(SLOTS):
        states.prompt_len.np[slot] = prompt
        processor.add_request(slot, params)
    torch.manual_seed(3)
    for t in range(1, 8):
        logits = torch.randn(SLOTS, V) * 5
        logits[:, EOS] -= 10.0
        expected = step_log_probs(logits.double(), head="nmst", eos_index=EOS, eps=0.2, steps=t)[0].argmax(dim=1)
        out = processor.apply(logits.clone(), _context(list(range(SLOTS)), [prompt + t - 2] * SLOTS))
        assert torch.equal(out.argmax(dim=1), expected)
        if t >= 4:
            assert (expected == EOS).all()


def test_second_instance_stays_idle_under_v2():
    from vllm import SamplingParams

    from nmst_fast.integrations.vllm import NMSTLogitsProcessor

    config = engine_config({"head": "nmst", "eps": 0.1, "context_length": None, "eos_token_id": EOS}, runner_v2=True)
    states = _req_states()
    first, second = NMSTLogitsProcessor(config, states), NMSTLogitsProcessor(config, states)
    assert first.add_request(0, SamplingParams()) and not second.add_request(0, SamplingParams())
    logits = torch.randn(1, V)
    once = first.apply(logits.clone(), _context([0], [4]))
    assert torch.equal(second.apply(once.clone(), _context([0], [4])), once) and not torch.equal(once, logits)


@pytest.fixture
def fresh_envs():
    """vLLM's environment variables read afresh in the test (its env cache, if an engine turned it on,
    is bypassed)."""
    import vllm.envs as envs

    cached = envs._is_envs_cache_enabled()
    if cached:
        envs.disable_envs_cache()
    yield
    if cached:
        envs.enable_envs_cache()


def test_v2_admission_in_vllms_input_processor(fresh_envs, monkeypatch, plain_dir, nmst_dir, tmp_path):
    """vLLM's own request admission (``InputProcessor``) under ``VLLM_USE_V2_MODEL_RUNNER=1`` builds
    V2's validator from the installed plugin: NMST is admitted; ST, a bad ε and an eos beyond the served
    V (a check that needs the engine's config) are refused, and so are log-probs that would be the plain
    softmax (prompt log-probs; sampled-token ones under the default raw_logprobs, admitted under
    processed_logprobs), on a plain model with the head per request and on a model that records it. On a
    model that records ST the V2 processor refuses to start. (The configs are built before the variable is
    set: vLLM's config check refuses V2 without Triton, which its CPU build lacks; admission reads the
    variable when it runs.)"""
    from conftest import ENGINE_ARGS
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState

    from nmst_fast.integrations.vllm import NMSTLogitsProcessor

    from hf_models import SERVED_EOS as MODEL_EOS
    from hf_models import SERVED_V as VOCAB
    from hf_models import save_served

    config = EngineArgs(plain_dir, **ENGINE_ARGS).create_engine_config()
    st_config = EngineArgs(save_served(str(tmp_path / "st"), head="st", eps=0.05), **ENGINE_ARGS).create_engine_config()
    nmst_config = EngineArgs(nmst_dir, **ENGINE_ARGS).create_engine_config()
    processed_config = EngineArgs(nmst_dir, **{**ENGINE_ARGS, "logprobs_mode": "processed_logprobs"}
                                  ).create_engine_config()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert config.use_v2_model_runner
    admission = InputProcessor(config)  # a V1-only plugin class made this raise
    assert "build_custom_logits_processors_params_validator" in admission.validate_logits_processors_params.__qualname__

    def admit(extra, processor=admission, **params):
        processor._validate_params(SamplingParams(extra_args=extra, **params), ("generate",))

    admit({"nmst_head": "nmst", "nmst_eps": 0.05, "nmst_eos_token_id": MODEL_EOS})
    admit({"nmst_head": "va"})
    with pytest.raises(VLLMValidationError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        admit({"nmst_head": "st", "nmst_eps": 0.05})
    with pytest.raises(VLLMValidationError, match="nmst_eps"):
        admit({"nmst_head": "nmst", "nmst_eps": 0.0})
    with pytest.raises(VLLMValidationError, match=f"V={VOCAB}"):
        admit({"nmst_head": "nmst", "nmst_eos_token_id": VOCAB})

    nmst = {"nmst_head": "nmst", "nmst_eps": 0.05}
    admit(None, logprobs=2, prompt_logprobs=2)  # a plain request on a plain model: vLLM's own log-probs
    admit({"nmst_head": "va"}, logprobs=2, prompt_logprobs=2)
    with pytest.raises(VLLMValidationError, match="logprobs_mode='raw_logprobs'.*--logprobs-mode processed_logprobs"):
        admit(nmst, logprobs=2)
    with pytest.raises(VLLMValidationError, match="prompt_logprobs would be the model's plain softmax"):
        admit(nmst, prompt_logprobs=1)
    recorded, processed = InputProcessor(nmst_config), InputProcessor(processed_config)
    assert recorded.vllm_config.use_v2_model_runner and processed.vllm_config.use_v2_model_runner
    with pytest.raises(VLLMValidationError, match="head 'nmst': logprobs would be the model's plain softmax"):
        admit(None, recorded, logprobs=2)
    admit(None, recorded)
    admit({"nmst_head": "va"}, recorded, logprobs=2)
    admit(None, processed, logprobs=2)
    with pytest.raises(VLLMValidationError, match="prompt_logprobs"):
        admit(None, processed, prompt_logprobs=1)

    states = LogitsProcRequestState(device=torch.device("cpu"), max_num_reqs=SLOTS, vocab_size=VOCAB,
                                    all_token_ids=None, prompt_len=None, prefill_len=None, total_len=None)
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        NMSTLogitsProcessor(st_config, states)
    assert NMSTLogitsProcessor(nmst_config, states).add_request(0, SamplingParams())
