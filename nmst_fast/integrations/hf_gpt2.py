"""Hugging Face GPT-2 with an NMST / ST / VA head.

* :func:`apply_nmst_to_gpt2` — train a ``GPT2LMHeadModel`` with the fused loss (no logits).
* :class:`NMSTLogitsProcessor` — HF ``generate()`` greedy / sampling on the head's distribution.
* :class:`GPT2Decoder` — the model under :func:`nmst_fast.generate` (greedy, top-k, nucleus, beam).
"""

from __future__ import annotations

import inspect
import types
from typing import Any, Optional

import torch
from torch import nn
from transformers import LogitsProcessor
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

from ..decoding import step_log_probs
from ..head import NMSTHead
from ..loss import linear_nmst_loss
from ..validation import HEADS, check_choice, check_eps


class GPT2Decoder(nn.Module):
    """The :class:`nmst_fast.generation.DecodingModel` protocol over a ``GPT2LMHeadModel``.

    The head is tied to the model's ``lm_head`` weight, so ``head="va"`` decodes
    exactly what the model itself would. The KV cache is reordered and compacted
    with the cache's own ``reorder_cache`` (rows are selected, in order).

    Args:
        model: a ``transformers.GPT2LMHeadModel`` (random-init or ``from_pretrained(local_dir)``).
        head, eps: the head to decode with; eos is ``model.config.eos_token_id``. None: what
            ``model.config.nmst`` recorded (:func:`apply_nmst_to_gpt2`, kept by ``save_pretrained``),
            else "nmst" and 1e-5. A value that contradicts the recorded one raises ValueError.
    """

    def __init__(self, model: nn.Module, *, head: Optional[str] = None, eps: Optional[float] = None) -> None:
        super().__init__()
        self.model = model
        config = model.config
        settings = _nmst_settings(model, head, eps, None)
        self.nmst_head = NMSTHead(config.n_embd, config.vocab_size, eos_index=config.eos_token_id,
                                  head=settings["head"], eps=settings["eps"], weight=model.lm_head.weight)
        # transformers renamed the KV-cache argument (past_key_values -> cache); use what this version takes.
        params = inspect.signature(model.transformer.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @property
    def max_positions(self) -> int:
        """Context plus fed tokens the model can attend over (GPT-2's ``n_positions``): ``generate``
        checks ``max_length`` against it before decoding."""
        return int(self.model.config.n_positions)

    @staticmethod
    def _returned_cache(out: Any) -> Any:
        # transformers 5 renamed the output field too; reading the old name there warns on every step.
        return out["cache"] if "cache" in out.keys() else out.past_key_values

    def prefill(self, contexts: torch.Tensor) -> tuple[torch.Tensor, Any]:
        out = self.model.transformer(input_ids=contexts, use_cache=True)
        return out.last_hidden_state[:, -1], self._returned_cache(out)

    def decode_step(self, tokens: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        out = self.model.transformer(input_ids=tokens[:, None], use_cache=True, **{self._cache_arg: cache})
        return out.last_hidden_state[:, -1], self._returned_cache(out)

    def select_cache(self, cache: Any, index: torch.Tensor) -> Any:
        cache.reorder_cache(index)
        return cache


def _nmst_settings(model: nn.Module, head: Optional[str], eps: Optional[float],
                   context_length: Optional[int]) -> dict:
    """The head settings to use: what the caller gave, else what the model's config recorded."""
    recorded = getattr(model.config, "nmst", None) or {}
    given = {k: v for k, v in dict(head=head, eps=eps, context_length=context_length).items() if v is not None}
    clash = {k: (recorded[k], v) for k, v in given.items() if k in recorded and recorded[k] != v}
    if clash:
        raise ValueError(f"the model was trained with {', '.join(f'{k}={a!r}' for k, (a, _) in clash.items())}; "
                         f"refusing to use {', '.join(f'{k}={b!r}' for k, (_, b) in clash.items())}")
    settings = dict(head="nmst", eps=1e-5, context_length=10) | recorded | given
    check_choice("head", settings["head"], HEADS)
    check_eps(settings["eps"])
    if isinstance(settings["context_length"], bool) or not isinstance(settings["context_length"], int) \
            or settings["context_length"] < 0:
        raise ValueError(f"context_length must be an int >= 0, got {settings['context_length']!r}")
    return settings


def prediction_steps(seq_len: int, context_length: int, device: torch.device) -> torch.Tensor:
    """t of the token at each position 1..seq_len−1 (what position i−1 predicts): t = 1 at the
    first token after ``context_length`` context tokens, 0 on the context."""
    return (torch.arange(1, seq_len, device=device) - context_length + 1).clamp(min=0)


def apply_nmst_to_gpt2(model: nn.Module, *, head: Optional[str] = None, eps: Optional[float] = None,
                       context_length: Optional[int] = None, impl: str = "auto",
                       generation_logits: bool = False) -> nn.Module:
    """Make a ``GPT2LMHeadModel`` train with the fused NMST / ST / VA loss on its tied head.

    With ``labels``, ``model(input_ids, labels=...)`` runs the transformer, then
    :func:`nmst_fast.linear_nmst_loss` on the hidden states and ``lm_head.weight`` — the
    (B, T, V) logits are never formed, and the output's ``logits`` is None. Labels are shifted
    inside, as in HF (token i+1 is predicted at position i; -100 is ignored); the first
    ``context_length`` tokens of every sequence are context (t = 0, p(eos) = 0 there), t = 1 at
    the next one. HF Trainer's ``num_items_in_batch`` is honoured (loss summed, then divided by it).
    Without labels the model is unchanged (HF generate; decode NMST with :class:`NMSTLogitsProcessor`
    or :class:`GPT2Decoder`) — unless ``generation_logits=True``: then the last position's logits
    become the head's exact step log-probabilities (t = 1 at the first generated token, counted
    from the KV cache), so every HF ``generate()`` mode, beam search included, decodes the NMST
    (or VA) distribution with no processor. ST's running state cannot follow HF's beam
    reordering, so it is refused there (use :class:`NMSTLogitsProcessor` or :class:`GPT2Decoder`).

    The settings are stored in ``model.config.nmst`` (so ``save_pretrained`` records them); a model
    loaded with recorded settings reuses them, and conflicting arguments raise ValueError.
    Defaults: head "nmst", eps 1e-5, context_length 10 (the paper's GPT-2 setup).
    """
    settings = _nmst_settings(model, head, eps, context_length)
    if generation_logits and settings["head"] == "st":
        raise ValueError("generation_logits=True supports head 'nmst' and 'va': ST's running state cannot "
                         "follow HF's beam reordering; use NMSTLogitsProcessor or GPT2Decoder for ST")
    model.config.nmst = settings
    original_forward = model.forward
    signature = inspect.signature(original_forward)  # bound: without self
    eos_index = model.config.eos_token_id
    prompt = {}  # length of the prompt of the generation in progress (set at its prefill call)

    def step_distribution(out, cache, new_tokens: int):
        # A call without a cache scores the token after its input (t = 1), as a prefill does;
        # with one, the cache already holds this call's tokens.
        total = new_tokens if cache is None else cache.get_seq_length()
        if total == new_tokens:  # prefill: a new generation starts
            prompt["length"] = total
        t = total - prompt["length"] + 1
        log_p, _ = step_log_probs(out.logits[:, -1], head=settings["head"], eos_index=eos_index,
                                  eps=settings["eps"], steps=t)
        out.logits[:, -1] = log_p.to(out.logits.dtype)
        return out

    def forward(self, *args, num_items_in_batch=None, **kwargs):
        kwargs = _named_arguments(signature, args, kwargs)
        labels = kwargs.pop("labels", None)
        if labels is None:
            out = original_forward(**kwargs)
            if not generation_logits:
                return out
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            return step_distribution(out, cache, kwargs["input_ids"].shape[1])
        kwargs.pop("logits_to_keep", None)
        kwargs["use_cache"] = False
        input_ids = kwargs.pop("input_ids", None)
        out = self.transformer(input_ids, **kwargs)
        hidden = out.last_hidden_state
        T = hidden.shape[1]
        targets = labels[:, 1:].to(hidden.device)
        steps = prediction_steps(T, settings["context_length"], hidden.device).expand(targets.shape)
        loss = linear_nmst_loss(hidden[:, :-1], self.lm_head.weight, targets, eos_index=eos_index,
                                eps=settings["eps"], head=settings["head"],
                                steps=None if settings["head"] == "va" else steps,
                                reduction="mean" if num_items_in_batch is None else "sum", impl=impl)
        if num_items_in_batch is not None:
            loss = loss / num_items_in_batch
        return CausalLMOutputWithCrossAttentions(loss=loss, logits=None, hidden_states=out.hidden_states,
                                                 attentions=out.attentions)

    # HF generate() reads the forward's signature to decide whether to pass attention_mask and
    # position_ids (left-padded prompts need both): advertise the original's, plus Trainer's
    # num_items_in_batch.
    forward.__signature__ = _with_self_and(signature, "num_items_in_batch")
    model.forward = types.MethodType(forward, model)
    return model


def _named_arguments(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """Positional and keyword arguments of a call, by name, as ``signature`` binds them
    (its ``**kwargs`` flattened in): the patched forward takes calls exactly as the original."""
    named = dict(signature.bind(*args, **kwargs).arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(parameter.name, {}))
    return named


def _with_self_and(signature: inspect.Signature, keyword: str) -> inspect.Signature:
    """``signature`` of a bound method as its function's (``self`` first), with a keyword-only
    ``keyword=None`` before any ``**kwargs`` when it lacks one."""
    parameters = list(signature.parameters.values())
    if keyword not in signature.parameters:
        extra = inspect.Parameter(keyword, inspect.Parameter.KEYWORD_ONLY, default=None)
        at = next((i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD), len(parameters))
        parameters.insert(at, extra)
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return signature.replace(parameters=[self_parameter, *parameters])


class NMSTLogitsProcessor(LogitsProcessor):
    """Turn GPT-2 logits into the NMST / ST log-distribution inside HF ``generate()``.

    Greedy search and sampling (with HF's top-k / top-p, which run after custom processors)
    then decode the head's exact step distribution; t = 1 at the first generated token.
    Keep HF's ``temperature`` at 1 (it would scale eos too); pass ``temperature`` here, which
    divides non-eos logits only. HF beam search hands processors log-softmaxed scores, which
    have lost the raw eos logit the head needs: that is detected and refused — decode beams with
    ``apply_nmst_to_gpt2(model, generation_logits=True)`` (HF beam search then sees the NMST
    log-probabilities as the model's logits) or ``nmst_fast.generate(GPT2Decoder(model, head=...), strategy="beam")``. ST keeps its running
    state per row, so rows must not be reordered between steps (checked).

    One instance may serve several ``generate()`` calls: a call continues the previous step only
    when it holds the same rows grown by one token; any other shape starts a new generation at
    t = 1. The one ambiguous case — the same batch size and one token longer, but other prefixes
    (rows reordered, or a new prompt exactly one token longer than the last sequences) — raises;
    :meth:`reset` before a new ``generate()`` call avoids it.
    """

    def __init__(self, *, eos_token_id: int, head: str = "nmst", eps: float = 1e-5, temperature: float = 1.0):
        check_choice("head", head, HEADS)
        check_eps(eps)
        self.eos, self.head, self.eps, self.temperature = eos_token_id, head, eps, temperature
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
        if isinstance(self.eos, int) and 0 <= self.eos < scores.shape[-1]:
            eos_score = scores[:, self.eos]
            banned = eos_score == float("-inf")
            others = scores.index_fill(-1, torch.tensor([self.eos], device=scores.device), float("-inf"))
            forced = torch.isfinite(eos_score) & (others.amax(dim=-1) == float("-inf"))
        free = None if forced is None else ~forced
        if torch.allclose(torch.logsumexp(scores[free].double(), dim=-1), torch.zeros((), dtype=torch.float64),
                          atol=1e-4) and (free is None or bool(free.any())):
            raise ValueError("NMSTLogitsProcessor got normalized log-probs (HF beam search): the raw eos logit "
                             "is gone; use apply_nmst_to_gpt2(model, generation_logits=True) without the processor, "
                             "or nmst_fast.generate(GPT2Decoder(model, head=...), strategy='beam')")
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
