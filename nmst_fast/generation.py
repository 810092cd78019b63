"""Batched generation with NMST / ST / VA heads: greedy, top-k, nucleus and beam search.

Any model plugs in through three methods (see :class:`DecodingModel`): encode the
contexts, advance one token, and select rows of its incremental state (RNN state,
KV cache). Finished sequences leave the batch, so the cost of a step follows the
number of live sequences, and an NMST head guarantees that greedy decoding is
over by ``termination_bound(eps)`` steps.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from .decoding.beam import beam_step
from .decoding.distribution import effective_logits
from .decoding.step import DecodingStep, check_impl
from .decoding.truncation import check_truncation
from .head import NMSTHead
from .logmath import termination_bound
from .validation import check_int, check_int_tensor, check_temperature

STRATEGIES = ("greedy", "top_k", "nucleus", "beam")


class DecodingModel(Protocol):
    """What :func:`generate` needs from a model."""

    nmst_head: NMSTHead

    def prefill(self, contexts: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Encode (B, Tc) context tokens: hidden state (B, H) at the last position, and the cache."""

    def decode_step(self, tokens: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        """Feed (B,) tokens: next hidden states (B, H) and the updated cache."""

    def select_cache(self, cache: Any, index: torch.Tensor) -> Any:
        """Rows ``index`` (int64) of the cache, in that order (used to drop and to reorder rows)."""

    # Optional: ``max_positions`` (int or None), the most context plus fed tokens the model attends
    # over (a learned position table's size); :func:`generate` refuses a ``max_length`` beyond it.
    # Optional: ``stop_token_ids`` (ints), tokens besides the head's eos that also end a
    # continuation (a config listing several eos ids, as Llama 3's).


def _stop_tokens(model, head: NMSTHead, device) -> torch.Tensor:
    """The tokens that end a continuation: the head's eos first, then the model's other stop ids."""
    ids = [head.eos_index] + [int(i) for i in getattr(model, "stop_token_ids", ()) if int(i) != head.eos_index]
    return torch.tensor(ids, dtype=torch.long, device=device)


@dataclass
class GenerationOutput:
    """Continuations of a batch of contexts.

    Attributes:
        tokens: (B, T) int64 generated tokens, eos included, padded with -1 after the end
            (T = the longest continuation; empty when ``keep_tokens=False``).
        lengths: (B,) int64 generated length (eos included when terminated).
        terminated: (B,) bool, whether the continuation ended with eos within ``max_length``.
        scores: (B,) float64 log-probability of each continuation, beam search's too (its
            ranking score, HF's ``sequences_scores``, is this / length ** ``length_penalty``).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    terminated: torch.Tensor
    scores: torch.Tensor


def _check(contexts, strategy: str, top_k, top_p, num_beams, max_length, temperature, impl, min_p=None) -> None:
    """Every argument, before the model runs (and for an empty batch as for any other)."""
    check_int_tensor("contexts", contexts)
    if contexts.dim() != 2:
        raise ValueError(f"contexts must be (B, Tc), got shape {tuple(contexts.shape)}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    check_truncation(top_k if strategy in ("top_k", "nucleus") else None, top_p if strategy == "nucleus" else None,
                     min_p)
    if min_p is not None and strategy not in ("top_k", "nucleus"):
        raise ValueError(f"min_p truncates the sampling strategies 'top_k' and 'nucleus', not {strategy!r}")
    check_temperature(temperature)
    check_impl(impl)
    check_int("max_length", max_length, 1)
    if strategy == "top_k" and top_k is None:
        raise ValueError("strategy='top_k' needs top_k")
    if strategy == "nucleus" and top_p is None:
        raise ValueError("strategy='nucleus' needs top_p")
    if strategy == "beam":
        check_int("num_beams", num_beams, 1)
    if strategy == "beam" and impl == "triton":
        raise ValueError("impl='triton' serves greedy, sample, top_k and nucleus; beam search ranks its candidates "
                         "in torch (impl='auto' or 'torch')")


def _check_beam_ranking(length_penalty, early_stopping) -> None:
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)):
        raise TypeError(f"length_penalty must be a real number, got {type(length_penalty).__name__}")
    if not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be finite, got {length_penalty!r}")
    if early_stopping not in (True, False, "never") or not isinstance(early_stopping, (bool, str)):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")


def _warn_if_dropout_is_on(model) -> None:
    """A module left in training mode decodes with dropout: greedy turns random and ``generator``
    does not control it (PyTorch modules start in training mode; HF's from_pretrained returns eval)."""
    if not isinstance(model, nn.Module):
        return
    for module in model.modules():
        active = module.training and (
            (isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0)
            or (isinstance(module, nn.RNNBase) and module.dropout > 0 and module.num_layers > 1))
        if active:
            warnings.warn(f"generate(): the model is in training mode, so its dropout ({type(module).__name__}) "
                          "is on while decoding; call model.eval() first", stacklevel=3)
            return


def _check_positions(model, context_length: int, max_length: int, strategy: str) -> None:
    """Refuse a run that would feed the model more positions than it has (``max_positions``)."""
    max_positions = getattr(model, "max_positions", None)
    if max_positions is None:
        return
    longest = max_length
    if strategy == "greedy" and model.nmst_head.head == "nmst":  # over by t½ at the latest
        longest = min(longest, termination_bound(model.nmst_head.eps))
    # The last generated token is never fed back: context + longest − 1 positions are read.
    if context_length + longest - 1 > max_positions:
        raise ValueError(f"max_length={max_length} after {context_length}-token contexts needs "
                         f"{context_length + longest - 1} positions, but the model has max_positions="
                         f"{max_positions}: use max_length <= {max_positions - context_length + 1}")


@torch.no_grad()
def generate(
    model: DecodingModel,
    contexts: torch.Tensor,
    *,
    strategy: str = "greedy",
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    num_beams: Optional[int] = None,
    max_length: int = 1000,
    temperature: float = 1.0,
    length_penalty: float = 0.0,
    early_stopping: bool | str = False,
    generator: Optional[torch.Generator] = None,
    keep_tokens: bool = True,
    progress: bool = False,
    impl: str = "auto",
) -> GenerationOutput:
    """Continue every context until eos (or another of the model's ``stop_token_ids``) or
    ``max_length`` generated tokens.

    Args:
        model: a :class:`DecodingModel` whose ``nmst_head`` defines the head, eos and ε.
        contexts: (B, Tc) int64 context tokens.
        strategy: "greedy", "top_k" (sampling from the top ``top_k``), "nucleus" (sampling
            from the top-``top_p`` mass; ``top_k`` may be combined) or "beam".
        min_p: "top_k" and "nucleus" then keep the tokens with at least ``min_p`` times the most probable
            one's probability (see :class:`nmst_fast.decoding.DecodingStep`).
        num_beams: beam width for "beam" (returns each item's best hypothesis).
        max_length: L, the most tokens generated per context.
        temperature: see :func:`nmst_fast.decoding.sample` (every strategy; greedy keeps the argmax
            of non-eos tokens, but eos competes with the tempered distribution).
        length_penalty: beam ranking uses score / length**length_penalty (0: raw log-prob).
        early_stopping: when a beam item is done, as in HF transformers (whose beam search this
            agrees with): True, once it holds ``num_beams`` finished hypotheses; False (HF's
            default), once its best live beam, scored at its current length, can no longer beat
            the worst of them — with ``length_penalty=0`` that is exact, as a live beam's
            log-prob only falls; "never", the same scored at ``max_length`` when
            ``length_penalty`` > 0.
        generator: for reproducible sampling.
        keep_tokens: keep the generated tokens; False keeps only lengths (memory O(B) for
            non-termination studies with L = 10^5).
        progress: show a progress bar over steps.
        impl: token selection backend of the other strategies, see :func:`nmst_fast.decoding.sample`
            ("auto": the Triton kernels on CUDA); beam search ranks its candidates in torch.
    """
    _check(contexts, strategy, top_k, top_p, num_beams, max_length, temperature, impl, min_p)
    max_length = int(max_length)
    num_beams = int(num_beams) if strategy == "beam" else num_beams
    if strategy == "beam":
        _check_beam_ranking(length_penalty, early_stopping)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    _check_positions(model, contexts.shape[1], max_length, strategy)
    _warn_if_dropout_is_on(model)
    if contexts.shape[0] == 0:  # nothing to continue
        empty = torch.zeros(0, dtype=torch.long, device=contexts.device)
        return GenerationOutput(empty.reshape(0, 0), empty, empty.bool(), empty.double())
    if strategy == "beam":
        return _beam_search(model, contexts, num_beams, max_length, float(length_penalty), early_stopping, keep_tokens,
                            progress, temperature)
    return _sample_loop(model, contexts, 1 if strategy == "greedy" else top_k,
                        top_p if strategy == "nucleus" else None, max_length, temperature, generator, keep_tokens,
                        progress, impl, strategy, min_p)


# Rows the host knows to have finished leave the batch (their cache rows too) once they are at least
# this share of it on an asynchronous device (on the CPU, at once: the host knows then).
COMPACT_SHARE = 0.25
# Steps before the CPU host "learns" a finished row (0: at once); tests set it to follow a GPU's order.
HOST_LAG = 0


class _FinishedRows:
    """Which rows of the batch have finished, as the host learns it without waiting for the device.

    Each step's mask is copied to the host behind the step (pinned memory and an event on CUDA) and
    read once the copy has landed, so the loop never stops for the GPU; on the CPU the copy lands at
    once (``lag`` steps later where tests ask for it, to follow the asynchronous order).
    """

    def __init__(self, device: torch.device, lag: int = 0):
        self.cuda = device.type == "cuda"
        self.lag = lag
        self.pending: list[tuple[torch.Tensor, Optional[torch.cuda.Event]]] = []

    def record(self, done: torch.Tensor) -> None:
        if self.cuda:
            host = torch.empty(done.shape, dtype=torch.bool, pin_memory=True)
            host.copy_(done, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.pending.append((host, event))
        else:
            self.pending.append((done.clone(), None))

    def known(self) -> Optional[torch.Tensor]:
        """The newest mask that has reached the host ((batch,) bool, CPU), or None; older ones are dropped."""
        ready = [i for i, (_, event) in enumerate(self.pending)
                 if (event.query() if event is not None else i < len(self.pending) - self.lag)]
        if not ready:
            return None
        newest = self.pending[ready[-1]][0]
        del self.pending[: ready[-1] + 1]
        return newest

    def forget(self) -> None:
        """After the batch was compacted: the masks still on their way describe the old batch."""
        self.pending.clear()


def _sample_loop(model, contexts, k, p, max_length, temperature, generator, keep_tokens, progress, impl,
                 strategy, min_p=None) -> GenerationOutput:
    """Greedy, top-k and nucleus decoding with no host sync per step: finished rows stay in the batch,
    masked (they take eos and add nothing to their score), until the host learns of them
    (:class:`_FinishedRows`) and drops them; the kernels' flags are read once, at the end."""
    head: NMSTHead = model.nmst_head
    B, device = contexts.shape[0], contexts.device
    lengths = torch.full((B,), max_length, dtype=torch.long, device=device)
    terminated = torch.zeros(B, dtype=torch.bool, device=device)
    scores = torch.zeros(B, dtype=torch.float64, device=device)
    history: list[tuple[torch.Tensor, torch.Tensor]] = []  # (original rows, tokens) per step
    live = torch.arange(B, device=device)  # each batch row's original row
    done = torch.zeros(B, dtype=torch.bool, device=device)  # batch rows already finished
    finished_rows = _FinishedRows(device, HOST_LAG)
    compact_at = 1 if device.type != "cuda" and HOST_LAG == 0 else None  # None: COMPACT_SHARE of the batch
    hidden, cache = model.prefill(contexts)
    state = None
    step: Optional[DecodingStep] = None
    # The theorem makes eos the strict argmax of greedy NMST from t½ on; in float64 p(eos) can
    # still round onto a tie with a token of lower index there (σ(−s) rounds to 1 for s ≲ −37),
    # so greedy NMST takes eos at t½ by the exact argument, not by the rounded comparison.
    bound = termination_bound(head.eps) if strategy == "greedy" and head.head == "nmst" else None
    stops = _stop_tokens(model, head, device)
    bar = tqdm(total=max_length, disable=not progress, desc=f"generate[{strategy}]")
    for t in range(1, max_length + 1):
        logits = head(hidden)
        if bound is not None and t >= bound:
            dist = effective_logits(logits, head=head.head, eos_index=head.eos_index, eps=head.eps, steps=t,
                                    temperature=temperature)
            tokens = torch.full((logits.shape[0],), head.eos_index, dtype=torch.long, device=device)
            log_p, finished = dist.token_log_probs(tokens), ~done
        else:
            if step is None:
                step = DecodingStep(head=head.head, eos_index=head.eos_index, vocab_size=logits.shape[1],
                                    device=device, eps=head.eps, top_k=k, top_p=p, min_p=min_p,
                                    temperature=temperature, impl=impl)
            out = step(logits, steps=t, state=state, generator=generator, defer_checks=True)
            tokens, log_p, state = torch.where(done, head.eos_index, out.tokens), out.log_probs, out.state
            finished = torch.isin(tokens, stops) & ~done
        scores.index_add_(0, live, torch.where(done, 0.0, log_p))
        lengths[live] = torch.where(finished, t, lengths[live])
        terminated[live] |= finished
        done = done | finished
        if keep_tokens:
            history.append((live, tokens))
        bar.update(1)
        if (bound is not None and t >= bound) or t == max_length:
            break
        finished_rows.record(done)
        known = finished_rows.known()
        if known is not None:
            n_done = int(known.sum())  # a host tensor: no sync
            bar.set_postfix(live=known.numel() - n_done)
            if n_done == known.numel():
                break
            if n_done >= (compact_at or max(1, int(COMPACT_SHARE * known.numel()))):
                keep = (~known).nonzero().squeeze(1)
                keep = keep.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else keep
                live, tokens, done = live[keep], tokens[keep], done[keep]
                state = None if state is None else state[keep]
                cache = model.select_cache(cache, keep)
                finished_rows.forget()
        hidden, cache = model.decode_step(tokens, cache)
    bar.close()
    if step is not None:
        step.check()  # the kernels' flags, read once: a row without a distribution raises here
    return GenerationOutput(_assemble(history, B, lengths, device, keep_tokens), lengths, terminated, scores)


def _assemble(history, B: int, lengths: torch.Tensor, device, keep_tokens: bool) -> torch.Tensor:
    """(B, longest length) tokens from the steps' (rows, tokens), -1 past each row's end (a finished
    row may have stayed in the batch for a few steps, taking eos)."""
    if not keep_tokens:
        return torch.empty(B, 0, dtype=torch.long, device=device)
    width = int(lengths.max()) if B else 0
    out = torch.full((B, width), -1, dtype=torch.long, device=device)
    for t, (rows, tokens) in enumerate(history[:width]):
        out[rows, t] = tokens
    return out.masked_fill_(torch.arange(width, device=device) >= lengths.unsqueeze(1), -1)


@dataclass
class _Hypothesis:
    score: float  # log_prob / length**length_penalty: the ranking score
    log_prob: float
    length: int
    terminated: bool
    # Its tokens: the prefix is row ``row`` of the trail after ``prefix_length`` steps, then the
    # stop token ``last`` when terminated (see _Trail).
    prefix_length: int
    row: int
    last: int = -1


class _Trail:
    """The beams' tokens as back-pointers: step t keeps, per continuing row, its token and its row
    after step t − 1. Appending costs O(rows) per step (copying every prefix each step cost O(t),
    so O(L²) over a run), and a prefix is read back once, for the returned hypotheses."""

    def __init__(self, keep_tokens: bool):
        self.keep = keep_tokens
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parent rows, tokens) per step

    def append(self, parents: torch.Tensor, tokens: torch.Tensor) -> None:
        if self.keep:
            self.steps.append((parents, tokens))

    def tokens(self, hypotheses: list[_Hypothesis], device) -> torch.Tensor:
        """(len(hypotheses), longest length) int64 tokens, padded with -1."""
        width = max((h.length for h in hypotheses), default=0) if self.keep else 0
        out = torch.full((len(hypotheses), width), -1, dtype=torch.long, device=device)
        if not self.keep or not hypotheses:
            return out
        n_prefix = torch.tensor([h.prefix_length for h in hypotheses], device=device)
        row = torch.tensor([h.row for h in hypotheses], device=device)
        ended = torch.tensor([h.terminated for h in hypotheses], device=device)
        last = torch.tensor([h.last for h in hypotheses], device=device)
        out[ended, n_prefix[ended]] = last[ended]
        for step in range(int(n_prefix.max()), 0, -1):  # all hypotheses walk back together
            parents, tokens = self.steps[step - 1]
            on = n_prefix >= step
            at = torch.where(on, row, 0)
            out[:, step - 1] = torch.where(on, tokens[at], out[:, step - 1])
            row = torch.where(on, parents[at], row)
        return out


def _stops_early(hypotheses: list[_Hypothesis], K: int, best_live: float, t: int, max_length: int,
                 length_penalty: float, early_stopping) -> bool:
    """Whether an item is done after step t, by HF transformers' rule for ``early_stopping``: True,
    once it holds K finished hypotheses; False, once it also holds K and its best live beam, scored
    at its current length t, cannot beat the worst of them; "never", the same but scored at
    ``max_length`` when ``length_penalty`` > 0 (the longest a live beam can get, so that is exact)."""
    if len(hypotheses) < K:
        return False
    if early_stopping is True:
        return True
    length = max_length if early_stopping == "never" and length_penalty > 0 else t
    return best_live / length**length_penalty <= hypotheses[-1].score


def _beam_search(model, contexts, K, max_length, length_penalty, early_stopping, keep_tokens, progress,
                 temperature) -> GenerationOutput:
    """Beam search: each step keeps the K best unfinished prefixes of every item; a candidate
    ending in eos that ranks among the K best becomes a finished hypothesis (an item keeps its K
    best by log-prob / length**length_penalty). An item is done by ``early_stopping``
    (:func:`_stops_early`) or at ``max_length``, where its live beams compete too; its best
    hypothesis is returned."""
    head: NMSTHead = model.nmst_head
    eos = head.eos_index
    B, device = contexts.shape[0], contexts.device
    stops = _stop_tokens(model, head, device)
    # K beams hold at most K·S stop candidates (S stop tokens), so (S + 1)·K candidates always hold
    # K that continue (HF's rule).
    C = (stops.numel() + 1) * K
    hidden, cache = model.prefill(contexts)
    rows = torch.arange(B, device=device).repeat_interleave(K)
    hidden, cache = hidden[rows], model.select_cache(cache, rows)
    beam_scores = torch.full((B, K), float("-inf"), dtype=torch.float64, device=device)
    beam_scores[:, 0] = 0.0  # one beam expands at first, so the K beams start distinct
    beam_scores = beam_scores.view(-1)
    trail = _Trail(keep_tokens)
    items = list(range(B))  # original index of each live item, on the host: bookkeeping needs no sync
    finished: list[list[_Hypothesis]] = [[] for _ in range(B)]
    state = None
    rank = torch.arange(C, device=device)
    bar = tqdm(total=max_length, disable=not progress, desc="generate[beam]")
    for t in range(1, max_length + 1):
        cand = beam_step(head(hidden), beam_scores, num_beams=K, head=head.head, eos_index=eos, eps=head.eps,
                         steps=t, state=state, temperature=temperature, num_candidates=C)
        is_eos = torch.isin(cand.tokens, stops)
        to_finish = is_eos & (rank < K) & torch.isfinite(cand.scores)
        # Every finishing candidate comes to the host at once (a few syncs per step, not per hypothesis).
        at = to_finish.nonzero()
        if at.numel():
            log_probs = cand.scores[at[:, 0], at[:, 1]].tolist()
            prefix_rows = cand.beam_rows[at[:, 0], at[:, 1]].tolist()
            last_tokens = cand.tokens[at[:, 0], at[:, 1]].tolist()
            for i, log_prob, row, last in zip(at[:, 0].tolist(), log_probs, prefix_rows, last_tokens):
                hyp = finished[items[i]]
                hyp.append(_Hypothesis(log_prob / t**length_penalty, log_prob, t, True, t - 1, row, last))
                hyp.sort(key=lambda h: -h.score)
                del hyp[K:]
        # The K best non-stop candidates continue (C candidates always hold K of them).
        continuing = torch.sort((is_eos).to(torch.int8), dim=1, stable=True).indices[:, :K]
        next_rows = cand.beam_rows.gather(1, continuing).view(-1)
        next_tokens = cand.tokens.gather(1, continuing).view(-1)
        beam_scores = cand.scores.gather(1, continuing).view(-1)
        state = None if cand.state is None else cand.state.gather(1, continuing).view(-1)
        bar.update(1)
        full = [len(finished[b]) >= K for b in items]
        best_live = beam_scores.view(-1, K).max(dim=1).values.tolist() if any(full) and early_stopping is not True \
            else [0.0] * len(items)
        done = [_stops_early(finished[b], K, best_live[i], t, max_length, length_penalty, early_stopping)
                for i, b in enumerate(items)]
        if t == max_length:
            trail.append(next_rows, next_tokens)
            live_scores = beam_scores.view(-1, K).tolist()
            for i, b in enumerate(items):
                if done[i]:
                    continue
                for j, log_prob in enumerate(live_scores[i]):
                    finished[b].append(_Hypothesis(log_prob / t**length_penalty, log_prob, t, False, t, i * K + j))
            break
        if any(done):  # finished items leave the batch
            keep_items = [i for i, d in enumerate(done) if not d]
            items = [items[i] for i in keep_items]
            keep_rows = (torch.tensor(keep_items, device=device, dtype=torch.long)[:, None] * K
                         + torch.arange(K, device=device)).view(-1)
            next_rows, next_tokens = next_rows[keep_rows], next_tokens[keep_rows]
            beam_scores = beam_scores[keep_rows]
            state = None if state is None else state[keep_rows]
        trail.append(next_rows, next_tokens)
        if not items:
            break
        hidden, cache = model.decode_step(next_tokens, model.select_cache(cache, next_rows))
    bar.close()
    best = [max(h, key=lambda h: h.score) for h in finished]  # every item holds >= 1 hypothesis by now
    return GenerationOutput(trail.tokens(best, device),
                            torch.tensor([h.length for h in best], dtype=torch.long, device=device),
                            torch.tensor([h.terminated for h in best], device=device),
                            torch.tensor([h.log_prob for h in best], dtype=torch.float64, device=device))
