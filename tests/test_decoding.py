"""Decoding: exact step distributions, tie rules, and sampling tested as distributions."""

import math

import pytest
import torch
from scipy import stats

import nmst_fast
from nmst_fast.decoding import effective_logits, ranked_candidates, sample, step_log_probs, truncated_candidates
from nmst_fast.reference import truncated_distribution

from helpers import G_TEST_MIN_P, g_test_p

HEADS = ("nmst", "st", "va")
DRAWS = 1_000_000
# The sampling grid's size in the fast set (the default `pytest tests`): every case at a tenth of DRAWS,
# which flags a 12% error in a token of probability 0.05 at p < 10⁻⁵ (DRAWS: 4%); DRAWS under -m slow.
GRID_FAST_DRAWS = 100_000


def _row(gen: torch.Generator, V: int = 24) -> torch.Tensor:
    """A row of logits with ties (duplicates) and a wide range."""
    z = torch.randn(V, generator=gen, dtype=torch.float64) * 2
    z[5] = z[9] = z[3]  # a three-way tie
    return z.float()


def _reference_log_probs(z: torch.Tensor, head: str, eos: int, eps: float, t: int) -> torch.Tensor:
    if head == "st":  # ST at step t from a constant eos logit history: build the sequence
        seq = z.double().expand(1, t, -1)
        return nmst_fast.nmst_log_probs(seq, eos_index=eos, eps=eps, head="st")[0, -1]
    return nmst_fast.nmst_log_probs(z.double().unsqueeze(0), eos_index=eos, eps=eps, head=head,
                                    steps=torch.tensor([t]))[0]


def _st_state_before(z: torch.Tensor, eos: int, eps: float, t: int) -> torch.Tensor:
    state = None
    for step in range(1, t):
        _, state = step_log_probs(z.unsqueeze(0), head="st", eos_index=eos, eps=eps, steps=step, state=state)
    return state


