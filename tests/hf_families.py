"""Tiny random configs of every model type transformers maps to ``AutoModelForCausalLM``, for the family sweep.

Each type's default config is shrunk key by key (widths, depths, heads, experts: the library's shrink, which the
probe's small copies come from; and the vocabulary) and built through the same ``AutoConfig.for_model`` call a
user's config goes through, so the dependent fields a config derives in its constructor (layer types, head dims)
follow the small sizes.
"""

from __future__ import annotations

import math

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from nmst_fast.integrations.hf.shrink import SMALL, shrunk_config_kwargs

V, EOS = 97, 7  # V is prime: never a multiple of a block or of a vocabulary padding
_TOKENS = dict(bos_token_id=0, pad_token_id=0, eos_token_id=EOS)
# Config keys and the tiny value each takes: the library's small sizes (the probe's copies), a tiny vocabulary and
# token ids (only the keys a type's config has are set).
_TINY = {**SMALL, "vocab_size": V, "n_vocab": V, "padded_vocab_size": V, "unpadded_vocab_size": V,
         "vocab_size_per_layer_input": V, **_TOKENS}

# Types whose class is not a text LM a batch of token ids runs through: the sweep checks that they
# still fail to build or to run on text (so a type that starts to work is noticed and swept).
NOT_TEXT = {
    "musicgen": "audio codebooks: input_ids are (batch × codebooks, T)",
    "musicgen_melody": "audio codebooks: input_ids are (batch × codebooks, T)",
}
# Types without a tiny config that builds and runs here: the sweep checks that they still fail, so a
# type that starts to build is noticed and swept.
NOT_BUILT = {
    "cohere_compass_text": "its default config does not build a model (KeyError 'full_attention')",
    "dots1": "its default config does not build a model (TypeError in the experts)",
    "dbrx": "its default config does not build a model (its attention config lacks rope_theta)",
    "lfm2_moe": "its default config does not build a model (layer_types is None)",
    "qwen4_exp": "its default config does not build a model (indexer sizes are None)",
    "qwen4_exp_text": "its default config does not build a model (indexer sizes are None)",
    "gemma4_assistant": "its default config fails its own validation (hidden_size_per_layer_input)",
    "gemma3n": "its vision tower needs timm, whose torchvision does not load beside the CPU torch",
    "blt": "no tiny config found: the patcher's sizes do not follow the shrunk ones",
    "zamba": "no tiny config found: the shared-transformer ties do not survive fewer layers",
    "dots3_note": "no tiny config found: the vision adapter's widths do not follow the text model's",
}
# Types that compute gradients in training mode only (their overrides turn dropout off).
TRAIN_MODE = {"reformer"}
# Types that run in float32 only (a float32 constant or buffer meets the float64 weights).
FLOAT32 = {"xglm", "inkling2_text", "inkling2_loop_text"}

# Keys a type needs beyond the generic shrink (sizes that must agree with each other).
_OVERRIDES: dict[str, dict] = {
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "mamba2": dict(head_dim=32, n_groups=1),
    "zaya": dict(num_experts_per_tok=1),
    "dory": dict(num_hidden_layers=6, n_input_layers=2, n_recurrent_layers=2, n_output_layers=2,
                 layer_types=["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"]),
    "gemma4_assistant": dict(hidden_size_per_layer_input=0),
    # One layer of each kind: sliding window with a dense MLP, an indexer, a reindexer reading the indexer's keys
    # and values, sliding window with experts; pools and windows small enough that the sparse paths run at T = 10.
    "kolibri1_1": dict(num_hidden_layers=4, layer_types=["sliding_attention", "indexed_attention", "indexed_attention",
                                                         "sliding_attention"],
                       index_layers=[1], kv_source_layers=[0, 1, 1, 3], mlp_only_layers=[0],
                       mlp_only_intermediate_size=96, index_num_heads=2, index_topk=2, index_pool_size=4,
                       index_compression=2, index_num_local_tokens=2, index_num_sink_tokens=1, sliding_window=4),
    # Reformer backpropagates in training mode only: no dropout, and LSH buckets from a fixed seed.
    "reformer": dict(is_decoder=True, axial_pos_shape=[2, 5], axial_pos_embds_dim=[32, 32], hash_seed=0,
                     max_position_embeddings=10, local_attn_chunk_length=5, lsh_attn_chunk_length=5,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     lsh_attention_probs_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0),
}


