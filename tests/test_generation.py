"""generate(): greedy / sampling / beam against straightforward float64 references; metrics."""

import pytest
import torch
from torch import nn

import nmst_fast
from nmst_fast import metrics
from nmst_fast.generation import generate

from helpers import DEVICE


class TinyRNN(nn.Module):
    """A small tied-embedding RNN LM exposing the DecodingModel protocol."""

    def __init__(self, V=23, H=16, head="nmst", eps=0.05, scale=3.0, seed=0, eos_bias=None):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(V, H)
        nn.init.normal_(self.emb.weight, std=scale / H**0.5)
        self.rnn = nn.RNN(H, H, batch_first=True)
        self.nmst_head = nmst_fast.NMSTHead(H, V, eos_index=V - 1, head=head, eps=eps, weight=self.emb.weight,
                                            bias=eos_bias is not None)
        if eos_bias is not None:  # push the raw eos logit far down: eos looks hopeless to the logits
            with torch.no_grad():
                self.nmst_head.bias[V - 1] = eos_bias
        self.rows_seen = []

    def prefill(self, contexts):
        out, h = self.rnn(self.emb(contexts))
        return out[:, -1], h

    def decode_step(self, tokens, h):
        self.rows_seen.append(tokens.numel())
        out, h = self.rnn(self.emb(tokens)[:, None], h)
        return out[:, 0], h

    def select_cache(self, h, index):
        return h[:, index]

    @torch.no_grad()
    def sequence_log_probs(self, context, continuation):
        """Reference: log p of the next token after context + continuation, from scratch."""
        seq = torch.cat([context, continuation])[None]
        out, _ = self.rnn(self.emb(seq))
        logits = self.nmst_head(out)[:, len(context) - 1:]  # positions predicting generated tokens
        steps = torch.arange(1, logits.shape[1] + 1)[None]
        head = self.nmst_head
        return nmst_fast.nmst_log_probs(logits, eos_index=head.eos_index, eps=head.eps, head=head.head,
                                        steps=steps)[0, -1]


