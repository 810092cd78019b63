"""llama.cpp's extra buffer types: ``load`` opens files without them where llama.cpp runs AMX kernels (whose matmul
crashes decoding quantized files there), a caller's choice reaches llama.cpp, and a ``Llama`` of one's own holding a
quantized file in the AMX buffers is refused before it decodes. Every test runs the same on a CPU with AMX and one
without: the choice is read from this llama.cpp build, and what llama.cpp did is read from its load log."""

from __future__ import annotations

import llama_cpp
import pytest
from conftest import EPS
from llama_cpp import Llama

import nmst_fast
from nmst_fast.integrations.llama_cpp import NMSTLogitsProcessor, buffers, load

from test_decoding import OPEN, greedy, prompts, reference_greedy

T_HALF = nmst_fast.termination_bound(EPS)
WITH_AMX = b"CPU : AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | REPACK = 1 | "


def load_log(capfd, path, **kwargs) -> tuple[Llama, str]:
    """``load(path, **kwargs)`` with llama.cpp's load log (it writes to the process's stderr)."""
    capfd.readouterr()
    llm = load(path, **{**OPEN, "verbose": True, **kwargs})
    return llm, capfd.readouterr().err


def test_quantized_files_open_without_the_amx_buffers_where_llama_cpp_runs_amx_and_decode(exported, tokenizer,
                                                                                          capfd):
    _, path = exported("qwen3", dtype="q8_0")
    llm, log = load_log(capfd, path)
    assert llm.model_params.use_extra_bufts is (not buffers.llama_cpp_has_amx())
    assert "AMX model buffer" not in log
    for prompt in prompts(tokenizer):
        got = greedy(llm, prompt, 60)
        assert len(got) <= T_HALF and got[-1] == tokenizer.eos_token_id


def test_the_callers_choice_of_extra_buffer_types_reaches_llama_cpp(exported, capfd):
    """With them, llama.cpp offers the file's matrices to its repack (or AMX) buffer and logs where each went;
    without them it never names either. Loading is safe either way: the AMX crash is in the matmul."""
    _, path = exported("qwen3", dtype="q8_0")
    on, log_on = load_log(capfd, path, use_extra_bufts=True)
    off, log_off = load_log(capfd, path, use_extra_bufts=False)
    assert on.model_params.use_extra_bufts is True and off.model_params.use_extra_bufts is False
    assert "REPACK" in log_on.replace("REPACK = 1", "") or "AMX model buffer" in log_on
    assert "REPACK" not in log_off.replace("REPACK = 1", "") and "AMX model buffer" not in log_off


def test_a_q8_0_file_without_extra_buffer_types_decodes_as_the_f32_file(exported, tokenizer):
    """q8_0's logits differ from f32's by a few 1e-2: prompts whose float64 greedy margin stays above 0.2 along the
    run decode to the same tokens."""
    directory, f32 = exported("qwen3")
    _, q8 = exported("qwen3", dtype="q8_0")
    exact, quantized = load(f32, **OPEN), load(q8, use_extra_bufts=False, **OPEN)
    compared = 0
    for prompt in prompts(tokenizer, 16):
        expected, margin = reference_greedy(directory, prompt, 30)
        if margin < 0.2:
            continue
        assert greedy(quantized, prompt, 30) == greedy(exact, prompt, 30) == expected, prompt
        compared += 1
    assert compared >= 4


def test_the_default_follows_llama_cpps_amx_kernels_and_an_own_llama_at_risk_is_refused(exported, monkeypatch):
    """With this build's system information made to list AMX_INT8: ``load`` turns the buffers off, and a processor
    for a ``Llama`` of one's own holding a quantized file in them is refused (an f32 file, or the buffers off, are
    not at risk). Nothing decodes here, so the real CPU's kernels never run with the buffers on."""
    _, q8 = exported("qwen3", dtype="q8_0")
    _, f32 = exported("qwen3")
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: WITH_AMX)
    assert buffers.llama_cpp_has_amx() and not buffers.default_extra_buffer_types()
    assert load(q8, **OPEN).model_params.use_extra_bufts is False
    assert load(q8, use_extra_bufts=True, **OPEN).model_params.use_extra_bufts is True
    own = Llama(str(q8), kv_overrides={"general.architecture": "qwen3"}, **OPEN)
    assert own.model_params.use_extra_bufts  # llama.cpp's default
    with pytest.raises(ValueError, match=r"AMX kernels crash .* issue 20824.*load\(path, \.\.\.\)"):
        NMSTLogitsProcessor(own)
    NMSTLogitsProcessor(Llama(str(f32), kv_overrides={"general.architecture": "qwen3"}, **OPEN))
    NMSTLogitsProcessor(load(q8, use_extra_bufts=True, **OPEN))  # the caller's choice, kept
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: WITH_AMX.replace(b"AMX_INT8 = 1 | ", b""))
    assert buffers.default_extra_buffer_types()
    NMSTLogitsProcessor(own)


@pytest.mark.parametrize("file_type, quantized", [("0", False), ("1", False), ("32", False), ("7", True),
                                                  ("15", True), (None, True)])
def test_which_files_count_as_quantized(file_type, quantized):
    metadata = {} if file_type is None else {"general.file_type": file_type}
    assert buffers.quantized_file(metadata) is quantized
