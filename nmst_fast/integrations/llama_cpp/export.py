"""``nmst-fast export-gguf``: a saved NMST model as one GGUF file, through the ``gguf`` package's writer.

The file holds the base architecture's tensors and hyper-parameters under llama.cpp's names (as llama.cpp's own
converter writes them), the tokenizer (:mod:`.vocabulary`) and the head (:mod:`.metadata`), and names its
architecture ``nmst-<base>``: plain llama.cpp, Ollama and LM Studio refuse it, and
:mod:`nmst_fast.integrations.llama_cpp.decoding` opens it with the head.

Families: Llama and Mistral (llama.cpp's "llama", whose rotary embedding pairs adjacent features: the q / k rows are
permuted from Hugging Face's half-split layout), Qwen2, Qwen3 and GPT-2 (its Conv1D weights transposed). Tensor types:
``f32``; ``f16``; ``q8_0`` (matrices whose rows split into 32-value blocks; other matrices f16). Vectors (norms,
biases) stay f32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ...settings import HeadSettings
from .metadata import head_entries, nmst_architecture
from .vocabulary import write_vocabulary

TYPES = ("f32", "f16", "q8_0")


@dataclass(frozen=True)
class Family:
    """How one Hugging Face model type becomes one llama.cpp architecture."""

    architecture: str  # llama.cpp's name (gguf.MODEL_ARCH_NAMES)
    hyper_parameters: Callable[[Any, Any], None]  # (writer, config): the architecture's keys
    permute_rotary: bool = False  # llama.cpp pairs adjacent rotary features for this architecture
    transposed: tuple[str, ...] = ()  # weight names stored (in, out) by Hugging Face (Conv1D)
    skipped: tuple[str, ...] = ()  # state-dict entries llama.cpp has no tensor for


def _rope_theta(config: Any) -> float:
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind != "default":
        raise ValueError(f"this model's rotary embedding is scaled ({kind!r}): the GGUF export writes unscaled "
                         "rotary embeddings only")
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _decoder_keys(writer: Any, config: Any) -> None:
    """Llama, Mistral, Qwen2, Qwen3: a pre-norm decoder with RMSNorm, rotary attention and a gated MLP."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    context = config.max_position_embeddings
    window = getattr(config, "sliding_window", None)
    if window is not None and (getattr(config, "use_sliding_window", True) is not False) and window < context:
        context = window  # llama.cpp's llama / qwen attend to the whole context: stay within the window
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(config, flag, False):
            raise ValueError(f"this {config.base_model_type} has {flag}=True: llama.cpp's architecture for it has no "
                             "such biases")
    writer.add_context_length(context)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)


def _gpt2_keys(writer: Any, config: Any) -> None:
    if getattr(config, "scale_attn_by_inverse_layer_idx", False) or getattr(config, "reorder_and_upcast_attn", False):
        raise ValueError("this gpt2 scales or reorders its attention: llama.cpp's gpt2 does neither")
    writer.add_context_length(config.n_positions)
    writer.add_embedding_length(config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.n_inner or 4 * config.n_embd)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)


FAMILIES = {
    "llama": Family("llama", _decoder_keys, permute_rotary=True),
    "mistral": Family("llama", _decoder_keys, permute_rotary=True),
    "qwen2": Family("qwen2", _decoder_keys),
    "qwen3": Family("qwen3", _decoder_keys),
    "gpt2": Family("gpt2", _gpt2_keys, transposed=(".c_attn.weight", ".c_proj.weight", ".c_fc.weight"),
                   skipped=(".attn.bias", ".attn.masked_bias")),
}


def _permuted(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q / k rows from Hugging Face's rotary layout (each head's first half, then its second) to llama.cpp's
    (the halves interleaved): what llama.cpp's converter does for its "llama" architecture."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


