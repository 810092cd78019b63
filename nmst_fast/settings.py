"""One head's settings: which head, its ε, its eos token and the training context.

:class:`HeadSettings` is the one type every part of the library passes a head around in: the fused op's
per-call configuration holds one, the Hugging Face patch records one in ``config.json`` (``config.nmst``),
TRL, lm-eval and vLLM read it back from there.
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

from .validation import HEADS, check_choice, check_eps

RECORDED_KEYS = ("head", "eps", "context_length", "eos_token_id")


@dataclass(frozen=True)
class HeadSettings:
    """A head: ``head`` "nmst" | "st" | "va", ``eps`` ε in (0, 1) (unused by "va"), ``eos_token_id`` the token
    it terminates with (None where it is not known yet: a vLLM request admitted before the engine's config is
    read), and ``context_length``: a fixed number of context tokens per sequence (t = position − context_length
    + 1, the paper's setup) or None (t from the labels). Checked on construction (ValueError / TypeError naming
    the field); hashable, so requests can be grouped by it."""

    head: str
    eps: float
    eos_token_id: Optional[int]
    context_length: Optional[int] = None

    def __post_init__(self) -> None:
        check_choice("head", self.head, HEADS)
        check_eps(self.eps)
        for name in ("eos_token_id", "context_length"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                                      or value < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
        object.__setattr__(self, "eps", float(self.eps))

    @property
    def eos_index(self) -> int:
        """The eos token as a vocabulary index (the kernels' name for it)."""
        if self.eos_token_id is None:
            raise ValueError("the head's eos_token_id is not known")
        return self.eos_token_id

    def recorded(self) -> dict[str, Any]:
        """The entry a model's config records (``config.nmst``; JSON-serializable)."""
        return {key: value for key, value in asdict(self).items() if key in RECORDED_KEYS}

    @classmethod
    def from_recorded(cls, entry: Mapping[str, Any]) -> "HeadSettings":
        """The settings a config's ``nmst`` entry records (unknown keys ignored)."""
        if not isinstance(entry, Mapping) or "head" not in entry:
            raise ValueError(f"a recorded head needs at least 'head', got {entry!r}")
        return cls(head=entry["head"], eps=entry.get("eps", 1e-5), eos_token_id=entry.get("eos_token_id"),
                   context_length=entry.get("context_length"))
