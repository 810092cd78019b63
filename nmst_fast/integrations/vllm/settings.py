"""Which head a vLLM request decodes: the served model's recorded ``nmst`` entry and a request's flat
``extra_args`` keys, checked before any step runs (a ``ValueError`` at admission is HTTP 400)."""

from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass
from typing import Any, Optional

from vllm import SamplingParams

from ...settings import HeadSettings
from ...validation import HEADS

EXTRA_KEYS = ("nmst_head", "nmst_eps", "nmst_eos_token_id")
DEFAULT_EPS = 1e-5


@dataclass
class ModelInfo:
    """What the served engine says: the model config's recorded ``nmst`` entry, its single eos id (None
    when it has none or several), its vocabulary size (None when unknown), whether a speculative config
    is set, whether vLLM runs its Model Runner V2, and its ``logprobs_mode`` (None when unknown)."""

    recorded: dict
    eos_token_id: Optional[int]
    vocab_size: Optional[int]
    speculative: bool = False
    runner_v2: bool = False
    logprobs_mode: Optional[str] = None


def model_info(vllm_config: Any, runner_v2: Optional[bool] = None) -> ModelInfo:
    """The served engine's settings from its ``VllmConfig``; ``runner_v2`` None: read from the config
    (``use_v2_model_runner``, False where the config has no such property)."""
    model_config = vllm_config.model_config
    hf_config = model_config.hf_config
    recorded = getattr(hf_config, "nmst", None) or {}
    if not isinstance(recorded, dict):
        recorded = dict(vars(recorded)) if hasattr(recorded, "__dict__") else {}
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    eos = getattr(text_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if len(eos) == 1 else None
    try:
        vocab = int(model_config.get_vocab_size())
    except Exception:  # noqa: BLE001 - a config without a vocabulary size: range checks are skipped
        vocab = None
    speculative = getattr(vllm_config, "speculative_config", None) is not None
    if runner_v2 is None:
        try:
            runner_v2 = bool(getattr(vllm_config, "use_v2_model_runner", False))
        except Exception:  # noqa: BLE001 - the property refuses some configs; those run V1
            runner_v2 = False
    mode = getattr(model_config, "logprobs_mode", None)
    return ModelInfo(dict(recorded), None if eos is None else int(eos), vocab, speculative, runner_v2,
                      None if mode is None else str(mode))


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def request_settings(params: SamplingParams, model: Optional[ModelInfo] = None) -> Optional[HeadSettings]:
    """The head a request decodes ("nmst" or "st"; ``eos_token_id`` None where ``model`` is unknown), or None
    for plain softmax (no ``nmst_head`` and no recorded head, or ``nmst_head="va"``). ``model``: the served
    engine's settings (None: unknown, the checks that need them are skipped).

    Raises:
        ValueError: an unknown ``nmst_*`` key, a bad head / ε / eos, or a combination the head cannot
            follow (ST with min_tokens, bad_words, allowed_token_ids or structured outputs; ST under
            Model Runner V2; any head under speculative decoding).
    """
    extra = params.extra_args or {}
    unknown = sorted(k for k in extra if isinstance(k, str) and k.startswith("nmst_") and k not in EXTRA_KEYS)
    if unknown:
        raise ValueError(f"unknown extra_args key(s) {unknown}: the NMST processor reads {list(EXTRA_KEYS)}")
    recorded = model.recorded if model is not None else {}
    head = extra.get("nmst_head", recorded.get("head"))
    if head is None:
        given = [k for k in EXTRA_KEYS if k in extra]
        if given:
            raise ValueError(f"extra_args {given} given without nmst_head, and the model records no NMST head: "
                             "pass nmst_head='nmst' or 'st'")
        return None
    if not isinstance(head, str) or head not in HEADS:
        raise ValueError(f"extra_args['nmst_head'] must be one of {HEADS}, got {head!r}")
    if head == "va":
        return None
    eps = extra.get("nmst_eps", recorded.get("eps", DEFAULT_EPS))
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0.0 < float(eps) < 1.0:
        raise ValueError(f"extra_args['nmst_eps'] must be a float in the open interval (0, 1), got {eps!r}")
    eos = extra.get("nmst_eos_token_id", recorded.get("eos_token_id"))
    if eos is None:
        eos = model.eos_token_id if model is not None else None
        if eos is None and model is not None:
            raise ValueError("the model's config names no single eos id: pass extra_args['nmst_eos_token_id']")
    if eos is not None:
        if not _is_int(eos) or eos < 0:
            raise ValueError(f"extra_args['nmst_eos_token_id'] must be an int >= 0, got {eos!r}")
        if model is not None and model.vocab_size is not None and eos >= model.vocab_size:
            raise ValueError(f"extra_args['nmst_eos_token_id'] must lie in [0, V={model.vocab_size}), got {eos}")
    if model is not None and model.speculative:
        raise ValueError(f"head {head!r}: speculative decoding does not run custom logits processors (vLLM would "
                         "decode plain softmax); serve NMST models without a speculative config")
    if head == "st":
        if model is not None and model.runner_v2:
            raise ValueError(ST_NEEDS_V1)
        bans = [name for name, on in (("min_tokens", bool(params.min_tokens)), ("bad_words", bool(params.bad_words)),
                                      ("allowed_token_ids", params.allowed_token_ids is not None),
                                      ("structured_outputs", params.structured_outputs is not None)) if on]
        if bans:
            raise ValueError(f"head 'st' cannot follow {', '.join(bans)}: they may ban eos, and ST's running sum "
                             "needs every step's real eos logit; drop them, or decode with nmst_head='nmst'")
    return HeadSettings(head, float(eps), None if eos is None else int(eos))


ST_NEEDS_V1 = ("head 'st' runs on vLLM's V1 model runner only (set VLLM_USE_V2_MODEL_RUNNER=0): Model Runner V2 "
               "re-admits a preempted request as a new one, and ST's running sum over its past steps cannot be "
               "rebuilt from its tokens; decode with nmst_head='nmst', whose step needs no history")


def frontend_model() -> Optional[ModelInfo]:
    """The served engine's settings as vLLM's request admission sees them: ``validate_params`` gets only
    the SamplingParams, so look for the caller that holds the engine's config (vLLM 0.32's
    ``InputProcessor``, under either model runner); None when not found (then only the request's own
    settings are checked)."""
    frame = inspect.currentframe()
    try:
        depth = 0
        while frame is not None and depth < 12:
            owner = frame.f_locals.get("self")
            config = getattr(owner, "vllm_config", None)
            if config is not None and getattr(config, "model_config", None) is not None:
                return model_info(config)
            frame, depth = frame.f_back, depth + 1
    finally:
        del frame
    return None