def _contexts(B=5, Tc=4, V=23, seed=1):
    return torch.randint(0, V - 1, (B, Tc), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("head", ["nmst", "st", "va"])
def test_greedy_matches_reference_loop(head):
    model = TinyRNN(head=head).double()
    contexts = _contexts()
    out = generate(model, contexts, strategy="greedy", max_length=25)
    for b in range(contexts.shape[0]):
        seq = torch.empty(0, dtype=torch.long)
        for _ in range(25):
            token = int(torch.argmax(model.sequence_log_probs(contexts[b], seq)))
            seq = torch.cat([seq, torch.tensor([token])])
            if token == model.nmst_head.eos_index:
                break
        assert out.tokens[b, : len(seq)].tolist() == seq.tolist()
        assert int(out.lengths[b]) == len(seq)
        assert bool(out.terminated[b]) == (seq[-1].item() == model.nmst_head.eos_index)


@pytest.mark.parametrize("head", ["nmst", "st", "va"])
def test_fused_greedy_generation_equals_torch_path(head):
    model = TinyRNN(head=head).to(DEVICE)
    contexts = _contexts(B=8).to(DEVICE)
    fused = generate(model, contexts, strategy="greedy", max_length=40, impl="triton")
    plain = generate(model, contexts, strategy="greedy", max_length=40, impl="torch")
    assert torch.equal(fused.tokens, plain.tokens) and torch.equal(fused.lengths, plain.lengths)
    torch.testing.assert_close(fused.scores, plain.scores, rtol=1e-5, atol=1e-5)  # fp32 L in the kernel


def test_greedy_nmst_terminates_by_bound_and_batch_shrinks():
    eps = 0.05
    bound = nmst_fast.termination_bound(eps)
    for seed in range(3):
        model = TinyRNN(head="nmst", eps=eps, scale=8.0, seed=seed, eos_bias=-50.0)
        out = generate(model, _contexts(B=40, seed=seed), strategy="greedy", max_length=10 * bound)
        assert out.terminated.all() and int(out.lengths.max()) <= bound
        assert model.rows_seen == sorted(model.rows_seen, reverse=True)  # finished rows left the batch


def test_va_can_fail_to_terminate():
    model = TinyRNN(head="va", scale=8.0, eos_bias=-50.0)
    out = generate(model, _contexts(B=20), strategy="greedy", max_length=50)
    assert not out.terminated.all()
    assert metrics.non_termination_ratio(out.lengths, 50, out.terminated) > 0
    assert (out.lengths[~out.terminated] == 50).all()


@pytest.mark.parametrize("strategy,kw", [("top_k", dict(top_k=2)), ("top_k", dict(top_k=4)),
                                         ("nucleus", dict(top_p=0.2)), ("nucleus", dict(top_p=0.4))])
def test_sampling_strategies_reproducible_and_terminate(strategy, kw):
    model = TinyRNN(head="nmst", eps=0.05)
    contexts = _contexts(B=30)
    a = generate(model, contexts, strategy=strategy, max_length=400, generator=torch.Generator().manual_seed(3), **kw)
    b = generate(model, contexts, strategy=strategy, max_length=400, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)
    assert a.terminated.all()
    lengths_only = generate(model, contexts, strategy=strategy, max_length=400, keep_tokens=False,
                            generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(lengths_only.lengths, a.lengths) and lengths_only.tokens.numel() == 0


def _reference_beam(model, context, K, max_length, early_stopping):
    """Beam search written out plainly: every prefix scored from scratch (float64); no length
    penalty. An item stops with K finished hypotheses (early_stopping=True), or also once its best
    running beam cannot beat the worst of them (False: HF's rule, exact without a length penalty)."""
    eos = model.nmst_head.eos_index
    beams = [(0.0, [])]
    finished = []
    for t in range(1, max_length + 1):
        cands = []
        for beam_id, (score, seq) in enumerate(beams):
            log_p = model.sequence_log_probs(context, torch.tensor(seq, dtype=torch.long))
            order = torch.sort(log_p, descending=True, stable=True).indices[: 2 * K]
            cands += [(score + float(log_p[tok]), beam_id, rank, int(tok)) for rank, tok in enumerate(order)]
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        cands = cands[: 2 * K]
        running = []
        for pos, (score, beam_id, _, tok) in enumerate(cands):
            seq = beams[beam_id][1] + [tok]
            if tok == eos:
                if pos < K:
                    finished.append((score, seq, True))
            elif len(running) < K:
                running.append((score, seq))
        finished = sorted(finished, key=lambda h: -h[0])[:K]
        beams = running
        if len(finished) >= K and (early_stopping or max(s for s, _ in beams) <= finished[-1][0]):
            break
        if t == max_length:
            finished += [(s, seq, False) for s, seq in beams]
    return max(finished, key=lambda h: h[0])


@pytest.mark.parametrize("head", ["nmst", "st", "va"])
@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("early_stopping", [True, False])
def test_beam_matches_reference(head, K, early_stopping):
    model = TinyRNN(V=11, head=head, eps=0.1, scale=2.0).double()
    contexts = _contexts(B=3, V=11)
    out = generate(model, contexts, strategy="beam", num_beams=K, max_length=12, early_stopping=early_stopping)
    for b in range(contexts.shape[0]):
        score, seq, terminated = _reference_beam(model, contexts[b], K, 12, early_stopping)
        assert out.tokens[b, : len(seq)].tolist() == seq
        assert int(out.lengths[b]) == len(seq) and bool(out.terminated[b]) == terminated
        assert float(out.scores[b]) == pytest.approx(score, rel=1e-12)


@pytest.mark.parametrize("head", ["nmst", "st", "va"])
def test_beam_stopping_rules_match_reference(head):
    """Peaked non-eos logits with eos held up: items hold K finished hypotheses early while a live
    beam still scores higher, so the two stopping rules return different hypotheses (ST and VA
    here; checked), each equal to the plain reference."""
    model = TinyRNN(V=11, head=head, eps=0.05, scale=12.0, eos_bias=4.0, seed=1).double()
    contexts = _contexts(B=3, V=11)
    outs = {}
    for early_stopping in (True, False):
        out = outs[early_stopping] = generate(model, contexts, strategy="beam", num_beams=3, max_length=12,
                                              early_stopping=early_stopping)
        for b in range(contexts.shape[0]):
            score, seq, terminated = _reference_beam(model, contexts[b], 3, 12, early_stopping)
            assert out.tokens[b, : len(seq)].tolist() == seq
            assert int(out.lengths[b]) == len(seq) and bool(out.terminated[b]) == terminated
            assert float(out.scores[b]) == pytest.approx(score, rel=1e-12)
    if head != "nmst":
        assert not torch.equal(outs[True].lengths, outs[False].lengths)
        assert (outs[False].scores >= outs[True].scores).all()  # the longer search finds no worse hypothesis


def test_beam_one_equals_greedy():
    model = TinyRNN(head="nmst").double()
    contexts = _contexts(B=6)
    greedy = generate(model, contexts, strategy="greedy", max_length=30)
    beam = generate(model, contexts, strategy="beam", num_beams=1, max_length=30)
    assert torch.equal(greedy.lengths, beam.lengths)
    assert torch.equal(greedy.tokens[:, : beam.tokens.shape[1]], beam.tokens)


def test_generate_rejects_bad_arguments():
    model = TinyRNN()
    for kw, name in [(dict(strategy="sample"), "strategy"), (dict(strategy="top_k"), "top_k"),
                     (dict(strategy="nucleus"), "top_p"), (dict(strategy="beam"), "num_beams"),
                     (dict(max_length=0), "max_length"), (dict(strategy="beam", num_beams=True), "num_beams"),
                     (dict(strategy="beam", num_beams=2, temperature=-1.0), "temperature"),
                     (dict(temperature=float("inf")), "temperature"),
                     (dict(strategy="beam", num_beams=2, length_penalty=float("nan")), "length_penalty"),
                     (dict(strategy="beam", num_beams=2, early_stopping="sometimes"), "early_stopping"),
                     (dict(strategy="beam", num_beams=2, early_stopping=1), "early_stopping")]:
        with pytest.raises(ValueError, match=name):
            generate(model, _contexts(), **kw)
    import numpy as np  # numpy integers count as ints, as sample's top_k takes them

    out = generate(model, _contexts(), strategy="beam", num_beams=np.int64(2), max_length=np.int64(3))
    assert int(out.lengths.max()) <= 3
    with pytest.raises(TypeError, match="length_penalty"):
        generate(model, _contexts(), strategy="beam", num_beams=2, length_penalty="1")
    with pytest.raises(TypeError, match="generator"):
        generate(model, _contexts(), strategy="top_k", top_k=3, generator=3)


def test_generate_checks_every_argument_before_the_model_runs():
    """contexts that are not a (B, Tc) integer tensor were an IndexError / AttributeError / an error
    inside nn.Embedding; top_k / top_p / temperature / impl were first read at step 1, after the
    prefill, and never for an empty batch (top_k=0 returned an empty result there)."""
    model = TinyRNN()
    for contexts, exc in ((_contexts()[0], ValueError), (_contexts().tolist(), TypeError),
                          (_contexts().float(), TypeError), (_contexts().bool(), TypeError)):
        with pytest.raises(exc, match="contexts"):
            generate(model, contexts)
    for contexts in (_contexts(), _contexts()[:0]):
        for kw, name in [(dict(strategy="top_k", top_k=0), "top_k"), (dict(strategy="nucleus", top_p=1.5), "top_p"),
                         (dict(strategy="nucleus", top_p=0.5, top_k=-2), "top_k"),
                         (dict(temperature=-1.0), "temperature"), (dict(impl="bogus"), "impl"),
                         (dict(strategy="beam", num_beams=2, impl="triton"), "impl"),
                         (dict(strategy="top_k", top_k=3, min_p=1.5), "min_p"),
                         (dict(strategy="greedy", min_p=0.1), "min_p"),
                         (dict(strategy="beam", num_beams=2, min_p=0.1), "min_p")]:
            model.rows_seen.clear()
            with pytest.raises(ValueError, match=name):
                generate(model, contexts, **kw)
            assert model.rows_seen == []
    # Arguments a strategy does not read stay unread, as before.
    assert generate(model, _contexts(), strategy="greedy", top_k=0, top_p=7.0, max_length=3).lengths.numel() == 5


def test_generate_warns_when_dropout_is_on():
    """A module starts in training mode: decoding with dropout on is random whatever the generator."""
    from nmst_fast.models import RecurrentLM

    model = RecurrentLM(30, eos_index=29, arch="lstm", embedding_dim=8, hidden_size=8)
    contexts = torch.randint(0, 29, (3, 4), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="eval"):
        generate(model, contexts, max_length=3)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate(model.eval(), contexts, max_length=3)


def test_beam_scores_are_log_probabilities_whatever_the_length_penalty():
    model = TinyRNN(head="nmst").double()
    contexts = _contexts(B=3)
    for penalty in (0.0, 1.0):
        out = generate(model, contexts, strategy="beam", num_beams=3, max_length=8, length_penalty=penalty)
        for b in range(3):
            continuation = out.tokens[b, : out.lengths[b]]
            want = sum(float(model.sequence_log_probs(contexts[b], continuation[:i])[continuation[i]])
                       for i in range(len(continuation)))
            assert float(out.scores[b]) == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_empty_batch_generates_nothing():
    model = TinyRNN()
    for kw in (dict(), dict(strategy="nucleus", top_p=0.9), dict(strategy="beam", num_beams=2)):
        out = generate(model, _contexts()[:0], max_length=5, **kw)
        assert out.tokens.shape[0] == out.lengths.numel() == out.terminated.numel() == out.scores.numel() == 0


def test_beam_search_applies_temperature():
    """Temperature reaches the beam's step distributions (it used to be dropped): the best
    hypothesis' score is its log-probability under the tempered distributions, so a hot and a cold
    search score differently. (VA: eos is tempered too; with eos held far down nothing ends early.)"""
    model = TinyRNN(head="va", eos_bias=-30.0).double()
    contexts = _contexts(B=3)
    runs = {T: generate(model, contexts, strategy="beam", num_beams=2, max_length=6, temperature=T)
            for T in (0.5, 1.0, 2.0)}
    assert not torch.allclose(runs[0.5].scores, runs[2.0].scores)
    for T, out in runs.items():
        for b in range(3):  # the score is the sum of the tempered step log-probs of the tokens
            seq = torch.cat([contexts[b], out.tokens[b]])[None]
            h, _ = model.rnn(model.emb(seq))
            log_p = torch.log_softmax(model.nmst_head(h)[0, contexts.shape[1] - 1:-1] / T, dim=-1)
            total = log_p.gather(1, out.tokens[b][:, None]).sum()
            torch.testing.assert_close(out.scores[b], total, rtol=1e-9, atol=1e-9)


class _ConstantLogits(nn.Module):
    """A model whose head emits the same logits at every step (to pin greedy's decisions)."""

    def __init__(self, logits, eps):
        super().__init__()
        V = logits.numel()
        self.nmst_head = nmst_fast.NMSTHead(1, V, eos_index=V - 1, head="nmst", eps=eps, bias=True)
        with torch.no_grad():
            self.nmst_head.weight.zero_()
            self.nmst_head.bias.copy_(logits)

    def prefill(self, contexts):
        return torch.ones(contexts.shape[0], 1, dtype=torch.float64), None

    def decode_step(self, tokens, cache):
        return torch.ones(tokens.shape[0], 1, dtype=torch.float64), None

    def select_cache(self, cache, index):
        return cache


@pytest.mark.parametrize("eps", [0.5, 0.018559322341406004, 0.00590682060858061, 0.05])
def test_greedy_nmst_ends_by_the_bound_when_floats_tie(eps):
    """t½ is the exact bound (the float64 formula undercounts for these ε: (1−ε)^t½ lands just
    above 1/2), and greedy takes eos at t½ even where float64 rounds p(eos) onto a tie with a
    lower-index token (eos logit −100: σ(100) rounds to 1, so p(eos) = 1/2 exactly in float64 at
    ε = 1/2, t = 1)."""
    import math
    from fractions import Fraction

    bound = nmst_fast.termination_bound(eps)
    assert (1 - Fraction(eps)) ** bound <= Fraction(1, 2) < (1 - Fraction(eps)) ** (bound - 1)
    assert bound >= math.ceil(math.log(2.0) / -math.log1p(-eps))
    model = _ConstantLogits(torch.tensor([60.0, 0.0, 0.0, -100.0], dtype=torch.float64), eps).double()
    out = generate(model, torch.zeros(2, 1, dtype=torch.long), strategy="greedy", max_length=bound + 5)
    assert out.terminated.all() and (out.lengths == bound).all()
    assert (out.tokens[:, : bound - 1] == 0).all() and (out.tokens[:, bound - 1] == 3).all()


def test_metrics():
    lengths = torch.tensor([3, 10, 100, 5])
    terminated = torch.tensor([True, True, False, True])
    assert metrics.non_termination_ratio(lengths, 5, terminated) == 0.5  # 10 and the unterminated one
    assert metrics.non_termination_ratio(lengths, 100, terminated) == 0.25
    assert metrics.non_termination_curve(lengths, [1, 5, 10], terminated) == {1: 1.0, 5: 0.5, 10: 0.25}
    assert metrics.log_grid(1000)[0] == 1 and metrics.log_grid(1000)[-1] == 1000
    assert metrics.log_grid(1) == [1]
    for bad in (dict(max_length=0), dict(max_length=2.5), dict(max_length=True),
                dict(max_length=10, points_per_decade=0), dict(max_length=10, points_per_decade=-1)):
        with pytest.raises(ValueError, match="max_length|points_per_decade"):
            metrics.log_grid(**bad)
    counts, edges = metrics.length_histogram(lengths, bins=[0, 10, 1000])
    assert counts.tolist() == [2, 2]
    assert metrics.perplexity(0.0, 10) == 1.0
    assert metrics.perplexity(1e6, 1) == float("inf")
    with pytest.raises(ValueError):
        metrics.non_termination_ratio([], 5)
    for bad_L in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="L must"):
            metrics.non_termination_ratio(lengths, bad_L, terminated)
    with pytest.raises(ValueError, match="terminated"):
        metrics.non_termination_ratio(lengths, 5, [True])
    # Plain lengths without a mask are eos positions: a continuation without eos is one past L.
    assert metrics.non_termination_ratio([3, 10, float("inf"), 5], 5) == 0.5


def test_metrics_take_a_generation_output():
    """A run cut at max_length reports its unfinished continuations at that length: passing the
    run's output (lengths and terminated mask together) counts them as not terminated."""
    model = TinyRNN(head="va", eps=0.05, eos_bias=-30.0)
    out = generate(model, _contexts(), strategy="greedy", max_length=20)
    assert not out.terminated.any() and (out.lengths == 20).all()
    assert metrics.non_termination_ratio(out, 20) == 1.0
    assert metrics.non_termination_curve(out, [5, 20]) == {5: 1.0, 20: 1.0}
    with pytest.raises(ValueError, match="terminated"):
        metrics.non_termination_ratio(out, 20, out.terminated)


@pytest.mark.parametrize("head", ["nmst", "st", "va"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_rows_learned_finished_late_leave_the_same_output(head, impl, monkeypatch):
    """On a GPU the host learns a finished row a few steps late (its mask is copied behind the step),
    keeps it in the batch, masked, and drops finished rows only once they are a quarter of it. Here
    the host is made to learn 3 steps late: greedy decoding gives exactly the tokens, lengths,
    termination and scores of learning at once, rows past their end read -1, and the batch shrank
    later, in drops of a quarter of it or more."""
    import nmst_fast.generation as generation

    # Lengths from 1 to 30 (VA: one row never ends) with these eos biases.
    model = TinyRNN(head=head, seed=4, eos_bias={"nmst": -4.0, "st": 4.0, "va": 1.0}[head]).to(DEVICE)
    contexts = _contexts(B=16, seed=5).to(DEVICE)
    prompt = generate(model, contexts, strategy="greedy", max_length=30, impl=impl)
    at_once = list(model.rows_seen)
    model.rows_seen.clear()
    monkeypatch.setattr(generation, "HOST_LAG", 3)
    late = generate(model, contexts, strategy="greedy", max_length=30, impl=impl)
    assert torch.equal(late.tokens, prompt.tokens) and torch.equal(late.lengths, prompt.lengths)
    assert torch.equal(late.terminated, prompt.terminated)
    torch.testing.assert_close(late.scores, prompt.scores, rtol=1e-6, atol=1e-6)  # other batch shapes: fp32 rounding
    positions = torch.arange(late.tokens.shape[1], device=late.tokens.device)
    assert bool((late.tokens[positions >= late.lengths[:, None]] == -1).all())
    assert int(late.lengths.max()) == late.tokens.shape[1]
    assert len(set(prompt.lengths.tolist())) >= 4
    # Finished rows stayed a while (more rows fed), left in drops of at least a quarter of the batch.
    assert sum(model.rows_seen) > sum(at_once) and model.rows_seen == sorted(model.rows_seen, reverse=True)
    drops = [a - b for a, b in zip(model.rows_seen, model.rows_seen[1:]) if a != b]
    assert all(drop >= max(1, int(0.25 * a)) for drop, a in zip(drops, sorted(set(model.rows_seen), reverse=True)))


def test_sampled_rows_learned_finished_late_stay_consistent(monkeypatch):
    """Top-k sampling with the host learning finished rows 2 steps late: every continuation's score
    is the model's log-probability of its tokens, terminated rows end in eos, and no token follows
    a row's end."""
    import nmst_fast.generation as generation

    monkeypatch.setattr(generation, "HOST_LAG", 2)
    model = TinyRNN(head="nmst", seed=2).double()
    contexts = _contexts(B=12, seed=3)
    out = generate(model, contexts, strategy="top_k", top_k=4, max_length=20,
                   generator=torch.Generator().manual_seed(6))
    eos = model.nmst_head.eos_index
    for b in range(contexts.shape[0]):
        n = int(out.lengths[b])
        seq = out.tokens[b, :n]
        assert bool((out.tokens[b, n:] == -1).all()) and bool((seq[:-1] != eos).all())
        assert bool(out.terminated[b]) == (int(seq[-1]) == eos)
        expected = sum(float(model.sequence_log_probs(contexts[b], seq[:i])[seq[i]]) for i in range(n))
        assert float(out.scores[b]) == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_a_nan_row_is_reported_once_the_loop_ends():
    """The kernels' flags stay on the device during the loop and are read once at its end: a model
    whose logits turn NaN for one row makes ``generate`` raise, naming the step's bad row."""
    model = TinyRNN(head="va", seed=1, eos_bias=-50.0).to(DEVICE)  # no row ends before the NaN
    real_decode = model.decode_step

    def decode_step(tokens, h):
        out, h = real_decode(tokens, h)
        return out.index_fill(0, torch.tensor([0], device=out.device), float("nan")), h

    model.decode_step = decode_step
    for impl in ("torch", "triton"):
        with pytest.raises(ValueError, match="row 0"):
            generate(model, _contexts(B=3).to(DEVICE), strategy="greedy", max_length=8, impl=impl)


def test_min_p_truncates_the_sampled_tokens():
    """generate's min_p reaches the step: with min_p = 1 only the most probable token of each step is ever drawn, as
    greedy takes it (ties aside: random float logits have none)."""
    model = TinyRNN()
    greedy = generate(model, _contexts(), strategy="greedy", max_length=6)
    drawn = generate(model, _contexts(), strategy="nucleus", top_p=0.99, min_p=1.0, max_length=6,
                     generator=torch.Generator().manual_seed(0))
    assert torch.equal(drawn.tokens, greedy.tokens) and torch.equal(drawn.lengths, greedy.lengths)
