"""The torch path's small batches (nmst_fast/decoding/host_rows.py): each row of greedy and top-k
finished in Python floats, against the tensor path and the float64 sort-based reference."""

import pytest
import torch
from scipy import stats

from nmst_fast.decoding import DecodingStep, effective_logits, greedy, step_log_probs
from nmst_fast.decoding.host_rows import MAX_ROWS
from nmst_fast.reference import truncated_distribution

from helpers import G_TEST_MIN_P, g_test_p

HEADS = ("nmst", "st", "va")


def _seed() -> int:
    return torch.seed() % 2**31


def _inputs(head, B, V, eos, gen, dtype=torch.float32, scale=4.0):
    z = (torch.randn(B, V, generator=gen, dtype=torch.float64) * scale).to(dtype)
    z[: B // 2, eos] += 3 * scale  # eos wins on some rows
    steps = torch.randint(-1, 400, (B,), generator=gen)
    state = -torch.rand(B, generator=gen, dtype=torch.float64) if head == "st" else None
    return z, steps, state


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("B,V,eos", [(1, 30, 0), (5, 30, 13), (MAX_ROWS + 7, 30, 29), (3, 40961, 20000),
                                     (2, 40961, 40960)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_greedy_is_the_tensor_paths(head, B, V, eos, temperature):
    """Token, log p and ST's state as the exact ranking and the tensor path's distribution give them
    (log p to the rounding of L's float32 sum), on rows short and long enough for the block maxima,
    with eos at either end."""
    seed = _seed()
    z, steps, state = _inputs(head, B, V, eos, torch.Generator().manual_seed(seed))
    z[-1] = z[-1].round()  # exact ties across blocks
    step = DecodingStep(head=head, eos_index=eos, vocab_size=V, eps=0.05, top_k=1, temperature=temperature)
    out = step(z, steps=steps, state=state)
    dist = effective_logits(z, head=head, eos_index=eos, eps=0.05, steps=steps, state=state, temperature=temperature)
    assert torch.equal(out.tokens, greedy(dist)), f"seed={seed}"
    torch.testing.assert_close(out.log_probs, dist.token_log_probs(out.tokens), rtol=1e-6, atol=1e-6)
    assert out.log_probs.dtype == torch.float64
    if head == "st":
        torch.testing.assert_close(out.state, dist.state, rtol=1e-15, atol=0)
    else:
        assert out.state is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("eps,t", [(1e-9, 10**7), (0.5, 1), (1e-5, 69315)])
def test_greedy_dtypes_extreme_logits_and_eps(dtype, eps, t):
    """Half and double logits, |z| ~ 1e4, tiny ε at large t and large ε (where p(eos) and the best
    token's p tie at 1/2): the tensor path's ranking and log p."""
    gen = torch.Generator().manual_seed(_seed())
    z = (torch.randn(6, 300, generator=gen) * 1e4).to(dtype)
    out = DecodingStep(head="nmst", eos_index=7, vocab_size=300, eps=eps, top_k=1)(z, steps=t)
    dist = effective_logits(z, head="nmst", eos_index=7, eps=eps, steps=t)
    assert torch.equal(out.tokens, greedy(dist))
    torch.testing.assert_close(out.log_probs, dist.token_log_probs(out.tokens), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("eos", [2, 23])
@pytest.mark.parametrize("top_k,top_p,temperature", [(3, None, 1.0), (5, 0.7, 0.7), (30, None, 1.0), (2, 0.3, 1.3)])
def test_top_k_draws_follow_the_reference(head, eos, top_k, top_p, temperature):
    """19,200 draws of one row with a three-way tie (MAX_ROWS per call), G-tested against the float64
    sort-based truncation of the exact step distribution; log p of each draw is its exact log p. Eos
    inside the row (ζ copied, eos masked) and last (ζ read in place)."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    V, eps, t = 24, 0.05, 9
    z = torch.randn(V, generator=gen, dtype=torch.float64) * 2
    z[5] = z[9] = z[3]
    z = z.float()
    state = torch.tensor([-0.3], dtype=torch.float64) if head == "st" else None
    exact, _ = step_log_probs(z[None].double(), head=head, eos_index=eos, eps=eps, steps=t, state=state,
                              temperature=temperature)
    reference = truncated_distribution(exact, top_k, top_p)[0]
    step = DecodingStep(head=head, eos_index=eos, vocab_size=V, eps=eps, top_k=top_k, top_p=top_p,
                        temperature=temperature)
    rows = z.expand(MAX_ROWS, -1)
    states = None if state is None else state.expand(MAX_ROWS)
    draws = torch.Generator().manual_seed(seed + 1)
    tokens = []
    for _ in range(600):
        out = step(rows, steps=t, state=states, generator=draws)
        tokens.append(out.tokens)
        torch.testing.assert_close(out.log_probs, exact[0, out.tokens], rtol=1e-6, atol=1e-6)
    assert g_test_p(torch.cat(tokens), reference) > G_TEST_MIN_P, f"seed={seed}"


def test_rows_with_fewer_finite_tokens_than_k():
    """Three finite logits, eos among them: eos is listed once (the masked column is not taken back)
    and the draws follow the three tokens' probabilities."""
    V = 50
    z = torch.full((MAX_ROWS, V), float("-inf"))
    z[:, 10], z[:, 20], z[:, 0] = 1.0, 0.5, 0.0
    step = DecodingStep(head="nmst", eos_index=0, vocab_size=V, eps=1e-2, top_k=8)
    gen = torch.Generator().manual_seed(_seed())
    tokens = torch.cat([step(z, steps=1, generator=gen).tokens for _ in range(500)])
    want = step_log_probs(z[:1], head="nmst", eos_index=0, eps=1e-2, steps=1)[0][0, [0, 10, 20]].exp()
    counts = torch.bincount(tokens, minlength=V)[[0, 10, 20]].double()
    assert int(counts.sum()) == tokens.numel()
    assert stats.chisquare(counts.numpy(), (want * tokens.numel()).numpy()).pvalue > 1e-4


@pytest.mark.parametrize("top_k", [1, 4])
@pytest.mark.parametrize("bad", ["nan", "inf", "all_neg_inf", "nan_eos"])
def test_rows_without_a_distribution_are_refused(top_k, bad):
    z = torch.randn(3, 40, generator=torch.Generator().manual_seed(_seed()))
    if bad == "nan":
        z[1, 7] = float("nan")
    elif bad == "inf":
        z[1, 7] = float("inf")
    elif bad == "all_neg_inf":
        z[1, 1:] = float("-inf")
    else:
        z[1, 0] = float("nan")
    step = DecodingStep(head="nmst", eos_index=0, vocab_size=40, top_k=top_k)
    with pytest.raises(ValueError, match="logits row 1 "):
        step(z, steps=0 if bad == "nan_eos" else 3)


@pytest.mark.parametrize("value", [float("nan"), 0.5])
def test_invalid_st_state_is_refused(value):
    step = DecodingStep(head="st", eos_index=0, vocab_size=10, top_k=2)
    with pytest.raises(ValueError, match="state"):
        step(torch.randn(2, 10), state=torch.tensor([-0.1, value]))


@pytest.mark.parametrize("top_k", [1, 3])
def test_empty_batch(top_k):
    out = DecodingStep(head="st", eos_index=0, vocab_size=10, top_k=top_k)(torch.randn(0, 10), steps=1)
    assert out.tokens.shape == out.log_probs.shape == out.state.shape == (0,)


def test_block_topk_is_topk():
    """Long CPU rows by block maxima: torch.topk's values, at columns holding them, with the maximum in
    the tail past the last whole block, several rows, and ties at the block maxima (whole-row topk)."""
    from nmst_fast.decoding.selection import block_topk

    gen = torch.Generator().manual_seed(_seed())
    for V in (64 * 300, 64 * 300 + 17, 50257):
        for n in (2, 51):
            z = torch.randn(3, V, generator=gen)
            z[0, -3] = 50.0
            for rows in (z, z[:, 1:], z[1:2]):
                values, columns = block_topk(rows, n)
                assert values == torch.topk(rows, n, dim=1).values.tolist()
                assert all(rows[r, c].item() == v for r in range(rows.shape[0])
                           for c, v in zip(columns[r], values[r]))
                assert all(len(set(row)) == n for row in columns)
        ties = torch.randint(0, 3, (2, V), generator=gen).float()
        assert block_topk(ties, 5)[0] == torch.topk(ties, 5, dim=1).values.tolist()


@pytest.mark.parametrize("head,eos", [("nmst", 20000), ("nmst", 40960), ("va", 0)])
@pytest.mark.parametrize("top_k", [5, 50])
def test_long_rows_rank_as_the_tensor_path(head, eos, top_k):
    """Rows long enough for the block top-k, with exact ties everywhere: the host's ranked top-k
    tokens are the tensor path's (ties → lower index)."""
    from nmst_fast.decoding.host_rows import HostRows
    from nmst_fast.decoding.selection import top_tokens

    gen = torch.Generator().manual_seed(_seed())
    z = torch.randn(4, 40961, generator=gen) * 3
    z[2:] = z[2:].round()  # ties inside and across the top k
    rows = HostRows(head=head, eos_index=eos, eps=0.01, temperature=1.0, top_k=top_k, top_p=None)
    picked = [row[2] for row in rows._reduce(z)]
    want, _ = top_tokens(z, top_k, exclude=eos if head != "va" else None)
    assert picked == want.tolist()


@pytest.mark.parametrize("top_k", [1, 3])
@pytest.mark.parametrize("rows", [1, MAX_ROWS + 1])
def test_an_infinite_eos_logit_is_certain_eos_but_not_in_context(top_k, rows):
    """s = +inf: p(eos) = 1 at t >= 1 (eos, log p 0), and 0 in the context (t <= 0), where the best
    other token is drawn with a finite log p; on the host rows and the tensor path alike."""
    z = torch.randn(rows, 20, generator=torch.Generator().manual_seed(_seed()))
    z[:, 4] = float("inf")
    step = DecodingStep(head="nmst", eos_index=4, vocab_size=20, eps=0.01, top_k=top_k)
    live = step(z, steps=3, generator=torch.Generator().manual_seed(0))
    assert (live.tokens == 4).all() and (live.log_probs == 0).all()
    context = step(z, steps=0, generator=torch.Generator().manual_seed(0))
    assert (context.tokens != 4).all() and torch.isfinite(context.log_probs).all()
    dist = effective_logits(z, head="nmst", eos_index=4, eps=0.01, steps=0)
    assert torch.isfinite(dist.log_norm).all() and (dist.eos_log_prob == float("-inf")).all()
