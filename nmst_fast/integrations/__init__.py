"""Integrations with other libraries: Hugging Face transformers (:mod:`.hf`), TRL (:mod:`.trl`), lm-eval
(:mod:`.lm_eval`) and vLLM (:mod:`.vllm`).

:func:`install_hooks` (run by ``import nmst_fast``) arranges for the integrations that must meet a library
wherever a user imports it to run when that library is imported (:mod:`.hooks`); nothing is imported now.
"""

from __future__ import annotations

import sys
import types

from .hooks import when_imported


def _wrap_trl(utils: types.ModuleType) -> None:
    module = sys.modules.get(f"{__name__}.trl")
    if module is not None and not hasattr(module, "wrap_trl_utils"):
        return  # .trl itself is importing TRL: it wraps TRL's utils once it is done
    from .trl import wrap_trl_utils

    wrap_trl_utils(utils)


def install_hooks() -> None:
    """TRL's trainers score a patched model's head (:func:`nmst_fast.integrations.trl.wrap_trl_utils`) from
    the moment ``trl.trainer.utils`` is imported."""
    when_imported("trl.trainer.utils", _wrap_trl)
