"""Evaluation of a trained model: perplexity, non-termination under every decoder, p(eos) vs t.

r_nt(L) is measured the paper's way: decode every evaluation context once up to the
largest L, then r_nt(L') for every L' on the grid is the fraction of continuations with
no eos among their first L' tokens.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from nmst_fast import generate, head_math, metrics
from nmst_fast.data.wikitext import CONTEXT_LENGTH, Vocabulary
from nmst_fast.logmath import log1mexp

from .loop import batches, perplexity

# The paper's decoders (name → generate() arguments).
DECODERS = {
    "greedy": dict(strategy="greedy"),
    "top-k 2": dict(strategy="top_k", top_k=2),
    "top-k 4": dict(strategy="top_k", top_k=4),
    "nucleus 0.2": dict(strategy="nucleus", top_p=0.2),
    "nucleus 0.4": dict(strategy="nucleus", top_p=0.4),
    "beam 2": dict(strategy="beam", num_beams=2),
    "beam 4": dict(strategy="beam", num_beams=4),
}


def contexts_of(sequences: list[list[int]]) -> torch.Tensor:
    """(B, 1 + CONTEXT_LENGTH) prompts: ``<bos>`` and the context of every sequence."""
    return torch.tensor([seq[: 1 + CONTEXT_LENGTH] for seq in sequences], dtype=torch.long)


def data_lengths(sequences: list[list[int]]) -> list[int]:
    """Continuation length (tokens after the context, eos included) of every sequence."""
    return [len(seq) - 1 - CONTEXT_LENGTH for seq in sequences]


@torch.no_grad()
def non_termination(model, contexts: torch.Tensor, max_length: int, *, seed: int = 0, device: str = "cpu",
                    decoders: dict = DECODERS) -> dict:
    """Per decoder: r_nt on a log grid of L up to ``max_length``, and the generated lengths."""
    model.eval()
    grid = metrics.log_grid(max_length)
    out = {}
    for name, kwargs in decoders.items():
        result = generate(model, contexts.to(device), max_length=max_length, keep_tokens=False,
                          generator=torch.Generator(device=device).manual_seed(seed), **kwargs)
        curve = metrics.non_termination_curve(result.lengths, grid, result.terminated)
        out[name] = dict(r_nt={str(L): ratio for L, ratio in curve.items()},
                         lengths=result.lengths.tolist(), terminated=result.terminated.tolist())
    return out


def eos_log_probs(model, inputs: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """(B, T) float64 log p(eos) at every position, teacher-forced.

    NMST/ST need only the eos logit s (p(eos) = 1 − e^{log(1−α_t)}), so no (B, T, V) tensor is
    formed for them; VA needs its full logsumexp, taken in (at least) float32.
    """
    head = model.nmst_head
    hidden, _ = model(inputs)
    B, T, _ = hidden.shape
    s = hidden.double() @ head.weight[head.eos_index].double()
    if head.bias is not None:
        s = s + head.bias[head.eos_index].double()
    if head.head == "va":
        logits = head(hidden)
        return s - torch.logsumexp(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1).double()
    log_surv = head_math.log_survival(head.head, s.reshape(-1), steps.reshape(-1), head.eps, T).view(B, T)
    return log1mexp(log_surv)


@torch.no_grad()
def eos_probability_by_step(model, sequences: list[list[int]], vocab: Vocabulary, max_t: int = 100,
                            device: str = "cpu", batch_size: int = 16) -> dict:
    """Teacher-forced mean p(eos) at continuation step t, next to the data's eos rate at t."""
    model.eval()
    p_sum, eos_count, alive = defaultdict(float), defaultdict(int), defaultdict(int)
    for batch in batches(sequences, vocab, batch_size):
        p_eos = eos_log_probs(model, batch.inputs.to(device), batch.steps.to(device)).exp().cpu()
        real = (batch.targets != -100) & (batch.steps >= 1) & (batch.steps <= max_t)
        for t, p, is_eos in zip(batch.steps[real].tolist(), p_eos[real].tolist(),
                                (batch.targets[real] == vocab.eos).tolist()):
            p_sum[t] += p
            eos_count[t] += is_eos
            alive[t] += 1
    steps = sorted(alive)
    return dict(t=steps, model=[p_sum[t] / alive[t] for t in steps], data=[eos_count[t] / alive[t] for t in steps])


@torch.no_grad()
def examples(model, sequences: list[list[int]], vocab: Vocabulary, count: int = 3, max_length: int = 40,
             device: str = "cpu") -> list[dict]:
    """Greedy continuations of the first ``count`` contexts, as text."""
    model.eval()
    picked = sequences[:count]
    out = generate(model, contexts_of(picked).to(device), strategy="greedy", max_length=max_length)
    rows = []
    for seq, tokens, length in zip(picked, out.tokens.tolist(), out.lengths.tolist()):
        rows.append(dict(context=" ".join(vocab.decode(seq[1: 1 + CONTEXT_LENGTH])),
                         reference=" ".join(vocab.decode(seq[1 + CONTEXT_LENGTH:])),
                         greedy=" ".join(vocab.decode(tokens[:length]))))
    return rows


def evaluate(model, vocab: Vocabulary, *, valid: list[list[int]], test: list[list[int]], max_length: int,
             seed: int = 0, device: str = "cpu", contexts: int | None = None) -> dict:
    """Everything the report shows for one trained model (r_nt over the first ``contexts`` test
    sequences, default all; perplexity always over all of them)."""
    decoding = non_termination(model, contexts_of(test[:contexts]), max_length, seed=seed, device=device)
    return dict(
        perplexity=perplexity(model, test, vocab, device=device),
        valid_perplexity=perplexity(model, valid, vocab, device=device),
        r_nt={name: d["r_nt"] for name, d in decoding.items()},
        generated_lengths={name: d["lengths"] for name, d in decoding.items()},
        data_lengths=data_lengths(test[:contexts]),
        p_eos=eos_probability_by_step(model, test, vocab, device=device),
        examples=examples(model, test, vocab, device=device),
    )
