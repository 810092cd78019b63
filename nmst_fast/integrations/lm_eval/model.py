"""The lm-eval model ``"nmst"``: lm-eval's ``HFLM`` scoring and decoding with a model's NMST / ST / VA head.

``NMSTLM`` is lm-eval's ``HFLM`` (the same model_args: ``pretrained``, ``tokenizer``, ``device``,
``batch_size``, ``dtype``, ``max_length``, …) scoring with the head, ε and eos that ``config.json``
records (``model.config.nmst``, written by :func:`~nmst_fast.integrations.hf.apply_nmst` and kept by
``save_pretrained``). A config that records no head is refused: evaluate it as a plain softmax
model with ``--model hf``, or pass ``head=`` (and ``eps=`` for nmst / st) in model_args. Those
model_args, and ``eos_token_id``, fill in only what the config does not record; a value that
contradicts the recorded one raises ``ValueError``.

What each request type returns under the head (step t = 1 at the first scored token, the
context's tokens are context: t ≤ 0, p(eos) = 0):

* ``loglikelihood``: (Σ log p of the continuation's tokens, is_greedy), t = 1 at the continuation's
  first token; is_greedy: every continuation token is the head's most probable token at its step.
* ``loglikelihood_rolling``: Σ log p of the document's tokens, t = 1 at its first token and counting
  on across lm-eval's windows (``get_rolling_token_windows``, as ``HFLM``); ST's running sum
  carries across them too (each token's eos logit comes from the window that scores it).
* ``generate_until``: HF ``generate``, which decodes the head's step distribution
  (:mod:`nmst_fast.integrations.hf.generation`, t = 1 at the first generated token):
  greedy, or sampling with ``do_sample`` (``temperature`` divides the non-eos logits only; HF's
  top-k / top-p then truncate the head's distribution), honouring ``until`` and ``max_gen_toks``;
  it stops at the head's eos and every other eos id the config lists.

Log-likelihoods are the fused per-token NLL (:meth:`~nmst_fast.NMSTHead.loss`, ``reduction="none"``)
on the decoder stack's last hidden state at the scored positions, so scoring never forms the
(B, T, V) logits (is_greedy reads the output layer's logits at the continuation's positions only). The
config's ``context_length`` (the training context) plays no part here: lm-eval decides what is
context.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import lm_eval
import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import Collator
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from packaging.version import Version
from torch import nn
from tqdm import tqdm

from ...head import NMSTHead
from ...settings import HeadSettings
from ..hf import (
    apply_nmst,
    decoder_hidden,
    logit_postprocessing,
    nmst_settings,
    output_head,
    score_labels,
    stop_token_ids,
)

# NMSTLM overrides HFLM's scoring internals (_loglikelihood_tokens, loglikelihood_rolling, _model_generate).
# Another release could route requests around them and score with HFLM's plain softmax without a word: it is
# refused, not trusted.
SUPPORTED_LM_EVAL = "0.4.13"
if Version(lm_eval.__version__).release[:3] != Version(SUPPORTED_LM_EVAL).release:
    raise ImportError(f"nmst_fast.integrations.lm_eval overrides lm-eval {SUPPORTED_LM_EVAL}'s HFLM internals; found "
                      f"lm-eval {lm_eval.__version__}: pip install lm-eval=={SUPPORTED_LM_EVAL}")

# Rows of output-layer logits formed at once when is_greedy reads the continuation's argmax.
_ARGMAX_ENTRIES = 1 << 24


def head_settings(model: Any, *, head: Optional[str] = None, eps: Optional[float] = None,
                  eos_token_id: Optional[int] = None) -> HeadSettings:
    """The head settings lm-eval scores ``model`` with: what ``model.config.nmst`` records, the
    arguments filling in only what it does not (:func:`~nmst_fast.integrations.hf.nmst_settings`:
    a contradiction raises ValueError). A config that records no head needs ``head=`` (and ``eps=``
    for "nmst" / "st"): a default ε would silently score another model than the one trained."""
    if not getattr(model.config, "nmst", None):
        if head is None:
            raise ValueError(
                "the model's config.json records no NMST head (model.config.nmst, which apply_nmst writes and "
                "save_pretrained keeps): evaluate it as a plain softmax model with `--model hf`, or name the "
                "head it was trained with in model_args, e.g. `--model_args pretrained=DIR,head=nmst,eps=1e-5`")
        if head != "va" and eps is None:
            raise ValueError(f"head={head!r} is given but no eps, and the model's config.json records none: pass "
                             "the ε the model was trained with in model_args (eps=...)")
    return nmst_settings(model, head=head, eps=eps, eos_token_id=eos_token_id)


@register_model("nmst")
class NMSTLM(HFLM):
    """lm-eval's ``HFLM`` scoring and decoding with the model's NMST / ST / VA head (module docstring).

    The loaded model is patched with :func:`~nmst_fast.integrations.hf.apply_nmst` (its recorded head;
    without labels its forward is unchanged), whose probe checks that the output layer on the decoder
    stack's last hidden state gives the model's own logits. ``nmst`` holds the head, ε and eos in use (a
    :class:`~nmst_fast.settings.HeadSettings`; lm-eval decides what is context, so no context_length).

    Args:
        pretrained: a ``from_pretrained`` directory (or model id), or a loaded ``…ForCausalLM``.
        head, eps, eos_token_id: only where ``config.json`` records none (:func:`head_settings`).
        **kwargs: ``HFLM``'s own model_args (``tokenizer``, ``device``, ``batch_size``, ``dtype``,
            ``max_length``, ``softmax_dtype`` (the dtype the head's loss runs in), …).
    Raises:
        ValueError: no head recorded nor given, a model_arg that contradicts the recorded head, a
        seq2seq model, a PEFT adapter (``peft=``), or a model whose logits the fused path does not
        reproduce (``apply_nmst``'s probe).
    """

    scores_the_head = True  # lm-eval's HFLM refuses a model with a head otherwise (nmst_fast.integrations)

    def __init__(self, pretrained: Any, *, head: Optional[str] = None, eps: Optional[float] = None,
                 eos_token_id: Optional[int] = None, **kwargs: Any) -> None:
        if kwargs.get("peft") is not None:
            raise ValueError("peft=: --model nmst scores a plain …ForCausalLM with its output layer; merge the "
                             "adapter first (PeftModel.merge_and_unload()), save_pretrained the merged model (its "
                             "config keeps config.nmst) and pass that directory as pretrained=")
        super().__init__(pretrained, **kwargs)
        if self.backend != "causal":
            raise ValueError(f"--model nmst scores causal LMs; {type(self.model).__name__} is a seq2seq model")
        settings = head_settings(self.model, head=head, eps=eps, eos_token_id=eos_token_id)
        apply_nmst(self.model, head=settings.head, eps=settings.eps, eos_token_id=settings.eos_token_id)
        self.nmst = HeadSettings(settings.head, settings.eps, settings.eos_token_id)
        self._stop_ids = list(stop_token_ids(self.model, settings.eos_index))
        self._head = self._argmax_head(settings)

    def _argmax_head(self, settings: HeadSettings) -> NMSTHead:
        """The output layer as an :class:`NMSTHead` (softcap and scale from the config), for is_greedy's argmax;
        in ``softmax_dtype`` when one is given (a copy of the weight in that dtype)."""
        head = output_head(self.model, settings)
        dtype = self.softmax_dtype
        if dtype is None or dtype == head.weight.dtype:
            return head
        softcap, scale = logit_postprocessing(self.model.config)
        weight = nn.Parameter(head.weight.detach().to(dtype), requires_grad=False)
        bias = False if head.bias is None else nn.Parameter(head.bias.detach().to(dtype), requires_grad=False)
        return NMSTHead(head.hidden_size, head.vocab_size, eos_index=head.eos_index, head=head.head, eps=head.eps,
                        weight=weight, bias=bias, softcap=softcap, logit_scale=scale)

    def _inference(self):
        """No grad, and HFLM's ``mixed_precision_dtype`` autocast where one is set (as its forward)."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                           enabled=self.mixed_precision_dtype is not None))
        return stack

    # --- scoring --------------------------------------------------------------------------------

    def _continuation_hidden(self, pairs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
        """The decoder stack's last hidden state at the positions that predict each continuation's
        tokens: one (len(continuation), H) tensor per (context ids, continuation ids) pair. The input
        is HFLM's: context + continuation without its last token, cut from the left to
        ``max_length``; the rows are right-padded (causal: padding after a row changes nothing in it)."""
        inputs, spans = [], []
        for context, continuation in pairs:
            if not context or not continuation:
                raise ValueError("a scored request needs at least one context token and one continuation token")
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens exceeds max_length={self.max_length}")
            ids = (context + continuation)[-(self.max_length + 1):][:-1]
            inputs.append(ids)
            spans.append((len(ids) - len(continuation), len(ids)))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        batch = torch.full((len(inputs), max(map(len, inputs))), pad, dtype=torch.long)
        for row, ids in enumerate(inputs):
            batch[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        with self._inference():
            _, hidden = decoder_hidden(self.model, input_ids=batch.to(self.device))
        return [hidden[row, start:stop] for row, (start, stop) in enumerate(spans)]

    def _best_non_eos(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N,) the first non-eos argmax of the output layer's logits of ``hidden`` (N, H), a few rows at a time."""
        eos, V = self.nmst.eos_index, self._head.vocab_size
        rows = max(1, _ARGMAX_ENTRIES // V)
        best = []
        for start in range(0, hidden.shape[0], rows):
            logits = self._head(hidden[start:start + rows].to(self._head.weight.dtype))
            logits[:, eos] = float("-inf")
            best.append(logits.argmax(-1))
        return torch.cat(best) if best else torch.zeros(0, dtype=torch.long, device=hidden.device)

    def _score(self, rows: list[torch.Tensor], targets: list[list[int]], *, greedy: bool) -> list[tuple[float, bool]]:
        """(Σ log p, is_greedy) of each sequence under the head: ``rows[i]`` (n_i, H) the hidden states
        predicting the n_i tokens ``targets[i]``, at steps t = 1..n_i (ST's running sum along them).

        One call of the scoring core (:func:`~nmst_fast.integrations.hf.score_labels`) on the right-padded
        (B, n, H) batch, in ``softmax_dtype`` where one is given; with ``greedy``, two more rows per
        sequence score eos and the best non-eos token at every step: the head's argmax is eos where
        log p(eos) wins (the lower id on a tie, as argmax), else that token (non-eos tokens keep the
        order of their logits under every head)."""
        out: list[tuple[float, bool]] = [(0.0, True)] * len(rows)
        live = [i for i, r in enumerate(rows) if r.shape[0] > 0]
        if not live:
            return out
        eos = self.nmst.eos_index
        lengths = [rows[i].shape[0] for i in live]
        B, n, device = len(live), max(lengths), rows[live[0]].device
        hidden = torch.zeros(B, n, rows[live[0]].shape[-1], dtype=rows[live[0]].dtype, device=device)
        tokens = torch.full((B, n), -100, dtype=torch.long, device=device)
        for b, i in enumerate(live):
            hidden[b, : lengths[b]] = rows[i]
            tokens[b, : lengths[b]] = torch.tensor(targets[i], dtype=torch.long, device=device)
        real = tokens != -100
        steps = torch.where(real, torch.arange(1, n + 1, device=device).expand(B, n), 0)
        stacked_hidden, stacked_tokens = hidden, tokens
        if greedy:
            best = torch.full_like(tokens, -100)
            best[real] = self._best_non_eos(hidden[real])
            stacked_hidden = hidden.repeat(3, 1, 1)
            stacked_tokens = torch.cat([tokens, torch.where(real, eos, -100), best])
            steps = steps.repeat(3, 1)
        with self._inference():
            nll = score_labels(self.model, stacked_hidden, stacked_tokens, self.nmst, shifted=False, steps=steps,
                               dtype=self.softmax_dtype).nll
        log_p = -nll.double()
        sums = log_p[:B].sum(-1).tolist()
        if greedy:
            eos_lp, best_lp = log_p[B:2 * B], log_p[2 * B:]
            eos_wins = (eos_lp > best_lp) | ((eos_lp == best_lp) & (eos < best))
            argmax = torch.where(eos_wins, eos, best)
            matches = ((argmax == tokens) | ~real).all(-1).tolist()
        else:
            matches = [False] * B
        for b, i in enumerate(live):
            out[i] = (float(sums[b]), bool(matches[b]))
        return out

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              override_bs: Optional[int] = None) -> list[tuple[float, bool]]:
        """(Σ log p of the continuation, is_greedy) per ((context, continuation) strings, context ids,
        continuation ids), t = 1 at the continuation's first token; batched longest first, as HFLM."""
        ordered = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        auto = self.batch_size == "auto"
        batch_size = (override_bs or 0) if auto else self.batch_size
        batch_fn = self._batch_scheduler if auto and len(ordered) > 0 and not override_bs else None
        if batch_fn is not None:
            self.batch_sizes = {}  # detect again for these requests (HFLM does the same)
        results = []
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Running loglikelihood requests")
        for chunk in ordered.get_batched(n=batch_size, batch_fn=batch_fn):
            hidden = self._continuation_hidden([(context, continuation) for _, context, continuation in chunk])
            answers = self._score(hidden, [continuation for _, _, continuation in chunk], greedy=True)
            for (request, _, _), answer in zip(chunk, answers):
                results.append(answer)
                if request is not None:
                    self.cache_hook.add_partial("loglikelihood", request, answer)
                bar.update(1)
        bar.close()
        return ordered.get_original(results)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Σ log p of each document's tokens, t = 1 at its first token, counting on across lm-eval's
        rolling windows (HFLM's: ``prefix_token_id`` before the first, ``max_length`` tokens each).

        The windows run in batches of ``batch_size`` in document order; once a document's last window
        has run, its tokens' hidden states, in document order, are scored as one sequence — so t and
        ST's running sum carry across its windows."""
        documents = []
        for (text,) in [request.args for request in requests]:
            windows = get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                max_seq_len=self.max_length, context_len=1)
            documents.append([make_disjoint_window(window) for window in windows])
        batch_size = self.batch_size
        if batch_size == "auto":
            batch_size = self._detect_batch_size()
        pieces = [(d, k) for d, windows in enumerate(documents) for k in range(len(windows))]
        pending: dict[int, list[torch.Tensor]] = {}
        totals = [0.0] * len(documents)
        for start in tqdm(range(0, len(pieces), batch_size), disable=disable_tqdm or self.rank != 0):
            batch = pieces[start:start + batch_size]
            hidden = self._continuation_hidden([documents[d][k] for d, k in batch])
            finished = []
            for (d, k), h in zip(batch, hidden):
                pending.setdefault(d, []).append(h)
                if k == len(documents[d]) - 1:
                    finished.append(d)
            scores = self._score([torch.cat(pending.pop(d)) for d in finished],
                                 [[t for _, continuation in documents[d] for t in continuation] for d in finished],
                                 greedy=False)
            for d, (total, _) in zip(finished, scores):
                totals[d] = total
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # --- generation -----------------------------------------------------------------------------

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str],
                        **generation_kwargs: Any) -> torch.Tensor:
        """HF ``generate`` (HFLM's call), which decodes the head (:mod:`nmst_fast.integrations.hf.generation`):
        greedy, or sampling with ``do_sample``, whose ``temperature`` divides the non-eos logits only; it stops at
        the head's eos and every other eos id the config lists."""
        return super()._model_generate(context, max_length, stop, **{**generation_kwargs,
                                                                       "eos_token_id": self._stop_ids})
