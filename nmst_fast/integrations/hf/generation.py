"""Decoding a Hugging Face causal LM's head.

* :class:`HFDecoder` — the model under :func:`nmst_fast.generate` (greedy, top-k, nucleus, beam).
* :class:`NMSTLogitsProcessor` — HF ``generate()`` greedy / sampling on the head's distribution.
* :func:`step_distribution` — the patched forward's last-position logits as the head's step log-probabilities,
  for HF ``generate()`` in every mode (``apply_nmst(generation_logits=True)``).
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any, Optional

import torch
from torch import nn
from transformers import LogitsProcessor

from ...decoding import step_log_probs
from ...settings import HeadSettings
from ...validation import HEADS, check_choice, check_eps
from .settings import nmst_settings, stop_token_ids
from .structure import decoder_stack, last_hidden_state, output_head


def step_distribution(out: Any, settings: HeadSettings, prompt: dict, cache: Any, new_tokens: int,
                      temperature: float) -> Any:
    """``out``'s last-position logits replaced by T · the head's step log-probabilities at temperature T (HF's
    sampling divides them by T, which gives back the head's p_T). ``prompt`` holds the generation in progress
    (its prompt's length, ST's state), set at its prefill: a call without a cache scores the token after its
    input (t = 1), as a prefill does; with one, the cache already holds this call's tokens."""
    total = new_tokens if cache is None else cache.get_seq_length()
    if total == new_tokens:  # prefill: a new generation starts
        prompt["length"], prompt["state"] = total, None
    t = total - prompt["length"] + 1
    log_p, prompt["state"] = step_log_probs(out.logits[:, -1], head=settings.head, eos_index=settings.eos_index,
                                            eps=settings.eps, steps=t, state=prompt["state"],
                                            temperature=temperature)
    out.logits[:, -1] = (log_p * temperature).to(out.logits.dtype)
    return out


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


class NMSTLogitsProcessor(LogitsProcessor):
    """Turn a model's logits into the NMST / ST log-distribution inside HF ``generate()``.

    Greedy search and sampling (with HF's top-k / top-p, which run after custom processors)
    then decode the head's exact step distribution; t = 1 at the first generated token.
    Keep HF's ``temperature`` at 1 (it would scale eos too); pass ``temperature`` here, which
    divides non-eos logits only. HF beam search hands processors log-softmaxed scores, which
    have lost the raw eos logit the head needs: that is detected and refused — decode beams with
    ``apply_nmst(model, generation_logits=True)`` (HF beam search then sees the NMST
    log-probabilities as the model's logits) or ``nmst_fast.generate(HFDecoder(model, head=...),
    strategy="beam")``. ST keeps its running state per row, so rows must not be reordered between
    steps (checked).

    One instance may serve several ``generate()`` calls: a call continues the previous step only
    when it holds the same rows grown by one token; any other shape starts a new generation at
    t = 1. The one ambiguous case — the same batch size and one token longer, but other prefixes
    (rows reordered, or a new prompt exactly one token longer than the last sequences) — raises;
    :meth:`reset` before a new ``generate()`` call avoids it.
    """

    def __init__(self, *, eos_token_id: int, head: str = "nmst", eps: float = 1e-5, temperature: float = 1.0):
        check_choice("head", head, HEADS)
        check_eps(eps)
        if isinstance(eos_token_id, bool) or not isinstance(eos_token_id, numbers.Integral):
            raise TypeError(f"eos_token_id must be one int (the head's eos; HF stops on every id of its own "
                            f"eos list), got {type(eos_token_id).__name__}")
        self.eos, self.head, self.eps, self.temperature = int(eos_token_id), head, eps, temperature
        self._prompt_length: Optional[int] = None
        self._state: Optional[torch.Tensor] = None
        self._previous: Optional[torch.Tensor] = None

    def reset(self) -> None:
        """Forget the generation in progress: the next call is step t = 1 of a new one."""
        self._prompt_length, self._state, self._previous = None, None, None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        previous = self._previous
        grown = previous is not None and input_ids.shape[0] == previous.shape[0] and \
            input_ids.shape[1] == previous.shape[1] + 1
        if grown and not torch.equal(input_ids[:, :-1], previous):
            raise ValueError("NMSTLogitsProcessor: the rows changed between consecutive steps — HF reordered "
                             "them (the head's step and ST's running state follow each row), or a new generate() "
                             "call began with prompts one token longer than the last sequences: call reset() "
                             "before reusing a processor")
        if not grown:  # a new generate() call: t = 1 at its first generated token
            self._prompt_length, self._state = input_ids.shape[1], None
        # HF runs its own processors first. min_new_tokens / min_length / suppress_tokens ban eos
        # (score −inf), which the head would read as a logit making p(eos) = α_t > 0 (NMST) or 1
        # (ST); forced_eos_token_id leaves eos the only finite score. A ban keeps eos at 0 and
        # renormalizes the rest, a force keeps eos at 1; ST, whose running sum needs every step's
        # real eos logit, refuses a ban.
        banned = forced = None
        if 0 <= self.eos < scores.shape[-1]:
            eos_score = scores[:, self.eos]
            banned = eos_score == float("-inf")
            others = scores.index_fill(-1, torch.tensor([self.eos], device=scores.device), float("-inf"))
            forced = torch.isfinite(eos_score) & (others.amax(dim=-1) == float("-inf"))
        free = None if forced is None else ~forced
        if torch.allclose(torch.logsumexp(scores[free].double(), dim=-1), torch.zeros((), dtype=torch.float64),
                          atol=1e-4) and (free is None or bool(free.any())):
            raise ValueError("NMSTLogitsProcessor got normalized log-probs (HF beam search): the raw eos logit "
                             "is gone; use apply_nmst(model, generation_logits=True) without the processor, "
                             "or nmst_fast.generate(HFDecoder(model, head=...), strategy='beam')")
        if banned is not None and self.head == "st" and bool(banned.any()):
            raise ValueError("NMSTLogitsProcessor: eos arrives as -inf (HF's min_new_tokens / min_length / "
                             "suppress_tokens ran first and banned it); head 'st' needs the raw eos logit at every "
                             "step for its running sum: drop those options, or decode with head 'nmst'")
        any_forced = forced is not None and bool(forced.any())
        # A forced row has no non-eos logit to normalize: the head reads zeros there (its row ends now).
        logits = scores.masked_fill(forced[:, None], 0.0) if any_forced else scores
        t = input_ids.shape[1] - self._prompt_length + 1
        log_p, state = step_log_probs(logits, head=self.head, eos_index=self.eos, eps=self.eps, steps=t,
                                      state=self._state, temperature=self.temperature)
        if banned is not None and bool(banned.any()):
            # The head's distribution conditioned on "not eos": the non-eos softmax, eos at 0.
            log_p[banned] = torch.log_softmax(scores[banned].to(log_p.dtype) / self.temperature, dim=-1)
        if any_forced:
            log_p[forced] = torch.where(torch.isfinite(scores[forced]), 0.0, float("-inf")).to(log_p.dtype)
        self._state, self._previous = state, input_ids
        return log_p.to(scores.dtype)
