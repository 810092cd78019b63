"""What a training run is: the model, the head and the paper's optimization recipe."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from nmst_fast import termination_bound
from nmst_fast.models.recurrent import PAPER_CONFIGS
from nmst_fast.validation import HEADS, check_eps

# Model sizes by name: "paper" is the paper's WikiText-2 setup; the small ones fit this CPU.
SIZES = {
    "paper": {},
    "small": dict(embedding_dim=128, hidden_size=128, num_layers=2, dropout=0.3),
    "tiny": dict(embedding_dim=32, hidden_size=32, num_layers=1, dropout=0.0),
}


@dataclass
class TrainConfig:
    """One model's training run (the paper's recipe by default: AdamW, LR halving, early stop)."""

    arch: str = "lstm"
    head: str = "nmst"
    eps: float = 1e-2
    size: str = "small"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.01
    batch_size: int = 32
    max_epochs: int = 70
    patience: int = 10  # stop after this many epochs without a better validation perplexity
    clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    extra: dict = field(default_factory=dict)  # free-form notes stored with the checkpoint

    def validate(self) -> "TrainConfig":
        """Raise ValueError naming the bad field (before any data is read or model built)."""
        if self.arch not in PAPER_CONFIGS:
            raise ValueError(f"unknown arch {self.arch!r}: choose one of {sorted(PAPER_CONFIGS)}")
        if self.head not in HEADS:
            raise ValueError(f"unknown head {self.head!r}: choose one of {list(HEADS)}")
        check_eps(self.eps)
        if self.size not in SIZES:
            raise ValueError(f"unknown size {self.size!r}: choose one of {list(SIZES)}")
        for name in ("lr", "clip"):
            if not (isinstance(getattr(self, name), (int, float)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)!r}")
        for name in ("batch_size", "max_epochs", "patience"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        return self

    def model_kwargs(self) -> dict:
        kwargs = dict(SIZES[self.size])
        if self.arch == "rnn" and kwargs:  # the tied tanh-RNN needs hidden == embedding
            kwargs["hidden_size"] = kwargs["embedding_dim"]
        return kwargs

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        data = dict(data)
        data["betas"] = tuple(data["betas"])
        return cls(**data)

    @property
    def greedy_bound(self) -> Optional[int]:
        """t½ for NMST (greedy must stop by it), None for the other heads."""
        return termination_bound(self.eps) if self.head == "nmst" else None
