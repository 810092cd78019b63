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

import json
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


# Source rows (or columns, for a transposed weight) converted and written per block: about 16 MiB in float32.
BLOCK_BYTES = 16 * 2**20


class _Checkpoint:
    """The tensors of a saved model's directory, read a block at a time: its safetensors file(s)
    (``model.safetensors``, or the shards of ``model.safetensors.index.json``), or a ``pytorch_model.bin``. The file
    is mapped for each read and let go after it, so its pages leave the process's resident memory with the block."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            self.files = {name: directory / file for name, file in json.loads(index.read_text())["weight_map"].items()}
        elif (directory / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(directory / "model.safetensors", framework="pt") as f:
                self.files = {name: directory / "model.safetensors" for name in f.keys()}
        elif (directory / "pytorch_model.bin").is_file():
            self.files = dict.fromkeys(self._pickled(), directory / "pytorch_model.bin")
        else:
            raise FileNotFoundError(f"{directory} holds no weights (model.safetensors, its index, or "
                                    "pytorch_model.bin): not a saved model directory")

    def _pickled(self) -> dict[str, torch.Tensor]:
        return torch.load(self.directory / "pytorch_model.bin", map_location="cpu", mmap=True, weights_only=True)

    def names(self) -> list[str]:
        return list(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        if self.files[name].suffix == ".bin":
            return tuple(self._pickled()[name].shape)
        from safetensors import safe_open

        with safe_open(self.files[name], framework="pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def read(self, name: str, rows: slice, columns: slice) -> torch.Tensor:
        """Rows ``rows`` and columns ``columns`` of the tensor ``name`` (a vector: its entries ``rows``), as a new
        float32 tensor."""
        if self.files[name].suffix == ".bin":
            tensor = self._pickled()[name]
            part = tensor[rows, columns] if tensor.dim() > 1 else tensor[rows]
        else:
            from safetensors import safe_open

            with safe_open(self.files[name], framework="pt") as f:
                tensor = f.get_slice(name)
                part = tensor[rows, columns] if len(tensor.get_shape()) > 1 else tensor[rows]
        return part.to(torch.float32, copy=True)


@dataclass(frozen=True)
class _Planned:
    """One tensor of the file: its llama.cpp name, where it comes from and what the file stores."""

    target: str
    source: str
    shape: tuple[int, ...]  # as the file holds it (rows, columns): after a transposition
    qtype: Any  # gguf.GGMLQuantizationType
    transposed: bool
    rotary_heads: int  # > 0: q / k rows permuted to llama.cpp's rotary layout, head by head

    @property
    def nbytes(self) -> int:
        import gguf

        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) // block * size


def _tensor_type(shape: tuple[int, ...], kind: str) -> Any:
    """The GGML type a tensor of ``shape`` is stored in for the export's ``kind``: vectors f32; matrices f32, f16,
    or q8_0 where their rows split into 32-value blocks (f16 otherwise)."""
    import gguf

    if len(shape) < 2 or kind == "f32":
        return gguf.GGMLQuantizationType.F32
    if kind == "q8_0" and shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0:
        return gguf.GGMLQuantizationType.Q8_0
    return gguf.GGMLQuantizationType.F16


def _plan(checkpoint: _Checkpoint, config: Any, family: Family, architecture: Any, kind: str) -> list[_Planned]:
    """Every tensor the architecture reads, from the checkpoint's names and shapes (no data read)."""
    import gguf

    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    names = gguf.get_tensor_name_map(architecture, layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    heads = config.num_attention_heads if hasattr(config, "num_attention_heads") else config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    planned = []
    for name in checkpoint.names():
        if name.endswith(family.skipped) or (tied and name == "lm_head.weight"):
            continue  # llama.cpp reads a tied output layer from token_embd
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ValueError(f"{_family_name(config)}'s tensor {name!r} has no llama.cpp name: the GGUF export "
                             "cannot write this model")
        shape = checkpoint.shape(name)
        transposed = name.endswith(family.transposed)
        if transposed:
            shape = shape[::-1]
        rotary = 0
        if family.permute_rotary and name.endswith(("q_proj.weight", "k_proj.weight")):
            rotary = heads if "q_proj" in name else kv_heads
        planned.append(_Planned(target, name, shape, _tensor_type(shape, kind), transposed, rotary))
    return planned


def _blocks(checkpoint: _Checkpoint, tensor: _Planned) -> Iterator[np.ndarray]:
    """The tensor as the file stores it, in blocks of whole rows (one head's rows for a rotary permutation), each
    read, transposed or permuted, and encoded on its own."""
    import gguf

    rows = tensor.shape[0] if len(tensor.shape) > 1 else 1
    width = int(np.prod(tensor.shape)) // rows
    step = tensor.shape[0] // tensor.rotary_heads if tensor.rotary_heads else max(1, BLOCK_BYTES // (4 * width))
    for start in range(0, rows, step):
        part = slice(start, min(start + step, rows))
        if len(tensor.shape) < 2:
            block = checkpoint.read(tensor.source, slice(None), slice(None))
        elif tensor.transposed:  # the source's columns are the file's rows
            block = checkpoint.read(tensor.source, slice(None), part).t()
        else:
            block = checkpoint.read(tensor.source, part, slice(None))
        if tensor.rotary_heads:
            block = _permuted(block, 1)
        data = block.contiguous().numpy()
        if tensor.qtype == gguf.GGMLQuantizationType.F32:
            yield data
        elif tensor.qtype == gguf.GGMLQuantizationType.F16:
            yield data.astype(np.float16)
        else:
            yield gguf.quants.quantize(data, tensor.qtype)


def _write_tensor(writer: Any, checkpoint: _Checkpoint, tensor: _Planned) -> None:
    """The tensor's data at the writer's position, block by block (the writer's ``write_tensor_data`` takes a whole
    array): the padding before and after as it writes them, and the tensor's entry taken off its list as it does."""
    import gguf

    out = writer.fout[0]
    writer.write_padding(out, out.tell())
    written = 0
    for block in _blocks(checkpoint, tensor):
        block.tofile(out)
        written += block.nbytes
    if written != tensor.nbytes:
        raise RuntimeError(f"{tensor.source}: wrote {written} bytes for {tensor.nbytes}")
    writer.write_padding(out, written)
    writer.tensors[0].pop(tensor.target)
    writer.state = gguf.WriterState.WEIGHTS


def saved_config(directory: str | os.PathLike) -> Any:
    """The configuration of the NMST model saved in ``directory`` (a ``transformers`` config with its ``nmst``
    entry). A path that is not a saved model, or a model without a head, is refused with a FileNotFoundError /
    ValueError naming it."""
    from transformers import AutoConfig

    import nmst_fast  # noqa: F401  (opens the NMST checkpoint type)

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory} has no config.json: not a saved model directory")
    config = AutoConfig.from_pretrained(directory)
    if not getattr(config, "nmst", None):
        raise ValueError(f"{directory} holds no NMST head (its config.json has no 'nmst' entry): export-gguf writes "
                         "models saved after apply_nmst; for a plain model use llama.cpp's convert_hf_to_gguf.py")
    return config


