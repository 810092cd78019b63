"""Top-p alone on the CPU path by rejection (nmst_fast/decoding/rejection.py) and the inverse-CDF draw.

The rank sets are checked exactly against float64 keys for every candidate; the draws as
distributions (10⁶ draws, G-test against the float64 truncated reference) on every way a row
can finish: accepted in a round, finished by ranking after a rejection, or after the last round.
"""

import pytest
import torch

from nmst_fast.decoding import distribution, effective_logits, sample, selection
from nmst_fast.decoding.reference import truncated_distribution
from nmst_fast.decoding.rejection import _Ranking, nucleus_by_rejection
from nmst_fast.decoding.truncation import draw, search_cdf

from test_decoding import DRAWS, _g_test, _reference_log_probs, _st_state_before

EOS = 2


def _rank_keys(d) -> torch.Tensor:
    """The selection paths' rank keys in float64, built the obvious way."""
    if d.zeta.dtype == torch.float64:
        return d.log_probs()
    keys = d.zeta.double()
    if d.eos_zeta is not None:
        keys[:, d.eos_index] = d.eos_zeta
    return keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("head", ["nmst", "va"])
def test_ranked_before_is_exact_for_every_candidate(head, dtype):
    gen = torch.Generator().manual_seed(11)
    z = (torch.randn(6, 40, generator=gen) * 2).round()  # many exact ties
    eos = 11
    d = effective_logits(z.to(dtype), head=head, eos_index=eos, eps=0.3, steps=2)
    if head != "va" and dtype == torch.float32:
        # eos exactly tied with a token before it and with one after it; just above and just below
        # a token's value (its nearest float32 then lies below resp. above ζ_eos).
        for row, source, nudge in [(0, 3, 0), (1, 30, 0), (2, 5, 1), (3, 25, -1)]:
            value = d.zeta[row, source].double()
            if nudge:
                value = torch.nextafter(value, value + nudge)
            d.eos_zeta[row] = value
            d.eos_log_prob[row] = value - d.log_norm[row]
            d.zeta[row, eos] = value.float()
    keys = _rank_keys(d)
    columns = torch.arange(keys.shape[1])
    ranking = _Ranking(d)
    for c in range(keys.shape[1]):
        candidates = torch.full((keys.shape[0],), c)
        key = keys[:, c:c + 1]
        expected = (keys > key) | ((keys == key) & (columns < c))
        assert torch.equal(ranking.before(candidates), expected), c
    torch.testing.assert_close(ranking.probs, d.log_probs().exp(), rtol=0, atol=0)


def _row(gen: torch.Generator, V: int, scale: float) -> torch.Tensor:
    z = torch.randn(V, generator=gen, dtype=torch.float64) * scale
    z[5] = z[9] = z[3]  # a three-way tie
    return z.float()


# (head, t, top_p, logit scale, rounds, finish_size): accepted or finished after round 0 (rounds=1),
# rounds only (finish_size=0, so rows rejected PASSES_BEFORE_RANKING times end by ranking), the default mix;
# ε = 0.05 at t = 30 puts eos near the top, at t = 4 in the middle of the ranks.
REJECTION_CASES = [
    ("nmst", 30, 0.3, 1.0, 1, 4096),
    ("nmst", 4, 0.75, 2.0, 8, 0),
    ("st", 6, 0.6, 1.5, 8, 4096),
    ("va", 1, 0.95, 1.0, 3, 0),
    ("va", 1, 0.5, 3.0, 8, 4096),
]


@pytest.mark.parametrize("head,t,top_p,scale,rounds,finish_size", REJECTION_CASES)
def test_rejection_draws_the_nucleus(head, t, top_p, scale, rounds, finish_size):
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    eps = 0.05
    z = _row(gen, 40, scale)
    state = _st_state_before(z, EOS, eps, t) if head == "st" else None
    reference = truncated_distribution(_reference_log_probs(z, head, EOS, eps, t).unsqueeze(0), None, top_p)[0]
    d = effective_logits(z.unsqueeze(0).expand(DRAWS, -1), head=head, eos_index=EOS, eps=eps, steps=t,
                         state=None if state is None else state.expand(DRAWS))
    tokens = nucleus_by_rejection(d, top_p, torch.Generator().manual_seed(seed + 1), rounds=rounds,
                                  finish_size=finish_size)
    assert _g_test(tokens, reference) > 1e-5, f"seed={seed}"