def causal_lm_types() -> list[str]:
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str, **extra):
    default = transformers.AutoConfig.for_model(model_type)
    kwargs = {**shrunk_config_kwargs(default, _TINY), **_TOKENS, **_OVERRIDES.get(model_type, {}), **extra}
    # Mixture-of-experts layers default to torch's grouped GEMM, which has no float64 kernel.
    return transformers.AutoConfig.for_model(model_type, **kwargs, experts_implementation="eager")


def tiny_causal_lm(model_type: str, seed: int = 0, dtype=None, **extra):
    """A random-init ``AutoModelForCausalLM`` of ``model_type``, tiny, in eval mode, in float64 (float32
    for the types in :data:`FLOAT32`) unless ``dtype`` is given."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, **extra)
    dtype = dtype or (torch.float32 if model_type in FLOAT32 else torch.float64)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    if getattr(config, "languages", None) and hasattr(model, "set_default_language"):  # X-MOD's adapters
        model.set_default_language(config.languages[0])
    return model


# The classes that score ``labels[:, i]`` at position i (their own loss is not shifted).
UNSHIFTED = {"bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "cpmant", "marian", "mbart", "mvp", "pegasus",
             "plbart", "trocr", "whisper", "xlm", "xlnet"}


def probe_batch(seed: int = 0, B: int = 2, T: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels aligned with them (the shifted convention's layout: the class's own
    convention decides which position scores which label): a masked prompt of 3 tokens on row 0,
    none on row 1, and an eos target."""
    ids = torch.randint(8, V, (B, T), generator=torch.Generator().manual_seed(seed))
    ids[1, 6] = EOS
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def targets_and_steps(labels: torch.Tensor, shifted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, t) of the positions that score them, (B, T - 1) shifted or (B, T) not: t = 1 at a
    row's first supervised target, counting on from there."""
    targets = labels[:, 1:] if shifted else labels
    index = torch.arange(targets.shape[1]).expand(targets.shape)
    first = torch.where(targets != -100, index, targets.shape[1]).amin(dim=1, keepdim=True)
    return targets, (index - first + 1).clamp(min=0)


def spread_logits(model, span: float, *, train: bool = False, tries: int = 8) -> float:
    """Scale ``model``'s output layer in place (weight, and bias where it has one) so that its own
    logits on :func:`probe_batch` reach max |logit| ≈ ``span`` (within 2%); returns the max |logit|
    reached. Logits need not follow the scale linearly: a tied input embedding scales with the weight
    (LFM3's logits grow ×3.2 when it doubles near 12) and a cap bends them, so each step is a secant on
    log max |logit| against log scale. ``train``: measure in training mode (the types of
    :data:`TRAIN_MODE` compute their logits there); the model is left in eval mode."""
    ids, _ = probe_batch()
    layer = model.get_output_embeddings()
    params = [p for p in (layer.weight, getattr(layer, "bias", None)) if p is not None]
    model.train(train)
    log_scale, slope, previous = 0.0, 1.0, None  # log of the scale applied so far; d log|z| / d log scale
    try:
        with torch.no_grad():
            for attempt in range(tries + 1):
                reached = float(model(input_ids=ids, use_cache=False).logits.abs().max())
                if abs(reached - span) <= 0.02 * span or attempt == tries:
                    break
                if previous is not None:
                    slope = min(max((math.log(reached) - previous[1]) / (log_scale - previous[0]), 0.25), 4.0)
                previous = (log_scale, math.log(reached))
                step = math.log(span / reached) / slope
                for p in params:
                    p.mul_(math.exp(step))
                log_scale += step
    finally:
        model.eval()
    return reached