def _tensors(model: torch.nn.Module, family: Family, architecture: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(llama.cpp name, tensor) of every weight the architecture reads."""
    import gguf

    config = model.config
    names = gguf.get_tensor_name_map(architecture, getattr(config, "num_hidden_layers", None) or config.n_layer)
    head = model.get_output_embeddings()
    tied = head.weight is model.get_input_embeddings().weight
    output = next(name for name, module in model.named_modules() if module is head) + ".weight"
    for name, tensor in model.state_dict().items():
        if name.endswith(family.skipped) or (tied and name == output):
            continue  # llama.cpp reads a tied output layer from token_embd
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ValueError(f"{config.base_model_type}'s tensor {name!r} has no llama.cpp name: the GGUF export "
                             "cannot write this model")
        tensor = tensor.detach().float()
        if name.endswith(family.transposed):
            tensor = tensor.t()
        if family.permute_rotary and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else \
                (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
            tensor = _permuted(tensor, heads)
        yield target, tensor


def _encoded(tensor: torch.Tensor, kind: str) -> tuple[np.ndarray, Any]:
    """The tensor as the file stores it (numpy data, its GGML type)."""
    import gguf

    data = tensor.contiguous().numpy()
    if data.ndim < 2 or kind == "f32":
        return data.astype(np.float32), gguf.GGMLQuantizationType.F32
    if kind == "q8_0" and data.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0:
        qtype = gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.quantize(data, qtype), qtype
    return data.astype(np.float16), gguf.GGMLQuantizationType.F16


def export_gguf(directory: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "f16") -> Path:
    """Write the NMST model saved in ``directory`` (``save_pretrained`` of a model with a head, and its tokenizer)
    as the GGUF file ``out``, tensors of type ``dtype`` ("f32" | "f16" | "q8_0"). The file is written beside ``out``
    and moved into place when complete. Returns ``out``.

    Refused with a ValueError naming the reason: a directory without a head, a family other than
    :data:`FAMILIES`' (llama, mistral, qwen2, qwen3, gpt2), a configuration llama.cpp's architecture does not
    have, a tokenizer llama.cpp would not reproduce."""
    try:
        import gguf
    except ImportError as error:
        raise ImportError("the GGUF export needs the gguf package: pip install 'nmst-fast[gguf]'") from error
    from transformers import AutoModelForCausalLM

    import nmst_fast  # noqa: F401  (opens the NMST checkpoint type)

    if dtype not in TYPES:
        raise ValueError(f"dtype must be one of {TYPES}, got {dtype!r}")
    directory, out = Path(directory), Path(out)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype="auto")
    config = model.config
    recorded = getattr(config, "nmst", None)
    if not recorded:
        raise ValueError(f"{directory} holds no NMST head (its config.json has no 'nmst' entry): export-gguf writes "
                         "models saved after apply_nmst; for a plain model use llama.cpp's convert_hf_to_gguf.py")
    settings = HeadSettings.from_recorded(recorded)
    base = getattr(config, "base_model_type", config.model_type)
    family = FAMILIES.get(base)
    if family is None:
        raise ValueError(f"the GGUF export has no writer for the model type {base!r} (it writes "
                         f"{', '.join(sorted(FAMILIES))})")
    architecture = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == family.architecture)

    class Writer(gguf.GGUFWriter):
        def add_architecture(self) -> None:  # the base architecture's keys, under the NMST architecture's name
            self.add_string(gguf.Keys.General.ARCHITECTURE, nmst_architecture(self.arch))

    partial = out.with_name(out.name + ".partial")
    writer = Writer(partial, family.architecture)
    try:
        writer.add_name(directory.name)
        family.hyper_parameters(writer, config)
        writer.add_vocab_size(config.vocab_size)
        writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        write_vocabulary(writer, directory, config.vocab_size)
        for key, value in head_entries(settings, family.architecture).items():
            writer.add_string(key, value)
        with torch.no_grad():
            for name, tensor in _tensors(model, family, architecture):
                data, qtype = _encoded(tensor, dtype)
                writer.add_tensor(name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, out)
    finally:
        writer.close()
        partial.unlink(missing_ok=True)
    return out
