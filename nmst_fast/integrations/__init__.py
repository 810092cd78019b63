"""Integrations with other libraries: Hugging Face transformers (:mod:`.hf`), TRL (:mod:`.trl`), lm-eval
(:mod:`.lm_eval`) and vLLM (:mod:`.vllm`).

:func:`install_hooks` (run by ``import nmst_fast``) arranges for what must meet a library wherever a user imports
it to run when that library's module is imported (:mod:`.hooks`); nothing is imported now:

* transformers' ``AutoConfig`` knows the NMST checkpoint type (:mod:`.nmst_config`), and ``from_pretrained``
  puts the recorded head on a model whose class does not carry it (a checkpoint of nmst-fast 0.1, or an NMST
  checkpoint opened through its base class: :func:`.hf.checkpoint.with_recorded_head`);
* TRL's trainers score a model's head (:func:`.trl.wrap_trl_utils`);
* lm-eval's ``hf`` model refuses a model with a head, whose scores would be its base's softmax.
"""

from __future__ import annotations

import functools
import sys
import types

from .hooks import when_imported


def _register_model_class(config_class: type) -> None:
    from .hf.checkpoint import register_model_class

    register_model_class(config_class)


def _register_config(configuration_auto: types.ModuleType) -> None:
    from . import nmst_config

    nmst_config.register(model_registrar=_register_model_class)


def _wrap_from_pretrained(modeling_utils: types.ModuleType) -> None:
    model_class = modeling_utils.PreTrainedModel
    original = model_class.__dict__["from_pretrained"].__func__
    if getattr(original, "_nmst_wraps", None) is not None:
        return

    @functools.wraps(original)
    def from_pretrained(cls, *args, **kwargs):
        from .hf.checkpoint import with_recorded_head

        return with_recorded_head(cls, original(cls, *args, **kwargs), args[0] if args else "DIR")

    from_pretrained._nmst_wraps = original
    model_class.from_pretrained = classmethod(from_pretrained)


def _wrap_trl(utils: types.ModuleType) -> None:
    module = sys.modules.get(f"{__name__}.trl")
    if module is not None and not hasattr(module, "wrap_trl_utils"):
        return  # .trl itself is importing TRL: it wraps TRL's utils once it is done
    from .trl import wrap_trl_utils

    wrap_trl_utils(utils)


def _refuse_in_hflm(huggingface: types.ModuleType) -> None:
    hflm = huggingface.HFLM
    for name in ("_loglikelihood_tokens", "loglikelihood_rolling", "generate_until"):
        method = getattr(hflm, name)
        if getattr(method, "_nmst_wraps", None) is not None:
            continue

        def checked(self, *args, _method=method, **kwargs):
            from .hf.patch import has_head

            model = getattr(self, "_model", None)
            if has_head(model) and model._nmst_settings.head != "va" and not getattr(self, "scores_the_head", False):
                raise ValueError(f"lm-eval's '{getattr(self, 'backend', 'hf')}' model scores the softmax of a model's "
                                 "logits; this model carries an NMST / ST / VA head (nmst-fast), whose distribution "
                                 "is another: evaluate it with `--model nmst` (nmst-fast lm-eval run --model nmst "
                                 "--model_args pretrained=DIR ...)")
            return _method(self, *args, **kwargs)

        functools.update_wrapper(checked, method)
        checked._nmst_wraps = method
        setattr(hflm, name, checked)


def install_hooks() -> None:
    """The import hooks above (idempotent)."""
    when_imported("transformers.models.auto.configuration_auto", _register_config)
    when_imported("transformers.modeling_utils", _wrap_from_pretrained)
    when_imported("trl.trainer.utils", _wrap_trl)
    when_imported("lm_eval.models.huggingface", _refuse_in_hflm)