def test_sample_takes_rejection_past_the_first_list(monkeypatch):
    """Through ``sample``: a first list of 8 leaves a flat row's nucleus uncovered, so every row
    draws by rejection with those 8 as known members (a draw among them is kept at once)."""
    monkeypatch.setattr(selection, "_FIRST_CANDIDATES", 8)
    calls = []
    real = selection.nucleus_by_rejection
    monkeypatch.setattr(selection, "nucleus_by_rejection",
                        lambda *a, **k: calls.append(a[0].zeta.shape) or real(*a, **k))
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    z = _row(gen, 40, 0.7)
    z[EOS] = -4.0  # p(eos) ≈ 0.2 at t = 20: the nucleus keeps ≥ 22 tokens (3000 seeds tried), never ≤ 8
    reference = truncated_distribution(_reference_log_probs(z, "nmst", EOS, 0.01, 20).unsqueeze(0), None, 0.9)[0]
    assert int((reference > 0).sum()) > 8
    tokens, _ = sample(z.unsqueeze(0).expand(DRAWS, -1), head="nmst", eos_index=EOS, eps=0.01, steps=20, top_p=0.9,
                       generator=torch.Generator().manual_seed(seed + 1))
    assert sum(shape[0] for shape in calls) == DRAWS and {shape[1] for shape in calls} == {40}  # by row blocks
    assert _g_test(tokens, reference) > 1e-5, f"seed={seed}"


def test_mixed_batch_draws_inside_each_rows_nucleus():
    """Peaked rows settle on the first list, flat ones by rejection: every draw must lie in its own
    row's float64 nucleus, and the same generator seed gives the same draws."""
    gen = torch.Generator().manual_seed(4)
    V = 3000
    scales = torch.tensor([0.1, 8.0, 1.0, 0.5, 3.0]).repeat(40)
    z = torch.randn(scales.numel(), V, generator=gen) * scales.unsqueeze(1)
    z[7] = 0.0  # one flat row: every token tied
    for head in ("nmst", "va"):
        nucleus = truncated_distribution(
            effective_logits(z, head=head, eos_index=EOS, eps=0.01, steps=40).log_probs(), None, 0.8) > 0
        draws = [sample(z, head=head, eos_index=EOS, eps=0.01, steps=40, top_p=0.8,
                        generator=torch.Generator().manual_seed(9))[0] for _ in range(2)]
        assert torch.equal(draws[0], draws[1])
        assert bool(nucleus.gather(1, draws[0].unsqueeze(1)).all()), head
    flat = nucleus[7].nonzero().squeeze(1)  # the flat row: the lowest 80% of the indices (float32's
    assert len(flat) in (2400, 2401) and torch.equal(flat, torch.arange(len(flat)))  # L may tip one)


def test_bad_rounds():
    d = effective_logits(torch.zeros(2, 10), head="va", eos_index=0)
    with pytest.raises(ValueError, match="rounds"):
        nucleus_by_rejection(d, 0.5, None, rounds=0)


def test_inverse_cdf_never_lands_on_a_zero_weight():
    weights = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.0], [0.0, 0.0, 0.0, 1e-300, 0.0]], dtype=torch.float64)
    cdf = torch.cumsum(weights, dim=1)
    largest_uniform = 1.0 - 2.0**-53  # u · total may round up to total
    for u, expected in [(0.0, [1, 3]), (largest_uniform, [3, 3]), (0.6666, [1, 3]), (0.6667, [3, 3])]:
        found = search_cdf(cdf, torch.full((2, 1), u, dtype=torch.float64)).squeeze(1)
        assert found.tolist() == expected, u
    tokens = draw(weights.repeat(50_000, 1), torch.Generator().manual_seed(0)).view(-1, 2)
    assert set(tokens[:, 0].tolist()) == {1, 3} and set(tokens[:, 1].tolist()) == {3}


def test_row_blocks_and_the_blocked_logsumexp(monkeypatch):
    """CPU work goes by blocks of rows (bounded temporaries); L over non-eos is the same by blocks."""
    assert distribution.row_blocks(5, 10**9) == [slice(i, i + 1) for i in range(5)]  # one row at least
    monkeypatch.setattr(distribution, "BLOCK_ENTRIES", 100)
    blocks = distribution.row_blocks(23, 30)
    assert blocks[0] == slice(0, 3) and blocks[-1] == slice(21, 23) and len(blocks) == 8
    z = torch.randn(23, 30, dtype=torch.float64) * 5
    for column in (0, 13, 29):
        masked = z.clone()
        masked[:, column] = -torch.inf
        expected = torch.logsumexp(masked, dim=1)
        torch.testing.assert_close(distribution._row_logsumexp(z, without=column), expected, rtol=1e-14, atol=0)
    torch.testing.assert_close(distribution._row_logsumexp(z), torch.logsumexp(z, dim=1), rtol=1e-14, atol=0)
