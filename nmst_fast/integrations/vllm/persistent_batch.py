"""The head under vLLM's V1 model runner: rows of the persistent batch, followed through vLLM's
``BatchUpdate`` records (removed, then added, then moved one-way or swapped), with ST's running sum
kept per request through moves, reused slots, preemption and re-entry."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from .eos_column import (
    RowBuffer,
    device_eos_values,
    host_eos_value,
    inverse_temperatures,
    log_once,
    row_selection,
    row_temperature,
    tempered_non_eos_lse,
)
from .settings import HeadSettings, _ModelInfo, request_settings


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


class PersistentBatchHead:
    """The V1 runner's side of :class:`~nmst_fast.integrations.vllm.NMSTLogitsProcessor`.

    On the CPU the head's per-row scalars are Python floats (reading a CPU tensor is no sync, and a few
    float operations per row cost less than a dozen small tensor launches); elsewhere they stay on the
    device (``host_scalars`` False), so a step makes no host sync.
    """

    def __init__(self, model: _ModelInfo, device: torch.device) -> None:
        self.model = model
        self.host_scalars = device.type == "cpu"
        self.rows: dict[int, _Request] = {}
        self.buffer = RowBuffer()
        # Requests that left the batch (finished, preempted or not scheduled), by id of their
        # SamplingParams, until those are freed: an ST request that re-enters finds its sum here.
        self._detached: dict[int, list[_Request]] = {}
        self._warned: set[str] = set()

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
        if batch_update is None:
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
                log_once(self._warned, str(err), f"{err}; the request decodes plain softmax")
                continue
            if settings is None:
                continue
            request = self._reattach(index, params, output) if settings.head == "st" and output else None
            if request is None:
                request = _Request(settings, weakref.ref(params), output)
                if settings.head == "st" and len(output) > 0:
                    request.lost = True
                    log_once(self._warned, "st-lost", "an ST request re-entered the batch with its running sum "
                             "unknown: it decodes its logits unchanged from now on")
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

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Write T·ζ_eos into the eos column of every NMST/ST row of ``logits`` (B, V) float32, in place."""
        if not self.rows:
            return logits
        B, V = logits.shape
        groups: dict[HeadSettings, list[tuple[int, _Request]]] = {}
        for index, request in self.rows.items():
            if index < B and not request.lost:
                eos = request.settings.eos_token_id
                if not 0 <= eos < V:
                    log_once(self._warned, f"eos{eos}",
                             f"eos_token_id {eos} outside [0, V={V}): the request decodes plain softmax")
                    continue
                groups.setdefault(request.settings, []).append((index, request))
        for settings, members in groups.items():
            self._apply_group(logits, settings, sorted(members, key=lambda m: m[0]))
        return logits

    def _apply_group(self, logits: torch.Tensor, settings: HeadSettings,
                     members: list[tuple[int, _Request]]) -> None:
        """The eos column of the rows ``members`` (batch index, request), which share ``settings``."""
        eos = settings.eos_token_id
        where = row_selection([index for index, _ in members], logits.device)
        rows = logits[where]  # a view when contiguous, else a copy
        temperatures = []
        for _, request in members:
            params = request.params()
            temperatures.append(row_temperature(1.0 if params is None else float(params.temperature)))
        steps = [len(request.output) + 1 for _, request in members]
        eos_logits = rows[:, eos].clone()  # read before the exp pass masks the column
        lse = tempered_non_eos_lse(rows, eos, inverse_temperatures(temperatures, rows.device), self.buffer)
        if self.host_scalars:
            values = []
            for (_, request), t, temperature, L, s in zip(members, steps, temperatures, lse.tolist(),
                                                         eos_logits.tolist()):
                value, after = host_eos_value(settings, L, s, t, temperature, request.sums.get(t - 1, 0.0))
                if settings.head == "st":
                    request.sums[t] = after  # a step that runs again (partial prefill) overwrites its own entry
                    request.sums.pop(t - 2, None)
                values.append(s if value is None else value)
            logits[where, eos] = torch.tensor(values, dtype=torch.float64).to(dtype=logits.dtype)
            return
        zero = torch.zeros((), dtype=torch.float64, device=logits.device)
        before = None if settings.head != "st" else \
            torch.stack([request.sums.get(step - 1, zero) for (_, request), step in zip(members, steps)])
        logits[where, eos], after = device_eos_values(settings, lse, eos_logits, steps, temperatures, before)
        if after is not None:
            for k, ((_, request), step) in enumerate(zip(members, steps)):
                request.sums[step] = after[k]  # a step that runs again (partial prefill) overwrites its own entry
                request.sums.pop(step - 2, None)
