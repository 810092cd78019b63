"""A small random copy of a model for the probe: the same class and configuration but for its sizes.

The probe (:mod:`.probe`) checks the modeling code and the config's logit post-processing, not the weights, so it
runs on a copy of the model whose config is shrunk key by key (widths, depths, heads, experts): a few layers, one of
each kind the config lists, 64 wide. Its vocabulary and token ids stay the model's own (the head's eos is one of
them), as do every other setting: the logit cap and scale, the attention implementation, the dtype and device. It
runs in milliseconds where the model itself would take its whole weights through two forward passes (seconds at
0.6B, minutes at 7B on a CPU, and every page of a memory-mapped checkpoint read in).

:func:`shrunk_config_kwargs` is also what the tests' family sweep builds its tiny models of every type from.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

WIDTH, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16

# Config keys and the small value each takes (only the keys a type's config has are set).
SMALL = {
    "hidden_size_per_layer_input": 16, "adapter_in_dim": WIDTH, "adapter_input_size": WIDTH,
    "hidden_size": WIDTH, "n_embd": WIDTH, "d_model": WIDTH, "dim": WIDTH, "embed_dim": WIDTH, "emb_dim": WIDTH,
    "embedding_dim": WIDTH, "hidden_dim": WIDTH, "word_embed_proj_dim": WIDTH, "input_embedding_size": WIDTH,
    "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2, "decoder_layers": 2,
    "num_decoder_layers": 2, "encoder_layers": 2,
    "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS, "num_heads": HEADS,
    "decoder_attention_heads": HEADS, "encoder_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "n_kv_heads": KV_HEADS, "num_kv_heads": KV_HEADS,
    "head_dim": HEAD_DIM, "kv_channels": HEAD_DIM,
    "intermediate_size": 96, "n_inner": 96, "ffn_dim": 96, "decoder_ffn_dim": 96, "encoder_ffn_dim": 96,
    "ffn_hidden_size": 96, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128, "max_sequence_length": 128,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "n_group": 1, "topk_group": 1,
    "rotary_dim": 8, "qk_rope_head_dim": HEAD_DIM, "qk_nope_head_dim": HEAD_DIM, "v_head_dim": 16, "kv_lora_rank": 16,
    "q_lora_rank": 16, "num_kv_shared_layers": 0, "global_head_dim": 2 * HEAD_DIM,
    "mamba_d_state": 16, "state_size": 16, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_ssm": 128,
    "mamba_chunk_size": 16, "linear_key_head_dim": HEAD_DIM, "linear_value_head_dim": HEAD_DIM,
    "linear_head_dim": HEAD_DIM, "linear_num_key_heads": KV_HEADS, "linear_num_value_heads": HEADS,
    "linear_num_heads": HEADS,
    "o_lora_rank": 16, "index_head_dim": HEAD_DIM, "qk_head_dim": 2 * HEAD_DIM, "dim_head": HEAD_DIM, "dim_ff": 96,
    "position_bias_num_buckets": 32, "position_bias_max_distance": 128,
    "attention_head_dim": HEAD_DIM, "attention_head_size": HEAD_DIM,
}
DEPTH_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers")
# What the copy keeps of the model's config besides its sizes (these name the model, not its shape).
DROPPED_KEYS = ("model_type", "base_model_type", "nmst", "auto_map", "architectures", "transformers_version")


def config_fields(config: Any) -> set[str]:
    """The keys ``config`` has (its own, its attribute map's, its dataclass fields)."""
    names = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    if dataclasses.is_dataclass(config):
        names |= {f.name for f in dataclasses.fields(config)}
    return names


def _layers(config: Any, small: dict) -> dict:
    """Keep one layer of each kind (at least two layers, at most four): the per-layer lists a config holds (layer
    types, block types, per-layer settings) are cut to the kept layers, so they stay consistent. Read from
    ``to_dict()``: a heterogeneous config refuses to read a per-layer value as a global."""
    values = config.to_dict()
    depth = next((values[key] for key in DEPTH_KEYS if isinstance(values.get(key), int)), None)
    if not depth:
        return {}
    # Derived properties (no setter) follow the fields they are computed from.
    per_layer = {key: value for key, value in values.items() if isinstance(value, (list, tuple)) and len(value) == depth
                 and key != "architectures" and not isinstance(getattr(type(config), key, None), property)}
    kinds, kept = set(), []
    for i in range(depth):
        kind = tuple(repr(value[i]) for value in per_layer.values())
        if kind not in kinds:
            kinds.add(kind)
            kept.append(i)
    kept = sorted(set(kept) | set(range(min(2, depth))))[:4]
    kwargs = {key: len(kept) for key in DEPTH_KEYS if key in values}
    kwargs.update({key: type(value)(small.get(key, value[i]) for i in kept) for key, value in per_layer.items()})
    return kwargs


def shrunk_config_kwargs(config: Any, small: Optional[dict] = None) -> dict:
    """Keyword arguments that make ``config`` (and its sub-configs) small: each key of ``small`` (default
    :data:`SMALL`) the config has takes its value there (per-layer lists too), per-layer lists keep one layer of
    each kind."""
    from transformers import PretrainedConfig

    small = SMALL if small is None else small
    fields = config_fields(config)
    kwargs = {key: value for key, value in small.items() if key in fields}
    if "kv_lora_rank" in fields:  # multi-head latent attention: as many key/value heads as query heads
        kwargs["num_key_value_heads"] = small["num_attention_heads"]
    for key, value in config.to_dict().items():  # settings kept as plain dicts (Kimi's linear_attn_config)
        if isinstance(value, dict) and key not in kwargs and set(value) & set(small):
            kwargs[key] = {k: small.get(k, v) for k, v in value.items()}
    kwargs.update(_layers(config, small))
    for key, value in vars(config).items():
        if isinstance(value, PretrainedConfig):
            # Per-layer overrides are derived again from the kept layers.
            kept = {k: v for k, v in value.to_dict().items() if k != "per_layer_config"}
            kwargs[key] = {**kept, **shrunk_config_kwargs(value, small)}
    return kwargs


def small_copy(model: Any, model_class: type) -> Optional[Any]:
    """A random-init ``model_class`` (the model's own class, without a head) of the model's config shrunk by
    :func:`shrunk_config_kwargs`, in the model's dtype, on its device, in eval mode; None where no such copy builds
    (the probe then runs on the model itself)."""
    config = model.config
    values = {key: value for key, value in config.to_dict().items() if key not in DROPPED_KEYS}
    parameter = next(model.parameters(), None)
    if parameter is None:
        return None
    cuda = [parameter.device.index or 0] if parameter.device.type == "cuda" else []
    try:  # its random init leaves the caller's random streams where they were
        small_config = model_class.config_class(**{**values, **shrunk_config_kwargs(config)})
        with torch.random.fork_rng(devices=cuda), torch.device(parameter.device):
            small = model_class._from_config(small_config, dtype=parameter.dtype,
                                             attn_implementation=config._attn_implementation)
    except Exception:  # a type whose sizes must agree in ways the generic shrink does not know
        return None
    if getattr(config, "languages", None) and hasattr(small, "set_default_language"):  # X-MOD's adapters
        small.set_default_language(config.languages[0])
    return small.eval()
