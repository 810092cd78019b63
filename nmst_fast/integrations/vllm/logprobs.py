"""Which log-probs vLLM can return for a request that decodes an NMST / ST head, checked at admission.

vLLM 0.32 (either model runner) computes a request's log-probs in one of two places:

  * from the model's own logits, which no logits processor sees: prompt log-probs (``prompt_logprobs``,
    V2's ``prompt_logprob_token_ids``) under every ``logprobs_mode``, and sampled-token log-probs
    (``logprobs``, ``logprob_token_ids``) under ``raw_logprobs`` (vLLM's default: the plain softmax) and
    ``raw_logits`` (the model's logits);
  * from the logits the sampler draws from, after the processor (and vLLM's penalties, temperature,
    top-k / top-p): sampled-token log-probs under ``processed_logprobs`` (the head's log q_T) and
    ``processed_logits`` (the head's logits).

A request that decodes a head and asks for the first kind would get values of a distribution it does not
decode, with nothing to tell it so: it is refused with the fix (:func:`logprobs_refusal`). An engine
whose mode is raw still starts, model-wide head or not: it serves every request that does not ask for
log-probs, and the refusal names the flag.
"""

from __future__ import annotations

from typing import Optional

from vllm import SamplingParams

from .eos_column import log_once
from .settings import HeadSettings

PROCESSED_MODES = ("processed_logprobs", "processed_logits")
DEFAULT_MODE = "raw_logprobs"  # vLLM's ModelConfig.logprobs_mode default

_FIX = ("serve with --logprobs-mode processed_logprobs (offline: LLM(..., logprobs_mode='processed_logprobs')) "
        "to get the head's log-probs")
_PLAIN = "or pass nmst_head='va' to decode, and score, with the plain softmax"


def logprobs_refusal(params: SamplingParams, settings: Optional[HeadSettings],
                     logprobs_mode: Optional[str]) -> Optional[str]:
    """Why vLLM would return a request's log-probs from the model's own logits, not the head's; None when
    it would not (no head: ``settings`` None; no log-probs asked; a processed mode).

    Args:
        params: the request's SamplingParams.
        settings: the head the request decodes (:func:`~.settings.request_settings`), None for plain softmax.
        logprobs_mode: the engine's ``ModelConfig.logprobs_mode``; None (unknown) counts as vLLM's default,
            ``raw_logprobs``.
    """
    if settings is None:
        return None
    head = settings.head
    for asked in ("prompt_logprobs", "prompt_logprob_token_ids"):
        if getattr(params, asked, None) is not None:
            return (f"head {head!r}: {asked} would be the model's plain softmax, not the head's: vLLM scores "
                    "prompt tokens from the model's logits, which no logits processor sees, under every "
                    f"logprobs_mode; drop {asked} (score prompts outside vLLM, e.g. nmst_fast.nmst_log_probs "
                    f"on the model's logits with the prompt as context, t <= 0), {_PLAIN}")
    mode = logprobs_mode or DEFAULT_MODE
    if mode in PROCESSED_MODES:
        return None
    asked = "logprobs" if params.logprobs is not None else \
        "logprob_token_ids" if getattr(params, "logprob_token_ids", None) else None
    if asked is None:
        return None
    what = "plain softmax" if mode == "raw_logprobs" else "logits"
    return (f"head {head!r}: {asked} would be the model's {what}, not the head's: this engine runs "
            f"logprobs_mode={mode!r}, which vLLM takes before any logits processor runs; {_FIX} (or "
            f"processed_logits for its logits), {_PLAIN}")


def warn_unrefused_logprobs(seen: set, params: SamplingParams, settings: HeadSettings,
                            logprobs_mode: Optional[str]) -> None:
    """In the engine: log once (keys in ``seen``) a request that reached the runner although admission
    should have refused its log-probs (a frontend that did not run ``validate_params``): they are
    returned unchanged, and are not the head's."""
    refusal = logprobs_refusal(params, settings, logprobs_mode)
    if refusal is not None:
        log_once(seen, "logprobs", f"{refusal}; admission did not refuse this request: its log-probs are not the "
                 "head's")
