"""The head under vLLM's V1 model runner: rows of the persistent batch, followed through vLLM's
``BatchUpdate`` records (removed, then added, then moved one-way or swapped), with ST's running sum
kept per request through moves, reused slots, preemption and re-entry."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from ...decoding.distribution import RowBuffer
from ...decoding.eos_column import (
    MAX_EOS_LOGIT_GAP,
    cpu_kernels,
    device_eos_values,
    host_eos_value,
    inverse_temperatures,
    tempered_non_eos_lse,
)
from .eos_column import log_once, row_selection, row_temperature
from .logprobs import warn_unrefused_logprobs
from .settings import HeadSettings, ModelInfo, request_settings


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


# On the CPU without the row kernels, a group of up to this many rows gets the head's scalars as Python
# floats (~1.5 µs a row), a larger one as float64 tensors (65–100 µs from 1 to 256 rows: some 30 small
# ops), measured with torch 2.13 on one thread under inference mode: equal near 45 rows.
HOST_SCALAR_ROWS = 48


@dataclass
class _Group:
    """The rows of one head setting in the batch (ascending batch index), as the batch's layout fixes
    them until it next changes: their requests, their index of the logits, T and 1/T per row."""

    settings: HeadSettings
    requests: list[_Request]
    where: Union[slice, torch.Tensor]
    temperatures: list[float]
    inverse: Optional[torch.Tensor]
    # For the CPU row kernels: the rows' indices (int64) and T per row (float64), CPU tensors.
    indices: torch.Tensor
    temperature_values: torch.Tensor


class PersistentBatchHead:
    """The V1 runner's side of :class:`~nmst_fast.integrations.vllm.NMSTLogitsProcessor`.

    On the CPU (``host_scalars``) values may be read (no sync) and ST's sums are floats: a group's L_T,
    per-row scalars and eos column are one call of the CPU row kernels (:mod:`nmst_fast.kernels.cpu`),
    or, where those are not built, torch ops for L_T and Python floats for the scalars of groups of up
    to ``HOST_SCALAR_ROWS`` rows (a few float operations per row cost less than some 30 small tensor
    ops), float64 tensors beyond. Elsewhere scalars and sums stay on the device, so a step makes no host
    sync. The grouping of rows is kept from one step to the next until the batch changes.
    """

    def __init__(self, model: ModelInfo, device: torch.device) -> None:
        self.model = model
        self.host_scalars = device.type == "cpu"
        self.rows: dict[int, _Request] = {}
        self.buffer = RowBuffer()
        self._layout: Optional[tuple[torch.Size, list[_Group]]] = None  # (logits' shape, groups)
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
        self._layout = None
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
            warn_unrefused_logprobs(self._warned, params, settings, self.model.logprobs_mode)
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
        if self._layout is None or self._layout[0] != logits.shape:
            self._layout = (logits.shape, self._groups(*logits.shape, logits.device))
        for group in self._layout[1]:
            self._apply_group(logits, group)
        return logits

    def _groups(self, B: int, V: int, device: torch.device) -> list[_Group]:
        """The batch's NMST/ST rows by head setting, and what the batch's layout fixes for them."""
        members: dict[HeadSettings, list[tuple[int, _Request]]] = {}
        for index, request in self.rows.items():
            if index < B and not request.lost:
                eos = request.settings.eos_token_id
                if eos is None or not 0 <= eos < V:
                    log_once(self._warned, f"eos{eos}",
                             f"eos_token_id {eos} outside [0, V={V}): the request decodes plain softmax")
                    continue
                members.setdefault(request.settings, []).append((index, request))
        groups = []
        for settings, rows in members.items():
            rows.sort(key=lambda row: row[0])
            temperatures = []
            for _, request in rows:
                params = request.params()
                temperatures.append(row_temperature(1.0 if params is None else float(params.temperature)))
            groups.append(_Group(settings, [request for _, request in rows],
                                 row_selection([index for index, _ in rows], device), temperatures,
                                 inverse_temperatures(temperatures, device),
                                 torch.tensor([index for index, _ in rows], dtype=torch.int64),
                                 torch.tensor(temperatures, dtype=torch.float64)))
        return groups

    def _apply_group(self, logits: torch.Tensor, group: _Group) -> None:
        """The eos column of one group's rows."""
        settings, requests, where, temperatures = group.settings, group.requests, group.where, group.temperatures
        eos = settings.eos_token_id
        steps = [len(request.output) + 1 for request in requests]
        st = settings.head == "st"
        kernels = cpu_kernels(logits) if self.host_scalars else None
        if kernels is not None:  # the CPU row kernels: L_T, the head's scalars and the write in one call
            before = _host_sums_before(requests, steps) if st else None
            after = kernels.write_eos_column(logits, group.indices, eos, group.temperature_values, torch.tensor(steps),
                                             before, settings.eps, MAX_EOS_LOGIT_GAP)
            if st:
                for request, t, value in zip(requests, steps, after.tolist()):
                    _record_sum(request, t, value)
            return
        rows = logits[where]  # a view when contiguous, else a copy
        if self.host_scalars and len(requests) <= HOST_SCALAR_ROWS:
            eos_logits = rows[:, eos].tolist()  # read before the exp pass may overwrite the column
            lse = tempered_non_eos_lse(rows, eos, group.inverse, self.buffer).tolist()
            values = []
            for request, t, temperature, L, s in zip(requests, steps, temperatures, lse, eos_logits):
                value, after = host_eos_value(settings, L, s, t, temperature,
                                              request.sums.get(t - 1, 0.0) if st else 0.0)
                if st:
                    _record_sum(request, t, after)
                values.append(s if value is None else value)
            _write_column(logits, where, eos, torch.tensor(values, dtype=logits.dtype))
            return
        eos_logits = rows[:, eos].clone()  # read before the exp pass may overwrite the column
        lse = tempered_non_eos_lse(rows, eos, group.inverse, self.buffer)
        before = None
        if st and self.host_scalars:  # the sums are floats where values may be read (the CPU)
            before = _host_sums_before(requests, steps)
        elif st:  # else 0-d tensors on the device
            zero = torch.zeros((), dtype=torch.float64, device=logits.device)
            before = torch.stack([request.sums.get(t - 1, zero) for request, t in zip(requests, steps)])
        logits[where, eos], after = device_eos_values(settings, lse, eos_logits, steps, temperatures, before)
        if after is not None:
            for request, t, value in zip(requests, steps, after.tolist() if self.host_scalars else after):
                _record_sum(request, t, value)


def _host_sums_before(requests: list[_Request], steps: list[int]) -> torch.Tensor:
    """(A,) float64 CPU tensor of ST's running sums (kept as floats) before each request's step t."""
    return torch.tensor([request.sums.get(t - 1, 0.0) for request, t in zip(requests, steps)], dtype=torch.float64)


def _write_column(logits: torch.Tensor, where: Union[slice, torch.Tensor], eos: int, column: torch.Tensor) -> None:
    """logits[where, eos] = column, through a view when ``where`` is a slice."""
    if isinstance(where, slice):
        logits.select(1, eos)[where].copy_(column)
    else:
        logits[where, eos] = column


def _record_sum(request: _Request, t: int, value) -> None:
    """ST's running sum after step t; a step that runs again (a partial prefill) overwrites its own
    entry, and only the entry before it is still needed."""
    request.sums[t] = value
    request.sums.pop(t - 2, None)
