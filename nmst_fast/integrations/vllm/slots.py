"""The head under vLLM's Model Runner V2 (vLLM's default on GPUs): requests live in slots, and each
step's batch names its rows' slots (``ctx.idx_mapping``) and positions (``ctx.pos``) on the device.

The step t is read on the device: the row's position p is that of the last token fed, so the token
sampled from it is the (p + 2 − prompt_len)-th generated one (t = 1 right after the prompt). That
stays true through chunked prefill (earlier chunks' rows give t ≤ 0 and sample nothing), prefix
caching and preemption (a resumed request's prefill ends at the same position), with no host sync.
NMST needs nothing else; ST's running sum would need the request's past steps, which V2 does not keep
across preemption, so ST is refused here (see ``settings.ST_NEEDS_V1``).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import SamplingParams

from ...decoding.distribution import RowBuffer
from ...decoding.eos_column import device_eos_values, inverse_temperatures, tempered_non_eos_lse
from .eos_column import log_once, row_selection, row_temperature
from .logprobs import warn_unrefused_logprobs
from .settings import HeadSettings, ModelInfo, request_settings


class SlotHead:
    """The V2 runner's side of :class:`~nmst_fast.integrations.vllm.NMSTLogitsProcessor`: per slot, the
    head's settings and the row's temperature (host), set in ``add_request``; ``apply`` reads the
    prompt lengths from vLLM's per-slot buffers on the device."""

    def __init__(self, model: ModelInfo, req_states: Any) -> None:
        self.model = model
        self.prompt_len = req_states.prompt_len
        self.slots: dict[int, tuple[HeadSettings, float]] = {}
        self.buffer = RowBuffer()
        self._warned: set[str] = set()

    def add_request(self, slot: int, params: SamplingParams) -> bool:
        """Set ``slot``'s head from ``params`` (the slot's last occupant is forgotten); whether the
        processor touches the request."""
        self.slots.pop(slot, None)
        try:
            settings = request_settings(params, self.model)
        except ValueError as err:  # admission checks these; reaching here means they were bypassed
            log_once(self._warned, str(err), f"{err}; the request decodes plain softmax")
            return False
        if settings is None:
            return False
        warn_unrefused_logprobs(self._warned, params, settings, self.model.logprobs_mode)
        self.slots[slot] = (settings, row_temperature(float(params.temperature)))
        return True

    def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Write T·ζ_eos into the eos column of every NMST row of ``logits`` (rows, V) float32, in place;
        row i belongs to slot ``ctx.idx_mapping_np[i]``."""
        if not self.slots:
            return logits
        slots = ctx.idx_mapping_np
        if logits.shape[0] != len(slots):
            raise RuntimeError(f"NMSTLogitsProcessor: {logits.shape[0]} logits rows for {len(slots)} requests "
                               "(speculative decoding's draft rows?): the head follows one row per request")
        V = logits.shape[1]
        groups: dict[HeadSettings, list[int]] = {}
        for row, slot in enumerate(slots.tolist()):
            entry = self.slots.get(slot)
            if entry is not None:
                groups.setdefault(entry[0], []).append(row)
        for settings, rows in groups.items():
            eos = settings.eos_token_id
            if eos is None or not 0 <= eos < V:
                log_once(self._warned, f"eos{eos}", f"eos_token_id {eos} outside [0, V={V}): the request decodes "
                         "plain softmax")
                continue
            temperatures = [self.slots[slot][1] for slot in slots[rows].tolist()]
            self._apply_group(logits, settings, rows, temperatures, ctx)
        return logits

    def _apply_group(self, logits: torch.Tensor, settings: HeadSettings, rows: list[int],
                     temperatures: list[float], ctx: Any) -> None:
        eos = settings.eos_token_id
        where = row_selection(rows, logits.device)
        block = logits[where]  # a view when contiguous, else a copy
        eos_logits = block[:, eos].clone()  # read before the exp pass masks the column
        lse = tempered_non_eos_lse(block, eos, inverse_temperatures(temperatures, block.device), self.buffer)
        prompt_len = self.prompt_len.gpu[ctx.idx_mapping[where]]
        steps = ctx.pos[where].to(torch.int64) + 2 - prompt_len.to(torch.int64)
        logits[where, eos], _ = device_eos_values(settings, lse, eos_logits, steps, temperatures)

