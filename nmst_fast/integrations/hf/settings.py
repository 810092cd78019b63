"""Which head a Hugging Face model carries: what the caller gives, what its config records, its eos ids."""

from __future__ import annotations

import numbers
from typing import Any, Optional

from ...settings import HeadSettings
from .structure import check_causal_lm

DEFAULTS = dict(head="nmst", eps=1e-5, context_length=None)


def recorded_settings(model: Any) -> dict:
    """The head ``model.config.nmst`` records (written by ``apply_nmst``, kept by ``save_pretrained``); {} if none."""
    return dict(getattr(model.config, "nmst", None) or {})


def resolve_eos(model: Any, eos_token_id: Optional[int], recorded: Optional[int], vocab_size: int) -> int:
    """The NMST eos: the argument, else what the config recorded, else the model's single eos id."""
    if eos_token_id is not None and recorded is not None and eos_token_id != recorded:
        raise ValueError(f"the model was trained with eos_token_id={recorded}; refusing eos_token_id={eos_token_id}")
    eos = eos_token_id if eos_token_id is not None else recorded
    if eos is None:
        configured = model.config.get_text_config().eos_token_id
        if configured is None:
            configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if isinstance(configured, (list, tuple)):
            if len(configured) != 1:
                raise ValueError(f"{type(model).__name__}'s config lists several eos ids {list(configured)}: pass "
                                 "eos_token_id= to pick the one the NMST head terminates with (generation "
                                 "still stops on every id of the list)")
            configured = configured[0]
        if configured is None:
            raise ValueError(f"{type(model).__name__}'s config has no eos_token_id: pass eos_token_id=")
        eos = configured
    if isinstance(eos, bool) or not isinstance(eos, numbers.Integral):
        raise TypeError(f"eos_token_id must be an int, got {type(eos).__name__}")
    if not 0 <= int(eos) < vocab_size:
        raise ValueError(f"eos_token_id must lie in [0, V={vocab_size}) (the output layer's rows), got {eos}")
    return int(eos)


def stop_token_ids(model: Any, eos: int) -> tuple[int, ...]:
    """Every id that ends a generation: the NMST eos and the config's other eos ids (Llama 3 lists several)."""
    ids = [eos]
    for source in (model.config.get_text_config(), getattr(model, "generation_config", None)):
        listed = getattr(source, "eos_token_id", None)
        for i in ([listed] if isinstance(listed, int) else list(listed or [])):
            if i not in ids:
                ids.append(int(i))
    return tuple(ids)


def nmst_settings(model: Any, *, head: Optional[str] = None, eps: Optional[float] = None,
                  context_length: Optional[int] = None, eos_token_id: Optional[int] = None) -> HeadSettings:
    """The head settings to use: what the caller gave, else what ``model.config.nmst`` recorded
    (kept by ``save_pretrained``), else head "nmst", ε 1e-5 and no fixed context.
    A value that contradicts the recorded one raises ValueError: a model trained as NMST is never
    silently scored as another head."""
    layer = check_causal_lm(model)
    recorded = recorded_settings(model)
    given = {k: v for k, v in dict(head=head, eps=eps, context_length=context_length).items() if v is not None}
    clash = {k: (recorded[k], v) for k, v in given.items() if k in recorded and recorded[k] != v}
    if clash:
        raise ValueError(f"the model was trained with {', '.join(f'{k}={a!r}' for k, (a, _) in clash.items())}; "
                         f"refusing to use {', '.join(f'{k}={b!r}' for k, (_, b) in clash.items())}")
    chosen = {**DEFAULTS, **{k: v for k, v in recorded.items() if k in DEFAULTS}, **given}
    context = chosen["context_length"]
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 0):
        raise ValueError(f"context_length must be None or an int >= 0, got {context!r}")
    eos = resolve_eos(model, eos_token_id, recorded.get("eos_token_id"), layer.weight.shape[0])
    return HeadSettings(head=chosen["head"], eps=chosen["eps"], eos_token_id=eos, context_length=context)
