"""What the vLLM processor adds to the shared eos column (:mod:`nmst_fast.decoding.eos_column`): vLLM's greedy
rows, row selections of a batch, and its log."""

from __future__ import annotations

import logging
from typing import Union

import torch

from ...decoding.eos_column import host_to_device

logger = logging.getLogger("nmst_fast.integrations.vllm")

# vLLM samples greedily below this temperature (vllm.v1.sample.sampler._SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5


def row_temperature(temperature: float) -> float:
    """The T a row's non-eos logits are divided by: vLLM's temperature, 1 for its greedy rows (T = 0)."""
    return 1.0 if temperature < GREEDY_TEMPERATURE else float(temperature)


def row_selection(rows: list[int], device: torch.device) -> Union[slice, torch.Tensor]:
    """Batch rows ``rows`` (ascending) as an index of the logits: a slice when they are contiguous (the
    rows are then a view), else an index tensor on ``device`` (a copy)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return host_to_device(rows, torch.int64, device)


def log_once(seen: set, key: str, message: str) -> None:
    """Log ``message`` as an error the first time ``key`` is met (``seen`` holds the keys met)."""
    if key not in seen:
        seen.add(key)
        logger.error("NMSTLogitsProcessor: %s", message)


