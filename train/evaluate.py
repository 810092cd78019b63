"""Evaluation of a trained model: perplexity, non-termination under every decoder, p(eos) vs t.

r_nt(L) is measured the paper's way: decode every evaluation context once up to the
largest L, then r_nt(L') for every L' on the grid is the fraction of continuations with
no eos among their first L' tokens. With several ranks (:mod:`train.distributed`) the
contexts and the scored sequences are split over them and the results gathered: the same
numbers as one process's (decoding blocks are seeded by their index, not by the rank).
"""

from __future__ import annotations

import torch

from nmst_fast import generate, head_math, metrics
from nmst_fast.data.wikitext import CONTEXT_LENGTH, Vocabulary
from nmst_fast.integrations.hf import HFDecoder, decoder_hidden, steps_from_attention_mask
from nmst_fast.logits import eos_logits
from nmst_fast.logmath import log1mexp

from .distributed import World, all_sum, gather, share
from .loop import batches, perplexity, token_batches

# Contexts decoded together. Block b draws from a generator seeded by (seed, b), so sampled
# continuations do not depend on which rank decodes the block; small enough that a few hundred
# contexts keep two ranks busy.
DECODE_BLOCK = 64

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
                    decoders: dict = DECODERS, world: World = World(), block: int = DECODE_BLOCK,
                    greedy_length: int | None = None) -> dict:
    """Per decoder: r_nt on a log grid of L up to ``max_length`` (greedy: up to ``greedy_length`` if
    given, so its curve can reach NMST's bound t½ while the slower decoders stop earlier), and the
    generated lengths.

    ``contexts`` (B, C) are decoded in blocks of ``block`` rows (see :data:`DECODE_BLOCK`); rank r
    of ``world`` decodes blocks r, r + W, …, and every rank returns the whole result."""
    model.eval()
    lengths_of = {name: greedy_length if name == "greedy" and greedy_length else max_length for name in decoders}
    starts = range(0, len(contexts), block)
    mine = {}
    for start in starts[world.rank::world.size]:
        rows = contexts[start:start + block].to(device)
        for name, kwargs in decoders.items():
            generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + start // block)
            result = generate(model, rows, max_length=lengths_of[name], keep_tokens=False, generator=generator,
                              **kwargs)
            mine[start, name] = (result.lengths.tolist(), result.terminated.tolist())
    decoded = {key: value for part in gather(mine, world) for key, value in part.items()}
    out = {}
    for name in decoders:
        grid = metrics.log_grid(lengths_of[name])
        lengths = [n for start in starts for n in decoded[start, name][0]]
        terminated = [done for start in starts for done in decoded[start, name][1]]
        curve = metrics.non_termination_curve(torch.tensor(lengths), grid, torch.tensor(terminated))
        out[name] = dict(r_nt={str(L): ratio for L, ratio in curve.items()}, lengths=lengths, terminated=terminated)
    return out


