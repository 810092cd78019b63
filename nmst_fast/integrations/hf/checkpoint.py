"""Saved models with a head: how transformers opens them, and the commands that convert other checkpoints.

What ``save_pretrained`` of a model with a head writes, and why plain tools refuse it, is
:mod:`nmst_fast.integrations.nmst_config`. Here:

* :func:`register_model_class` — ``AutoModelForCausalLM`` maps an NMST config class to its NMST model class
  (``from_pretrained`` then puts the recorded head on the loaded model);
* :class:`NMSTForCausalLM` — the name ``auto_map`` gives for ``trust_remote_code=True``;
* :func:`upgrade_checkpoint` — a directory saved by nmst-fast 0.1 (the base model's type, with an ``nmst`` entry
  that plain tools ignore) rewritten as the NMST checkpoint type (``nmst-fast upgrade``);
* :func:`export_plain` — an NMST checkpoint written as a plain base-model checkpoint, without the head, for those
  who want the weights alone (``nmst-fast export-plain``);
* :func:`with_recorded_head` — ``from_pretrained`` once ``nmst_fast`` is imported: a 0.1 checkpoint, or an NMST
  checkpoint opened through its base class, opens with its head too, with a warning saying what else to do.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..nmst_config import AUTO_MAP, MODEL_TYPE, STUB, NMSTConfig, NMSTConfigMixin, write_stub
from .patch import NMSTModelMixin, apply_nmst, has_head, model_class_for

__all__ = ["NMSTConfig", "NMSTForCausalLM", "export_plain", "register_model_class", "upgrade_checkpoint",
           "with_recorded_head"]

UPGRADE = "nmst-fast upgrade"


def register_model_class(config_class: type) -> None:
    """``AutoModelForCausalLM`` maps the NMST config class ``config_class`` to ``NMST<its base's causal LM>``."""
    base_config = next(c for c in config_class.__mro__
                       if issubclass(c, PreTrainedConfig) and not issubclass(c, NMSTConfigMixin))
    try:
        base = MODEL_FOR_CAUSAL_LM_MAPPING[base_config]
    except KeyError:
        raise ValueError(f"this NMST checkpoint's base model type {base_config.model_type!r} has no causal LM class "
                         "in this transformers") from None
    base = base[0] if isinstance(base, (list, tuple)) else base
    AutoModelForCausalLM.register(config_class, model_class_for(base, config_class), exist_ok=True)


class NMSTForCausalLM(PreTrainedModel):
    """``auto_map``'s model entry: ``from_pretrained`` / ``from_config`` open the NMST class of the config's base
    model through ``AutoModelForCausalLM`` (with ``trust_remote_code=True`` transformers may call it directly)."""

    config_class = NMSTConfig

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("trust_remote_code", None)
        return AutoModelForCausalLM.from_pretrained(*args, **kwargs)

    @classmethod
    def _from_config(cls, config: Any, **kwargs: Any) -> Any:
        return AutoModelForCausalLM.from_config(config, **kwargs)


def _read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json: not a saved model directory")
    return json.loads(path.read_text())


def _write_config(directory: Path, config: dict) -> None:
    """config.json replaced whole (a temporary file renamed over it)."""
    tmp = directory / f".config.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, directory / "config.json")


def upgrade_checkpoint(directory: str | os.PathLike) -> bool:
    """Rewrite a directory that nmst-fast 0.1 saved (``model_type`` the base's, an ``nmst`` entry beside it) as the
    NMST checkpoint type, in place: config.json (``model_type`` "nmst", ``base_model_type``,
    ``architectures`` "NMST<Class>", ``auto_map``) and ``nmst_checkpoint.py``; the weights are not touched.
    Returns False (and changes nothing) for a directory already of the NMST type; ValueError for one without a
    head."""
    directory = Path(directory)
    config = _read_config(directory)
    if config.get("model_type") == MODEL_TYPE:
        return False
    if not config.get("nmst"):
        raise ValueError(f"{directory}/config.json records no NMST head (no 'nmst' entry): not a model saved with a "
                         "head; put one on it with nmst_fast.integrations.hf.apply_nmst")
    config["base_model_type"] = config["model_type"]
    config["model_type"] = MODEL_TYPE
    config["architectures"] = [f"NMST{name}" for name in config.get("architectures") or []]
    config["auto_map"] = dict(AUTO_MAP)
    write_stub(directory)
    _write_config(directory, config)
    return True


def export_plain(directory: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the NMST checkpoint in ``directory`` to ``out`` as a plain checkpoint of its base model: the same
    weights and tokenizer, config.json with the base's ``model_type`` and ``architectures``. Every tool then
    loads it as the base model, whose next-token distribution is the softmax of its logits: NOT the head's, and
    with no termination guarantee. The head it had is kept for the record under ``nmst_head_removed``."""
    directory, out = Path(directory), Path(out)
    config = _read_config(directory)
    if config.get("model_type") != MODEL_TYPE:
        if config.get("nmst"):
            raise ValueError(f"{directory} was saved by nmst-fast 0.1: run `{UPGRADE} {directory}` first")
        raise ValueError(f"{directory} is not an NMST checkpoint (model_type {config.get('model_type')!r})")
    if out.exists():
        raise FileExistsError(f"{out} exists: export-plain writes a new directory")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(directory, tmp, ignore=shutil.ignore_patterns(STUB, "__pycache__"))
    config["model_type"] = config.pop("base_model_type")
    config["architectures"] = [name.removeprefix("NMST") for name in config.get("architectures") or []]
    config.pop("auto_map", None)
    config["nmst_head_removed"] = config.pop("nmst")
    _write_config(tmp, config)
    os.replace(tmp, out)
    return out


def with_recorded_head(cls: type, loaded: Any, where: Any) -> Any:
    """What ``cls.from_pretrained(where, ...)`` returned (``loaded``: a model, or (model, info)), with the head its
    config records put on it where its class does not carry it: a model nmst-fast 0.1 saved (its config records
    a head but names the base model's type, which opens as the base model), or an NMST checkpoint opened through
    its base class. Warns with what makes every tool see the head."""
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    if issubclass(cls, NMSTModelMixin) or not isinstance(model, PreTrainedModel) or has_head(model) \
            or not getattr(model.config, "nmst", None):
        return loaded
    if getattr(model.config, "base_model_type", None):
        advice = "open it with AutoModelForCausalLM, which opens it with its head wherever nmst_fast is imported"
    else:
        advice = (f"it was saved by nmst-fast 0.1 and opens as the plain base model wherever nmst_fast is not "
                  f"imported: `{UPGRADE} {where}` rewrites its config.json so that every tool sees the head or "
                  "refuses it")
    warnings.warn(f"{where}: {cls.__name__}.from_pretrained loaded a model whose config records an NMST head; it "
                  f"gets that head here; {advice}", UserWarning, stacklevel=3)
    apply_nmst(model)
    return loaded
