"""Language models with an NMST / ST / VA output head."""

from .recurrent import PAPER_CONFIGS, RecurrentLM

__all__ = ["PAPER_CONFIGS", "RecurrentLM"]