def file_architecture(config: Any) -> str:
    """The ``general.architecture`` of the file exported from a model of ``config`` (e.g. "nmst-llama")."""
    return nmst_architecture(_family(config).architecture)


def _family_name(config: Any) -> str:
    return getattr(config, "base_model_type", config.model_type)


def _family(config: Any) -> Family:
    base = _family_name(config)
    family = FAMILIES.get(base)
    if family is None:
        raise ValueError(f"the GGUF export has no writer for the model type {base!r} (it writes "
                         f"{', '.join(sorted(FAMILIES))})")
    return family


def export_gguf(directory: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "f16") -> Path:
    """Write the NMST model saved in ``directory`` (``save_pretrained`` of a model with a head, and its tokenizer)
    as the GGUF file ``out``, tensors of type ``dtype`` ("f32" | "f16" | "q8_0"). The file is written beside ``out``
    and moved into place when complete. Returns ``out``.

    The weights stream: each tensor is read from the checkpoint's files, converted and written in blocks of rows
    (:data:`BLOCK_BYTES`), so the export holds a block at a time, never a whole tensor or the model.

    Refused with a FileNotFoundError naming the path: a directory that is not a saved model, an output directory
    that does not exist. Refused with a ValueError naming the reason: a directory without a head, a family other
    than :data:`FAMILIES`' (llama, mistral, qwen2, qwen3, gpt2), a configuration llama.cpp's architecture does not
    have, a tokenizer llama.cpp would not reproduce."""
    try:
        import gguf
    except ImportError as error:
        raise ImportError("the GGUF export needs the gguf package: pip install 'nmst-fast[gguf]'") from error

    if dtype not in TYPES:
        raise ValueError(f"dtype must be one of {TYPES}, got {dtype!r}")
    directory, out = Path(directory), Path(out)
    config = saved_config(directory)
    if not out.parent.is_dir():
        raise FileNotFoundError(f"{out.parent} does not exist: the GGUF file's directory must")
    settings = HeadSettings.from_recorded(config.nmst)
    family = _family(config)
    architecture = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == family.architecture)
    checkpoint = _Checkpoint(directory)
    planned = _plan(checkpoint, config, family, architecture, dtype)

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
        for key, value in head_entries(settings, family.architecture).items():  # before the tokenizer's arrays
            writer.add_string(key, value)
        write_vocabulary(writer, directory, config.vocab_size)
        for tensor in planned:  # element shapes: the writer keeps them for a quantized type given as float32
            writer.add_tensor_info(tensor.target, tensor.shape, np.dtype(np.float32), tensor.nbytes,
                                   raw_dtype=tensor.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with torch.no_grad():
            for tensor in planned:
                _write_tensor(writer, checkpoint, tensor)
        writer.close()
        os.replace(partial, out)
    finally:
        writer.close()
        partial.unlink(missing_ok=True)
    return out
