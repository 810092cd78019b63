"""llama.cpp's extra buffer types, and the CPUs on which the head's files are opened without them.

At load, llama.cpp may copy a model's weights into "extra" CPU buffer types, repacked for its faster kernels: the
AMX buffer (quantized weights for its AMX matmul, in a build for a CPU with AMX) and the repack buffer (AVX2 /
AVX-512 layouts). The AMX matmul crashes decoding quantized files on CPUs with AMX (llama.cpp issue 20824, a segfault
in ``ggml_backend_amx_mul_mat``; seen on Sapphire Rapids Xeons with q8_0 and Q4_K files, f32 and f16 files
unaffected). llama-cpp-python has no argument for the model parameter that turns them off (``use_extra_bufts``), so
:class:`~nmst_fast.integrations.llama_cpp.NMSTLlama` sets it as ``Llama.__init__`` makes the parameters: off where this
llama.cpp build runs AMX kernels, on elsewhere, and as the caller says when given.
"""

from __future__ import annotations

from typing import Any, Mapping

import llama_cpp

__all__ = ["default_extra_buffer_types", "llama_cpp_has_amx", "quantized_file", "risks_the_amx_crash"]

# GGUF's general.file_type values of files without quantized matrices (gguf.LlamaFileType: ALL_F32, MOSTLY_F16,
# MOSTLY_BF16): llama.cpp's AMX buffer takes none of their tensors.
UNQUANTIZED_FILE_TYPES = frozenset({0, 1, 32})
AMX_CRASH = ("llama.cpp's AMX kernels crash decoding quantized files on CPUs with AMX (llama.cpp issue 20824, a "
             "segfault in ggml_backend_amx_mul_mat)")


def llama_cpp_has_amx() -> bool:
    """Whether this llama.cpp build runs AMX kernels (its system information lists AMX_INT8: it was built for a CPU
    with AMX, and its AMX buffer type takes quantized weights)."""
    return b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info()


def default_extra_buffer_types() -> bool:
    """``use_extra_bufts`` where the caller gives none: off where llama.cpp runs AMX kernels, on elsewhere (the
    repack buffer's AVX2 / AVX-512 layouts stay)."""
    return not llama_cpp_has_amx()


def quantized_file(metadata: Mapping[str, Any]) -> bool:
    """Whether a file's metadata (``Llama.metadata``: strings) records quantized matrices; a file that records no
    type counts as quantized."""
    file_type = metadata.get("general.file_type")
    return file_type is None or int(file_type) not in UNQUANTIZED_FILE_TYPES


def risks_the_amx_crash(llm: llama_cpp.Llama) -> bool:
    """Whether ``llm`` holds a quantized file in llama.cpp's extra buffer types, with AMX kernels in this build."""
    return bool(llm.model_params.use_extra_bufts) and llama_cpp_has_amx() and quantized_file(llm.metadata)