@pytest.mark.parametrize("head", HEADS)
def test_step_log_probs_match_reference_along_a_sequence(head):
    gen = torch.Generator().manual_seed(1)
    B, T, V, eos = 3, 9, 13, 4
    z = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 3
    steps = torch.arange(-2, T - 2).expand(B, T)  # three context positions first
    ref = nmst_fast.nmst_log_probs(z, eos_index=eos, eps=0.05, head=head,
                                   steps=steps.clamp(min=0) if head == "nmst" else steps)
    state = None
    for t in range(T):
        lp, state = step_log_probs(z[:, t], head=head, eos_index=eos, eps=0.05,
                                   steps=max(t - 2, 0) if head == "nmst" else t - 2, state=state)
        torch.testing.assert_close(lp.exp(), ref[:, t].exp(), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("head", ["nmst", "st"])
def test_temperature_leaves_p_eos_alone(head):
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(4, 30, generator=gen, dtype=torch.float64)
    base, _ = step_log_probs(z, head=head, eos_index=7, eps=0.01, steps=12)
    hot, _ = step_log_probs(z, head=head, eos_index=7, eps=0.01, steps=12, temperature=0.3)
    torch.testing.assert_close(hot[:, 7], base[:, 7])
    non_eos = torch.cat([z[:, :7], z[:, 8:]], 1) / 0.3
    expected = torch.log_softmax(non_eos, 1) + torch.log1p(-hot[:, 7].exp()).unsqueeze(1)
    torch.testing.assert_close(torch.cat([hot[:, :7], hot[:, 8:]], 1), expected)
    va, _ = step_log_probs(z, head="va", eos_index=7, temperature=0.3)
    torch.testing.assert_close(va, torch.log_softmax(z / 0.3, 1))


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("eos,ties", [(11, True), (0, True), (39, True), (11, False), (39, False)])
def test_ranking_is_by_probability_ties_to_lower_index(head, dtype, eos, ties):
    """Exact ranking with many ties (rounded logits) and without (topk's own order then stands), eos
    inside the row or at either end (a selection over the view without it)."""
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(6, 40, generator=gen)
    z = z.round() if ties else z
    d = effective_logits(z.to(dtype), head=head, eos_index=eos, eps=0.3, steps=2)
    if head != "va":  # make eos tie exactly with a token on one row, before and after it
        d.eos_zeta[0] = d.zeta[0, 3].double()
        d.eos_zeta[1] = d.zeta[1, 30].double()
        d.eos_log_prob = d.eos_zeta - d.log_norm  # the tie in log p too, as the edited ζ_eos gives it
    full = d.log_probs()
    expected = torch.sort(full, dim=1, descending=True, stable=True).indices
    for k in (1, 7, 18, 19, 20, 33, 40):  # partial selection below V/2, one stable sort from there
        tokens, log_p = ranked_candidates(d, k)
        assert torch.equal(tokens, expected[:, :k]), k
        torch.testing.assert_close(log_p, full.gather(1, expected[:, :k]))


def test_flat_nucleus_takes_two_rounds(monkeypatch):
    """A flat row's nucleus is most of V: the mass still missing after the first candidate
    list proves how many more it needs, so the second list covers it (not log₄ V rounds)."""
    import nmst_fast.decoding.selection as selection

    rounds = []
    real = selection.ranked_candidates
    monkeypatch.setattr(selection, "ranked_candidates", lambda d, k: rounds.append(k) or real(d, k))
    V = 10_000
    for dtype in (torch.float32, torch.float64):
        rounds.clear()
        d = effective_logits(torch.zeros(3, V, dtype=dtype), head="va", eos_index=0)
        tokens, q = truncated_candidates(d, None, 0.9)
        assert len(rounds) == 2, dtype
        kept = q > 0
        n = int(kept.sum(dim=1)[0])
        # Exactly 9000 in both: L keeps its max apart in float64 (float32's logsumexp rounded log V
        # up, so each p fell short of 1/V and the cut took one token more).
        assert n == 9000, dtype
        assert torch.equal(tokens[kept].view(3, -1), torch.arange(n).expand(3, -1))  # ties → lower index


TRUNCATIONS = [(None, None), (3, None), (None, 0.6), (5, 0.7), (30, None), (None, 1.0)]
# ST's state at step t is built by stepping t−1 times, so its grid stops at t = 50; NMST takes t
# straight from the argument and is also checked at t = 10^6; VA does not depend on t.
STEPS = {"nmst": [1, 50, 10**6], "st": [1, 50], "va": [1]}
SAMPLING_GRID = [(head, t, k, p) for head in HEADS for t in STEPS[head] for k, p in TRUNCATIONS]


def check_sampling_distribution(head: str, t: int, top_k, top_p, *, impl: str = "auto", device: str = "cpu",
                                draws: int = DRAWS) -> None:
    """``draws`` samples of one random row (fresh seed) G-tested against the float64 truncated reference."""
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    eos, eps = 2, 0.002
    z = _row(gen)
    state = _st_state_before(z, eos, eps, t) if head == "st" else None
    reference = truncated_distribution(_reference_log_probs(z, head, eos, eps, t).unsqueeze(0), top_k, top_p)[0]
    rows = z.to(device).unsqueeze(0).expand(draws, -1)
    tokens, _ = sample(rows, head=head, eos_index=eos, eps=eps, steps=t, top_k=top_k, top_p=top_p,
                       state=None if state is None else state.to(device).expand(draws), impl=impl,
                       generator=torch.Generator().manual_seed(seed + 1))
    assert g_test_p(tokens.cpu(), reference) > G_TEST_MIN_P, f"seed={seed}"


@pytest.mark.parametrize("draws", [pytest.param(DRAWS, marks=pytest.mark.slow), GRID_FAST_DRAWS])
@pytest.mark.parametrize("head,t,top_k,top_p", SAMPLING_GRID)
def test_sampling_distribution(head, t, top_k, top_p, draws):
    check_sampling_distribution(head, t, top_k, top_p, draws=draws)


MIN_P_CASES = [(None, None, 0.1), (None, 0.9, 0.2), (None, 0.3, 0.02), (5, None, 0.3), (30, 0.9, 0.05),
               (None, None, 0.0), (None, None, 1.0)]


# The torch path's per-row host finish serves top-k only.
MIN_P_PATHS = [(path, *case) for path in ("torch", "torch-host-rows", "cpu-kernel") for case in MIN_P_CASES
               if path != "torch-host-rows" or case[0] is not None]


@pytest.mark.parametrize("path,top_k,top_p,min_p", MIN_P_PATHS)
@pytest.mark.parametrize("head", HEADS)
def test_min_p_distribution(head, path, top_k, top_p, min_p):
    """Min-p after top-k and top-p (the tokens with at least min_p times the most probable one's probability), on
    every CPU path: the torch path's candidate lists, its per-row host finish (batches of up to 32 rows, top-k
    only), and the C++ kernel; G-tested against the float64 reference, eos inside, at t = 30 and T = 0.7."""
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    eos, eps, t, temperature, draws = 2, 0.002, 30, 0.7, GRID_FAST_DRAWS
    z = _row(gen)
    z[eos] = 1.5
    log_p = _reference_log_probs(z / temperature if head == "va" else torch.cat(
        [z[:eos] / temperature, z[eos:eos + 1], z[eos + 1:] / temperature]), head, eos, eps, t)
    reference = truncated_distribution(log_p[None], top_k, top_p, min_p)[0]
    state = _st_state_before(z, eos, eps, t) if head == "st" else None
    step = nmst_fast.decoding.DecodingStep(head=head, eos_index=eos, vocab_size=z.numel(), eps=eps, top_k=top_k,
                                           top_p=top_p, min_p=min_p, temperature=temperature,
                                           impl="auto" if path == "cpu-kernel" else "torch")
    rows = 32 if path == "torch-host-rows" else draws
    draw_gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.cat([step(z.expand(rows, -1), steps=t, state=None if state is None else state.expand(rows),
                             generator=draw_gen).tokens for _ in range(draws // rows)])
    assert g_test_p(tokens, reference) > G_TEST_MIN_P, f"seed={seed}"


@pytest.mark.parametrize("kw,error", [(dict(min_p=1.5), ValueError), (dict(min_p=-0.1), ValueError),
                                      (dict(min_p="0.1"), TypeError), (dict(min_p=True), TypeError)])
def test_bad_min_p(kw, error):
    with pytest.raises(error, match="min_p"):
        sample(torch.randn(2, 100), head="nmst", eos_index=0, **kw)


def test_triton_refuses_min_p():
    with pytest.raises(ValueError, match="min_p"):
        nmst_fast.decoding.DecodingStep(head="nmst", eos_index=0, vocab_size=100, min_p=0.1, impl="triton")


@pytest.mark.parametrize("t", [1, 7, 300])
def test_eos_frequency_matches_alpha(t):
    gen = torch.Generator().manual_seed(5)
    eps, eos = 0.01, 0
    z = _row(gen, V=16)
    tokens, _ = sample(z.unsqueeze(0).expand(DRAWS, -1), head="nmst", eos_index=eos, eps=eps, steps=t, generator=gen)
    alpha = 1 - (1 - torch.sigmoid(z[eos].double()).item()) * (1 - eps) ** t
    freq = (tokens == eos).double().mean().item()
    assert abs(freq - alpha) <= 5 * math.sqrt(alpha * (1 - alpha) / DRAWS) + 1e-9


def test_top_p_boundary_mass_hits_p_exactly():
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]], dtype=torch.float64)
    d = effective_logits(probs.log(), head="va", eos_index=3)
    for p, kept in [(0.5, 1), (0.75, 2), (0.75 + 1e-6, 3), (0.875, 3), (1.0, 4)]:
        tokens, q = truncated_candidates(d, None, p)
        assert int((q > 0).sum()) == kept, p
    ties = torch.tensor([[0.4, 0.2, 0.2, 0.2]], dtype=torch.float64)
    tokens, q = truncated_candidates(effective_logits(ties.log(), head="va", eos_index=0), None, 0.6)
    assert tokens[0, q[0] > 0].tolist() == [0, 1]  # the tie at the boundary goes to the lower index
    tokens, q = truncated_candidates(effective_logits(ties.log(), head="va", eos_index=0), 2, None)
    assert tokens[0, q[0] > 0].tolist() == [0, 1]


def test_top_k_at_least_vocab_and_single_token_nucleus():
    z = torch.tensor([[3.0, 1.0, 2.0]])
    tokens, q = truncated_candidates(effective_logits(z, head="va", eos_index=0), 10, None)
    assert sorted(tokens[0].tolist()) == [0, 1, 2] and q.sum().item() == pytest.approx(1.0)
    tokens, q = truncated_candidates(effective_logits(z, head="va", eos_index=0), None, 1e-9)
    assert tokens[0, q[0] > 0].tolist() == [0]


@pytest.mark.parametrize("head", HEADS)
def test_greedy_matches_float64_argmax(head):
    gen = torch.Generator().manual_seed(6)
    z = torch.randn(500, 50, generator=gen).round(decimals=1)
    steps = torch.randint(0, 400, (500,), generator=gen)
    tokens, _ = sample(z, head=head, eos_index=9, eps=0.01, steps=steps, top_k=1)
    lp, _ = step_log_probs(z.double(), head=head, eos_index=9, eps=0.01, steps=steps)
    assert torch.equal(tokens, torch.argmax(lp, dim=1))


@pytest.mark.parametrize("eos", [0, 4, 9])
def test_greedy_ties_with_eos_go_to_the_lower_index(eos):
    """Greedy == the first entry of the exact ranking, with eos tied to the row maximum on either
    side of it, ties among non-eos tokens across eos, and eos at either end of the vocabulary."""
    from nmst_fast.decoding import greedy

    gen = torch.Generator().manual_seed(eos)
    z = torch.randn(64, 10, generator=gen).round()  # many exact ties
    d = effective_logits(z, head="nmst", eos_index=eos, eps=0.3, steps=2)
    non_eos = torch.cat([d.zeta[:, :eos], d.zeta[:, eos + 1:]], dim=1)
    d.eos_zeta[:32] = non_eos[:32].amax(dim=1).double()  # eos ties the best token on half the rows
    d.zeta[:, eos] = d.eos_zeta.float()
    d.eos_log_prob = d.eos_zeta - d.log_norm
    expected = torch.sort(d.log_probs(), dim=1, descending=True, stable=True).indices[:, 0]
    assert torch.equal(greedy(d), expected)
    assert torch.equal(greedy(d), ranked_candidates(d, 1)[0].squeeze(1))


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("eos,V", [(0, 30), (13, 30), (29, 30), (20000, 17500 * 2)])
def test_greedy_log_probs_are_the_token_log_probs(head, eos, V):
    """The greedy step's log p is the distribution's log p of its token (to the rounding of L's
    float32 sum, which the step takes over the row with eos masked) and its token the exact best."""
    from nmst_fast.decoding import DecodingStep, greedy

    gen = torch.Generator().manual_seed(eos + V)
    z = torch.randn(8, V, generator=gen) * 4
    z[:4, eos] += 12.0  # eos wins on some rows
    steps, state = torch.arange(8) * 5, torch.full((8,), -0.5) if head == "st" else None
    d = effective_logits(z, head=head, eos_index=eos, eps=0.05, steps=steps, state=state)
    out = DecodingStep(head=head, eos_index=eos, vocab_size=V, eps=0.05, top_k=1)(z, steps=steps, state=state)
    assert torch.equal(out.tokens, greedy(d)) and out.log_probs.dtype == torch.float64
    torch.testing.assert_close(out.log_probs, d.token_log_probs(out.tokens), rtol=1e-6, atol=1e-6)


def test_first_max_by_blocks_is_the_first_maximum():
    """Long CPU rows take their maximum by block maxima: the value and first column of torch.argmax,
    with ties within and across blocks, the maximum in the last block (which overlaps the one before
    it), rows repeated with stride 0, and short rows (plain argmax)."""
    from nmst_fast.decoding.selection import first_max

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    for n in (16 * 1024, 16 * 1024 + 1, 50256, 70001, 300):
        z = torch.randint(-4, 5, (5, n), generator=gen).float()  # ties everywhere
        z[1] = torch.randn(n, generator=gen)
        z[2, n - 3], z[3, max(0, n - 1024 - 2)], z[3, n - 5] = 9.0, 9.0, 9.0  # the last block, and the overlap
        for rows in (z, z[:1].expand(3, -1), z[:, 1:]):
            value, column = first_max(rows)
            assert column == rows.argmax(dim=1).tolist() and value == rows.amax(dim=1).tolist(), n


@pytest.mark.parametrize("eos", [0, 20000, 40999])
def test_greedy_on_long_rows_matches_float64_argmax(eos):
    """Greedy over rows long enough for the block maxima, with exact ties on either side of eos."""
    gen = torch.Generator().manual_seed(eos)
    z = torch.randint(-6, 7, (6, 41000), generator=gen).float() / 2
    steps = torch.tensor([1, 5, 40, 200, 0, 3])
    tokens, _ = sample(z, head="nmst", eos_index=eos, eps=0.02, steps=steps, top_k=1)
    lp, _ = step_log_probs(z.double(), head="nmst", eos_index=eos, eps=0.02, steps=steps)
    assert torch.equal(tokens, torch.argmax(lp, dim=1))


@pytest.mark.parametrize("eps", [1e-3, 0.05, 0.3])
def test_greedy_nmst_emits_eos_by_the_bound(eps):
    gen = torch.Generator().manual_seed(7)
    bound = nmst_fast.termination_bound(eps)
    z = torch.randn(2000, 64, generator=gen) * 20  # arbitrary, often very confident logits
    tokens, _ = sample(z, head="nmst", eos_index=63, eps=eps, steps=bound, top_k=1)
    assert (tokens == 63).all()
    for top_k, top_p in [(2, None), (4, None), (None, 0.2), (None, 0.4)]:  # eos survives every truncation
        d = effective_logits(z, head="nmst", eos_index=63, eps=eps, steps=bound)
        kept, q = truncated_candidates(d, top_k, top_p)
        assert ((kept == 63) & (q > 0)).any(dim=1).all()


def test_generator_reproducible_and_nan_rows_rejected():
    z = torch.randn(64, 100)
    a, _ = sample(z, head="nmst", eos_index=0, steps=3, top_p=0.9, generator=torch.Generator().manual_seed(1))
    b, _ = sample(z, head="nmst", eos_index=0, steps=3, top_p=0.9, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    bad = z.clone()
    bad[5, 17] = float("nan")
    for head in HEADS:
        with pytest.raises(ValueError, match="row 5"):
            sample(bad, head=head, eos_index=0, steps=3)
    bad_eos = z.clone()
    bad_eos[2, 0] = float("nan")
    with pytest.raises(ValueError, match="row 2"):
        sample(bad_eos, head="nmst", eos_index=0, steps=3, top_k=1)


@pytest.mark.parametrize("kw,name", [(dict(top_k=0), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                                     (dict(temperature=0.0), "temperature"), (dict(eos_index=100), "eos_index"),
                                     (dict(head="x"), "head"), (dict(eps=1.0), "eps"), (dict(steps=1.5), "steps"),
                                     (dict(temperature=float("inf")), "temperature"), (dict(generator=3), "generator")])
def test_bad_arguments(kw, name):
    args = dict(head="nmst", eos_index=0, steps=1)
    args.update(kw)
    with pytest.raises((ValueError, TypeError), match=name):
        sample(torch.randn(2, 100), **args)


@pytest.mark.parametrize("value", [float("nan"), 0.5])
def test_invalid_st_state_is_rejected(value):
    """ST's state is a log(1 − α) ≤ 0: a NaN or positive entry raises naming the state on every path
    (it used to give out-of-range tokens, index errors or NaN log-probs); −inf (eos certain) is valid."""
    from nmst_fast.decoding import beam_step

    z = torch.randn(2, 10)
    state = torch.tensor([value, -1.0], dtype=torch.float64)
    for kw in (dict(), dict(top_k=1), dict(top_k=3), dict(top_p=0.5)):
        with pytest.raises(ValueError, match="state"):
            sample(z, head="st", eos_index=0, state=state, impl="torch", **kw)
    with pytest.raises(ValueError, match="state"):
        step_log_probs(z, head="st", eos_index=0, state=state)
    with pytest.raises(ValueError, match="state"):
        beam_step(z, torch.zeros(2, dtype=torch.float64), num_beams=2, head="st", eos_index=0, state=state)
    certain = torch.tensor([float("-inf"), -1.0], dtype=torch.float64)
    tokens, _ = sample(z, head="st", eos_index=0, state=certain, top_k=1)
    assert tokens[0] == 0


def test_sampling_needs_no_gradient():
    """Logits straight from a model (requires_grad) sample on every path; step_log_probs keeps the
    graph (a differentiable distribution)."""
    layer = torch.nn.Linear(8, 200)
    logits = layer(torch.randn(3, 8))
    for kw in (dict(), dict(top_k=1), dict(top_k=5), dict(top_p=0.9), dict(top_p=0.999), dict(top_k=50, top_p=0.9)):
        for head in HEADS:
            tokens, _ = sample(logits, head=head, eos_index=0, steps=2, impl="torch", **kw)
            assert tokens.shape == (3,) and not tokens.requires_grad
    log_p, _ = step_log_probs(logits, head="nmst", eos_index=0, steps=2)
    log_p[:, 1].sum().backward()
    assert layer.weight.grad is not None


def test_empty_batch():
    from nmst_fast.decoding import beam_step

    z = torch.randn(0, 10)
    for head in HEADS:
        assert step_log_probs(z, head=head, eos_index=0)[0].shape == (0, 10)
        for kw in (dict(), dict(top_k=1), dict(top_k=3), dict(top_p=0.5), dict(top_k=3, top_p=0.5)):
            assert sample(z, head=head, eos_index=0, **kw)[0].shape == (0,)
        cand = beam_step(z, torch.zeros(0), num_beams=2, head=head, eos_index=0)
        assert cand.tokens.shape == (0, 2)


def test_beam_step_rejects_bad_arguments():
    from nmst_fast.decoding import beam_step

    z, scores = torch.randn(4, 10), torch.zeros(4, dtype=torch.float64)
    args = dict(num_beams=2, head="nmst", eos_index=0)
    for bad, exc in [(0, ValueError), (-1, ValueError), (2.5, ValueError), (True, ValueError)]:
        with pytest.raises(exc, match="num_candidates"):
            beam_step(z, scores, num_candidates=bad, **args)
    with pytest.raises(TypeError, match="logits"):
        beam_step(z.tolist(), scores, **args)
    with pytest.raises(TypeError, match="beam_scores"):
        beam_step(z, scores.tolist(), **args)
    with pytest.raises(ValueError, match="logits"):
        beam_step(z[0], scores, **args)
    for bad_score in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="beam_scores"):
            beam_step(z, torch.tensor([0.0, bad_score, 0.0, 0.0], dtype=torch.float64), **args)
    beam_step(z, torch.tensor([0.0, float("-inf"), 0.0, float("-inf")], dtype=torch.float64), **args)


@pytest.mark.parametrize("V, p", [(100, 0.5), (1000, 0.25)])
def test_float32_nucleus_of_equal_logits_stops_at_exactly_p(V, p):
    """Equal float32 logits: the first V·p tokens (ties → lower index) hold exactly p, so the
    nucleus is exactly them — drawn from, never past (the float32 L took one token more)."""
    z = torch.zeros(50_000, V)
    tokens, _ = sample(z, head="va", eos_index=V - 1, top_p=p, generator=torch.Generator().manual_seed(V))
    assert int(tokens.max()) == int(V * p) - 1
    counts = torch.bincount(tokens, minlength=int(V * p)).double()
    assert stats.chisquare(counts.numpy()).pvalue > 1e-4  # uniform over the nucleus


def test_float32_distribution_sums_to_one_at_large_logits():
    """L from a float32 logsumexp carried ulp(L) (1e-3 at |z| ~ 1e4) into every log-prob."""
    gen = torch.Generator().manual_seed(31)
    for scale in (100.0, 1e4):
        z = torch.randn(8, 5000, generator=gen) * scale / 3 + scale
        for head in HEADS:
            log_p, _ = step_log_probs(z, head=head, eos_index=7, eps=1e-3, steps=3)
            assert abs(float(torch.logsumexp(log_p, dim=1).abs().max())) < 1e-6, (scale, head)


def test_st_context_steps_keep_p_eos_at_zero_and_the_state():
    """t <= 0 is context: p(eos) = 0 for ST too; a carried state passes through unchanged (it was
    read as this step's log(1 − α), p(eos) = 1 − e^state)."""
    z = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    state = torch.tensor([-1.0, -0.1, -30.0, float("-inf")], dtype=torch.float64)
    for t in (0, -2, torch.tensor([0, 0, -1, 0])):
        log_p, new_state = step_log_probs(z, head="st", eos_index=0, eps=0.1, steps=t, state=state)
        assert (log_p[:, 0] == float("-inf")).all() and torch.equal(new_state, state)
        torch.testing.assert_close(log_p[:, 1:], torch.log_softmax(z[:, 1:], dim=1), rtol=0, atol=1e-12)
        tokens, drawn_state = sample(z.expand(1000, -1, -1).reshape(-1, 6), head="st", eos_index=0, eps=0.1,
                                     steps=t if isinstance(t, int) else t.repeat(1000), state=state.repeat(1000),
                                     generator=torch.Generator().manual_seed(0))
        assert (tokens != 0).all() and torch.equal(drawn_state, state.repeat(1000))
    log_p, new_state = step_log_probs(z, head="st", eos_index=0, eps=0.1, steps=1, state=state)
    # The next live step goes on from the carried state.
    assert float(log_p[0, 0].exp()) > 0.5 and (new_state[:3] < state[:3]).all() and new_state[3] == float("-inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_beam_step_ties_on_equal_eos_go_to_the_lower_beam(dtype):
    """Two beams with equal scores and equal eos logits: p(eos) is the same on both, so the tie goes
    to beam 0; log p(eos) came as ζ_eos − log_norm, whose rounding followed each row's L."""
    from nmst_fast.decoding import beam_step

    z = torch.tensor([[1.0, -0.106, 0.188, -2.299, 3.298, 8.270], [1.0, -2.795, -4.516, -1.983, 3.970, 0.111]],
                     dtype=dtype)
    for eps, steps in ((0.3, 5), (0.01, 2), (1e-5, 70_000)):
        c = beam_step(z, torch.zeros(2, dtype=torch.float64), num_beams=2, head="nmst", eos_index=0, eps=eps,
                      steps=steps, num_candidates=2)
        log_p, _ = step_log_probs(z, head="nmst", eos_index=0, eps=eps, steps=steps)
        if (c.tokens == 0).all():
            assert c.beam_rows.tolist() == [[0, 1]] and c.scores[0, 0] == c.scores[0, 1]
        assert log_p[0, 0] == log_p[1, 0]


def test_sample_names_bad_logits_and_steps_out_of_int64():
    z = torch.randn(2, 5)
    for bad in (z.tolist(), z.numpy(), None):
        with pytest.raises(TypeError, match="logits"):
            sample(bad, head="nmst", eos_index=0)
    for steps in (2**63, -(2**63) - 1, 2**70):
        for call in (sample, step_log_probs):
            with pytest.raises(ValueError, match="steps"):
                call(z, head="nmst", eos_index=0, steps=steps)


@pytest.mark.parametrize("top_k", [4, 8])
def test_rows_with_fewer_finite_tokens_than_k_list_eos_once(top_k):
    """Three finite logits (eos among them), the rest −inf: the tie redo of the top-k selection
    masked eos to −inf and took it back among the −inf entries, so eos was listed twice and drawn
    with twice its mass (0.67 for 0.505); beam search got two finished copies of one hypothesis."""
    from nmst_fast.decoding import beam_step

    V = 50
    z = torch.full((1, V), float("-inf"))
    z[0, 10], z[0, 20], z[0, 0] = 1.0, 0.5, 0.0
    d = effective_logits(z, head="nmst", eos_index=0, eps=1e-2, steps=1)
    tokens, log_p = ranked_candidates(d, top_k)
    assert int((tokens == 0).sum()) == 1 and tokens[0, :3].tolist() == [0, 10, 20]
    assert torch.isinf(log_p[0, 3:]).all()
    draws, _ = sample(z.expand(200_000, -1), head="nmst", eos_index=0, eps=1e-2, steps=1, top_k=top_k,
                      impl="torch", generator=torch.Generator().manual_seed(top_k))
    want = step_log_probs(z, head="nmst", eos_index=0, eps=1e-2, steps=1)[0][0, [0, 10, 20]].exp()
    counts = torch.bincount(draws, minlength=V)[[0, 10, 20]].double()
    assert int(counts.sum()) == draws.numel()
    assert stats.chisquare(counts.numpy(), (want * draws.numel()).numpy()).pvalue > 1e-4
    c = beam_step(z.expand(4, -1), torch.tensor([0.0, float("-inf"), 0.0, float("-inf")], dtype=torch.float64),
                  num_beams=2, head="nmst", eos_index=0, eps=1e-2, steps=1, num_candidates=top_k)
    finite = torch.isfinite(c.scores)
    assert [sorted(c.tokens[i][finite[i]].tolist()) for i in range(2)] == [[0, 10, 20]] * 2
