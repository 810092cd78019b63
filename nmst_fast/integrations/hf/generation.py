"""Decoding a Hugging Face causal LM's head.

* :func:`generate_with_head` — what ``generate()`` of a model with a head runs (``pipeline("text-generation")``
  too): HF's own generation, whose logits at each step carry the head's exact step distribution.
* :class:`HFDecoder` — the model under :func:`nmst_fast.generate` (greedy, top-k, nucleus, beam).

How HF generation decodes the head: while ``generate()`` runs, each forward's last-position logits get the
eos entry T·ζ_eos (:mod:`nmst_fast.decoding.eos_column`; the other entries stay the model's logits), for the
step t (1 at the first generated token) and the temperature T of the call. Every later stage of HF's generation
then acts on the head's distribution: its temperature division gives back ζ / T, whose softmax is the head at T
(temperature divides the non-eos logits only, so p(eos) — the termination guarantee — does not move); top-k,
top-p, min-p truncate it; greedy takes its argmax; beam search ranks its log-softmax, which is the head's
log-probability. Logits processors (repetition penalty, ``min_new_tokens``' ban of eos, …) act on it as on any
model's logits. ``output_logits=True`` returns these logits (the model's own but for the eos entry);
``output_scores=True`` the processed scores, as for any model.

Modes: greedy, sampling and beam search (with or without sampling) for "nmst" and "va"; greedy and sampling for
"st" (its running sum follows each row, and beam search reorders rows). The others — assisted or
prompt-lookup decoding, DoLa, contrastive, group and constrained beam search, a custom ``generate``, chunked
prefill — raise a ValueError naming the mode before any step runs.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable, Optional

import torch
from torch import nn
from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode

from ...decoding.distribution import RowBuffer
from ...decoding.eos_column import write_eos_column
from ...settings import HeadSettings
from .settings import nmst_settings, stop_token_ids
from .structure import decoder_stack, last_hidden_state, output_head

_FOLLOWED = {"nmst": (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH,
                      GenerationMode.BEAM_SAMPLE),
             "st": (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)}


class GenerationState:
    """One ``generate()`` call of a model with a head: the head, the temperature T its sampling divides by, the
    step t of the next forward (1 at the prefill), ST's running sums, and one reused row buffer."""

    def __init__(self, settings: HeadSettings, temperature: float) -> None:
        self.settings, self.temperature = settings, temperature
        self.step = 1
        self.sums: Optional[torch.Tensor] = None
        self.buffer = RowBuffer()


def step_logits(out: Any, generation: GenerationState) -> Any:
    """``out``'s last-position logits with the head's eos entry for the generation's step (in place; half-precision
    logits come back as float32 at the last position alone, so that the eos entry is not rounded). Each forward
    of a ``generate()`` call is one step."""
    logits = out.logits
    if logits is None or generation.settings.head == "va":
        generation.step += 1
        return out
    if logits.dtype not in (torch.float32, torch.float64):
        out.logits = logits = logits[:, -1:].float()
    generation.sums = write_eos_column(logits[:, -1], generation.settings, generation.step, generation.temperature,
                                       generation.sums, generation.buffer)
    generation.step += 1
    return out


def _generation_config(model: Any, kwargs: dict) -> GenerationConfig:
    """The generation config a ``generate(**kwargs)`` call runs with: its ``generation_config`` (else the model's),
    updated with the call's keyword arguments."""
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config or GenerationConfig())
    config.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
    return config


def generate_with_head(model: Any, generate: Callable, *args: Any, **kwargs: Any) -> Any:
    """``generate(*args, **kwargs)`` (HF's, bound to ``model``) decoding ``model``'s head (module docstring)."""
    settings: HeadSettings = model._nmst_settings
    config = _generation_config(model, kwargs)
    mode = config.get_generation_mode(kwargs.get("assistant_model"))
    if settings.head != "va" and mode not in _FOLLOWED[settings.head]:
        raise ValueError(f"head {settings.head!r}: generate() in mode {mode.value!r} cannot decode the head (it "
                         f"follows {', '.join(m.value for m in _FOLLOWED[settings.head])}"
                         + ("; ST's running sum follows each row, which beam search reorders" if settings.head == "st"
                            else "") + ")")
    for name in ("custom_generate", "prefill_chunk_size"):
        if kwargs.get(name) is not None or getattr(config, name, None) is not None:
            raise ValueError(f"head {settings.head!r}: generate() with {name} cannot decode the head: each forward "
                             "of the call must be one step")
    temperature = float(config.temperature or 1.0) if config.do_sample else 1.0
    previous = model.__dict__.get("_nmst_generation")
    model._nmst_generation = GenerationState(settings, temperature)
    try:
        if hasattr(config, "disable_compile"):  # the head's step runs eagerly: a compiled forward would replay t
            kwargs.setdefault("disable_compile", True)
        return generate(*args, **kwargs)
    finally:
        model._nmst_generation = previous


class HFDecoder(nn.Module):
    """The :class:`nmst_fast.generation.DecodingModel` protocol over any HF causal LM.

    The head is the model's own output layer (tied weight and bias, the config's softcap and
    scale), so ``head="va"`` decodes exactly what the model itself would. The KV cache is HF's
    ``Cache``: rows are reordered and dropped with its ``reorder_cache``. Generation stops on every
    eos id the config lists (:attr:`stop_token_ids`); the head terminates with its own eos.

    Args:
        model: a transformers ``…ForCausalLM``.
        head, eps, eos_token_id: as :func:`apply_nmst`; None takes what ``model.config.nmst``
            recorded, else "nmst", 1e-5 and the config's eos. A value that contradicts the recorded
            one raises ValueError.
    """

    def __init__(self, model: Any, *, head: Optional[str] = None, eps: Optional[float] = None,
                 eos_token_id: Optional[int] = None) -> None:
        super().__init__()
        settings = nmst_settings(model, head=head, eps=eps, eos_token_id=eos_token_id)
        self.model = model
        self.nmst_head = output_head(model, settings)
        self.stop_token_ids = stop_token_ids(model, settings.eos_index)
        self._stack = decoder_stack(model)
        parameters = inspect.signature(self._stack.forward).parameters
        # transformers renamed the KV-cache argument (past_key_values -> cache); use what this version takes.
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"

    @property
    def max_positions(self) -> Optional[int]:
        """Context plus fed tokens the model can attend over, where it has a learned position table
        (GPT-2's ``n_positions``, OPT's ``max_position_embeddings``): ``generate`` checks
        ``max_length`` against it. None for rotary / relative positions, which have no hard limit."""
        config = self.model.config.get_text_config()
        if getattr(config, "n_positions", None) is not None:
            return int(config.n_positions)
        embeddings = self.model.get_input_embeddings()
        learned = any(isinstance(m, nn.Embedding) and m is not embeddings for m in self._stack.modules())
        return int(config.max_position_embeddings) if learned else None

    @staticmethod
    def _returned_cache(out: Any) -> Any:
        # transformers 5 renamed the output field too; reading the old name there warns on every step.
        return out["cache"] if "cache" in out.keys() else out.past_key_values

    def prefill(self, contexts: torch.Tensor) -> tuple[torch.Tensor, Any]:
        out = self._stack(input_ids=contexts, use_cache=True)
        return last_hidden_state(out)[:, -1], self._returned_cache(out)

    def decode_step(self, tokens: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        out = self._stack(input_ids=tokens[:, None], use_cache=True, **{self._cache_arg: cache})
        return last_hidden_state(out)[:, -1], self._returned_cache(out)

    def select_cache(self, cache: Any, index: torch.Tensor) -> Any:
        cache.reorder_cache(index)
        return cache
