"""The NMST checkpoint type: how a saved model says that it carries a head, and how transformers finds the code.

A model with a head is saved with ``model_type: "nmst"``, its base model's type as ``base_model_type`` (the
base's own keys beside it), the head in ``nmst`` (:class:`~nmst_fast.settings.HeadSettings`),
``architectures: ["NMST<BaseClass>"]`` and an ``auto_map`` naming ``nmst_checkpoint.py``, a two-line file saved
beside config.json that imports this package. So every tool that picks code by ``model_type`` or
``architectures`` and does not know the head refuses the directory instead of decoding the base model's softmax
(transformers without this package, vLLM without its plugin, llama.cpp's converter, mlx-lm).

transformers finds the code two ways: ``import nmst_fast`` registers ``"nmst"`` with ``AutoConfig`` (from the
moment transformers' auto classes are imported: :mod:`nmst_fast.integrations.hooks`); or
``trust_remote_code=True`` runs ``nmst_checkpoint.py``, whose import of this package does the same (and fails
with "pip install nmst_fast" where the package is missing). Without either, transformers refuses the directory
and asks for ``trust_remote_code=True``.

This module imports only transformers' configuration code: it runs while transformers' auto classes are being
imported. :class:`NMSTConfig` turns a config dict into the config class of its base type with the NMST mixin
(``NMSTLlamaConfig`` for a Llama): a subclass of the base's own class, so code written for the base model (vLLM's
model classes among it) reads every key as before.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable, Optional

from transformers.configuration_utils import PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

MODEL_TYPE = "nmst"
STUB = "nmst_checkpoint.py"
AUTO_MAP = {"AutoConfig": "nmst_checkpoint.NMSTConfig", "AutoModelForCausalLM": "nmst_checkpoint.NMSTForCausalLM"}
STUB_TEXT = '''"""This model carries an NMST / ST / VA head (nmst-fast): its next-token distribution is not its base
model's softmax. Open it with nmst-fast installed (pip install nmst-fast): `import nmst_fast` before
`from_pretrained`, or pass `trust_remote_code=True`, which runs this file. `nmst-fast export-plain` writes the
weights as a plain base-model checkpoint, without the head."""

from nmst_fast.integrations.hf.checkpoint import NMSTConfig, NMSTForCausalLM  # noqa: F401
'''


class NMSTConfigMixin:
    """What a base config class gets as an NMST one: ``model_type`` "nmst", and a saved directory that carries
    ``nmst_checkpoint.py`` beside config.json (what ``auto_map`` names)."""

    model_type = MODEL_TYPE

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        self.auto_map = dict(AUTO_MAP)
        super().save_pretrained(save_directory, *args, **kwargs)
        write_stub(Path(save_directory))


def write_stub(directory: Path) -> None:
    """``nmst_checkpoint.py`` in ``directory`` (what config.json's ``auto_map`` names)."""
    (directory / STUB).write_text(STUB_TEXT)


@functools.cache
def config_class_for(base: type) -> type:
    """The NMST config class over the config class ``base`` (``NMSTLlamaConfig`` over ``LlamaConfig``), named in
    this module so that pickling finds it (:func:`__getattr__`)."""
    if issubclass(base, NMSTConfigMixin):
        return base
    name = f"NMST{base.__name__}"
    cls = type(name, (NMSTConfigMixin, base), {"__module__": __name__, "__qualname__": name})
    return cls


def base_config_class(model_type: str) -> type:
    """transformers' config class for ``model_type`` (a ValueError naming it where this transformers has none)."""
    try:
        return CONFIG_MAPPING[model_type]
    except KeyError:
        raise ValueError(f"this NMST checkpoint's base model type {model_type!r} is unknown to this transformers "
                         "(a newer model type: upgrade transformers)") from None


class NMSTConfig(PreTrainedConfig):
    """The ``"nmst"`` entry of ``AutoConfig``: a config dict of that type becomes an instance of its base type's
    NMST config class (:func:`config_class_for`), with the head in ``nmst`` and the base type in
    ``base_model_type``. Not instantiated itself."""

    model_type = MODEL_TYPE

    def __init__(self, **kwargs: Any) -> None:
        raise TypeError("NMSTConfig is AutoConfig's entry for saved NMST models; build a model's config with its "
                        "base type's class and put the head on the model with nmst_fast.integrations.hf.apply_nmst")

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs: Any) -> PreTrainedConfig:
        base_type = config_dict.get("base_model_type")
        if not base_type:
            raise ValueError("this config.json has model_type 'nmst' but no base_model_type: it was not written by "
                             "nmst-fast's save_pretrained")
        nmst_class = config_class_for(base_config_class(base_type))
        if _MODEL_REGISTRAR is not None:  # AutoModelForCausalLM then finds the model class for it
            _MODEL_REGISTRAR(nmst_class)
        return nmst_class.from_dict(config_dict, **kwargs)


_MODEL_REGISTRAR: Optional[Callable[[type], None]] = None


def register(model_registrar: Callable[[type], None]) -> None:
    """``AutoConfig`` knows ``"nmst"`` (idempotent); ``model_registrar(config_class)`` maps each NMST config class
    made from a config dict to its model class in ``AutoModelForCausalLM``
    (:func:`nmst_fast.integrations.hf.checkpoint.register_model_class`, passed in by
    :func:`nmst_fast.integrations.install_hooks`: the model side imports this module, not the other way)."""
    global _MODEL_REGISTRAR
    _MODEL_REGISTRAR = model_registrar
    CONFIG_MAPPING.register(MODEL_TYPE, NMSTConfig, exist_ok=True)


def __getattr__(name: str) -> type:
    """``NMST<BaseConfig>`` classes by name, made on demand: unpickling a config (vLLM's processes) finds them."""
    if name.startswith("NMST") and name != "NMSTConfig":
        base = name[len("NMST"):]
        for model_type, class_name in CONFIG_MAPPING_NAMES.items():
            if class_name == base:
                return config_class_for(CONFIG_MAPPING[model_type])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
