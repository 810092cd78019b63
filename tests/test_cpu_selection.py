"""The torch path's top-p list growth (``impl="torch"``), its inverse-CDF draw and its blocks of rows (CPU).

Draws are checked as distributions (10⁶ draws, G-test against the float64 truncated reference) or
against each row's float64 nucleus.
"""

import pytest
import torch

from nmst_fast.decoding import distribution, effective_logits, sample, selection
from nmst_fast.decoding.truncation import draw, search_cdf
from nmst_fast.reference import truncated_distribution

from helpers import G_TEST_MIN_P, g_test_p
from test_decoding import DRAWS, GRID_FAST_DRAWS, _reference_log_probs

EOS = 2


def _row(gen: torch.Generator, V: int, scale: float) -> torch.Tensor:
    z = torch.randn(V, generator=gen, dtype=torch.float64) * scale
    z[5] = z[9] = z[3]  # a three-way tie
    return z.float()


@pytest.mark.parametrize("draws", [pytest.param(DRAWS, marks=pytest.mark.slow), GRID_FAST_DRAWS])
def test_top_p_list_grows_past_the_first_size(monkeypatch, draws):
    """Through ``sample``: a first list of 8 leaves a flat row's nucleus uncovered, so the list grows
    (to the size the missing mass proves) and the draw still follows the truncated reference."""
    monkeypatch.setattr(selection, "_FIRST_CANDIDATES", 8)
    sizes = []
    real = selection.ranked_candidates
    monkeypatch.setattr(selection, "ranked_candidates", lambda d, k: sizes.append(k) or real(d, k))
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    z = _row(gen, 40, 0.7)
    z[EOS] = -4.0  # p(eos) ≈ 0.2 at t = 20: the nucleus keeps ≥ 22 tokens (3000 seeds tried), never ≤ 8
    reference = truncated_distribution(_reference_log_probs(z, "nmst", EOS, 0.01, 20).unsqueeze(0), None, 0.9)[0]
    assert int((reference > 0).sum()) > 8
    tokens, _ = sample(z.unsqueeze(0).expand(draws, -1), head="nmst", eos_index=EOS, eps=0.01, steps=20, top_p=0.9,
                       generator=torch.Generator().manual_seed(seed + 1), impl="torch")
    assert sizes[0] == 8 and len(sizes) > 1
    assert g_test_p(tokens, reference) > G_TEST_MIN_P, f"seed={seed}"


def test_mixed_batch_draws_inside_each_rows_nucleus():
    """Peaked rows settle on the first list, flat ones on a grown one: every draw must lie in its own
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
    wide = torch.empty(5, 1).expand(5, 10**9)
    assert distribution.row_blocks(wide) == [slice(i, i + 1) for i in range(5)]  # one row at least
    monkeypatch.setattr(distribution, "BLOCK_ENTRIES", 100)
    blocks = distribution.row_blocks(torch.empty(23, 30))
    assert blocks[0] == slice(0, 3) and blocks[-1] == slice(21, 23) and len(blocks) == 8
    z = torch.randn(23, 30, dtype=torch.float64) * 5
    for column in (0, 13, 29):
        masked = z.clone()
        masked[:, column] = -torch.inf
        expected = torch.logsumexp(masked, dim=1)
        torch.testing.assert_close(distribution._row_logsumexp(z, without=column), expected, rtol=1e-14, atol=0)
    torch.testing.assert_close(distribution._row_logsumexp(z), torch.logsumexp(z, dim=1), rtol=1e-14, atol=0)