def eos_log_probs(model, inputs: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """(B, T) float64 log p(eos) at every position of ``python -m train``'s model, teacher-forced."""
    hidden, _ = model(inputs)
    return head_eos_log_probs(model.nmst_head, hidden, steps)


def head_eos_log_probs(head, hidden: torch.Tensor, steps: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """(B, T) float64 log p(eos) of ``head`` (an :class:`nmst_fast.NMSTHead`) at hidden states (B, T, H), with
    the step t of each position in ``steps`` (B, T).

    NMST/ST need only the eos logit s (p(eos) = 1 − e^{log(1−α_t)}), so no V-wide tensor is formed for them;
    VA needs its full logsumexp, taken in (at least) float32 over ``rows`` positions at a time: (rows, V) at
    most, never (B, T, V) (at V = 256000 a 2048-token batch's logits are 2 GB in float32).
    """
    B, T, _ = hidden.shape
    s = eos_logits(hidden, head.weight, head.bias, head.eos_index, softcap=head.softcap, logit_scale=head.logit_scale,
                   dtype=torch.float64)
    if head.head == "va":
        flat = hidden.reshape(B * T, -1)
        lse = torch.cat([torch.logsumexp(head(flat[r0:r0 + rows]).to(torch.promote_types(flat.dtype, torch.float32)),
                                         dim=-1) for r0 in range(0, B * T, rows)])
        return s - lse.double().view(B, T)
    log_surv = head_math.log_survival(head.head, s.reshape(-1), steps.reshape(-1), head.eps, T).view(B, T)
    return log1mexp(log_surv)


class EosRateByStep:
    """Teacher-forced mean p(eos) at each continuation step t in [1, ``max_t``], next to the data's eos
    rate at t: summed over batches (:meth:`add`) and ranks (:meth:`result`)."""

    def __init__(self, max_t: int = 100):
        self.max_t = max_t
        self.sums = torch.zeros(3, max_t + 1, dtype=torch.float64)  # Σ p(eos), eos count, positions; by t

    def add(self, steps: torch.Tensor, p_eos: torch.Tensor, is_eos: torch.Tensor, supervised: torch.Tensor) -> None:
        """One batch, all (B, T): each position's step t, the model's p(eos), whether the data has eos
        there, and whether it is scored at all (its target is not ignored)."""
        counted = (supervised & (steps >= 1) & (steps <= self.max_t)).cpu()
        t = steps.cpu()[counted]
        for row, values in enumerate((p_eos.cpu()[counted], is_eos.cpu()[counted], torch.ones(len(t)))):
            self.sums[row].index_add_(0, t, values.double())

    def result(self, world: World = World()) -> dict:
        """{t, model, data}: the steps seen, and the mean p(eos) and data eos rate at each."""
        p_sum, eos_count, alive = all_sum(self.sums, world)
        steps = alive.nonzero().flatten()
        return dict(t=steps.tolist(), model=(p_sum[steps] / alive[steps]).tolist(),
                    data=(eos_count[steps] / alive[steps]).tolist())


@torch.no_grad()
def eos_probability_by_step(model, sequences: list[list[int]], vocab: Vocabulary, max_t: int = 100,
                            device: str = "cpu", batch_size: int = 16, world: World = World()) -> dict:
    """Teacher-forced mean p(eos) at continuation step t, next to the data's eos rate at t."""
    model.eval()
    rate = EosRateByStep(max_t)
    for batch in batches(share(sequences, world), vocab, batch_size):
        p_eos = eos_log_probs(model, batch.inputs.to(device), batch.steps.to(device)).exp()
        rate.add(batch.steps, p_eos, batch.targets == vocab.eos, batch.targets != -100)
    return rate.result(world)


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
             seed: int = 0, device: str = "cpu", contexts: int | None = None, world: World = World(),
             greedy_length: int | None = None) -> dict:
    """Everything the report shows for one trained model (r_nt over the first ``contexts`` test
    sequences, default all, up to ``max_length`` — greedy's up to ``greedy_length`` if given;
    perplexity always over all of them). With several ranks the work is split over them; every rank
    returns the numbers, rank 0 alone the greedy examples."""
    decoding = non_termination(model, contexts_of(test[:contexts]), max_length, seed=seed, device=device,
                               world=world, greedy_length=greedy_length)
    return dict(
        perplexity=perplexity(model, test, vocab, device=device, world=world),
        valid_perplexity=perplexity(model, valid, vocab, device=device, world=world),
        r_nt={name: d["r_nt"] for name, d in decoding.items()},
        generated_lengths={name: d["lengths"] for name, d in decoding.items()},
        data_lengths=data_lengths(test[:contexts]),
        p_eos=eos_probability_by_step(model, test, vocab, device=device, world=world),
        examples=examples(model, test, vocab, device=device) if world.is_main else [],
    )


# --- Hugging Face models (python -m train.hf) -------------------------------------------------------------

@torch.no_grad()
def token_eos_probability_by_step(model, seqs: list[list[int]], context_length: int, max_tokens: int, pad_id: int,
                            device: str, max_t: int = 100, world: World = World()) -> dict:
    """Teacher-forced mean p(eos) at continuation step t under the model's head, next to the data's
    eos rate at t (``python -m train``'s p_eos curve)."""
    head = HFDecoder(model).nmst_head
    rate = EosRateByStep(max_t)
    for batch, _ in token_batches(share(seqs, world), max_tokens, 0, pad_id, shuffle=False):
        ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
        hidden = decoder_hidden(model, input_ids=ids, attention_mask=mask)[1][:, :-1]
        steps = steps_from_attention_mask(mask, context_length)[:, 1:]  # t of the token each position predicts
        targets = batch.labels[:, 1:].to(device)
        rate.add(steps, head_eos_log_probs(head, hidden, steps).exp(), targets == head.eos_index, targets != -100)
    return rate.result(world)


@torch.no_grad()
def greedy_examples(model, tokenizer, seqs: list[list[int]], context_length: int, device: str, count: int = 3,
             max_length: int = 40) -> list[dict]:
    """Greedy continuations of the first ``count`` contexts, as text."""
    picked = seqs[:count]
    contexts = torch.tensor([s[:context_length] for s in picked], dtype=torch.long, device=device)
    out = generate(HFDecoder(model), contexts, strategy="greedy", max_length=max_length)
    return [dict(context=tokenizer.decode(s[:context_length]), reference=tokenizer.decode(s[context_length:]),
                 greedy=tokenizer.decode(tokens[:length]))
            for s, tokens, length in zip(picked, out.tokens.tolist(), out.lengths.tolist())]
