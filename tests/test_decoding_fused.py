"""The one-read Triton selection (interpreter on CPU, real GPU when present): exact greedy and sampling."""

import pytest
import torch

import nmst_fast.decoding
from nmst_fast.decoding import DecodingStep, effective_logits, sample
from nmst_fast.generation import generate
from nmst_fast.kernels.row_scan import MAX_CANDIDATES

from helpers import DEVICE, FAST_DRAWS, G_TEST_MIN_P, KERNEL_DRAWS, g_test_p, slow
from test_decoding import _reference_log_probs, _row, _st_state_before, check_sampling_distribution

HEADS = ("nmst", "st", "va")


def fused_select(z, *, greedy, generator=None, steps=1, state=None, temperature=1.0, **head):
    """The kernels' greedy or sampling step (``DecodingStep(impl="triton")``, its flags read at once)."""
    step = DecodingStep(vocab_size=z.shape[1], device=z.device, top_k=1 if greedy else None, temperature=temperature,
                        impl="triton", **head)
    return step(z, steps=steps, state=state, generator=generator)


def fused_truncated(z, *, top_k=None, top_p=None, generator=None, steps=1, state=None, temperature=1.0, **head):
    """The kernels' top-k / top-p step (``DecodingStep(impl="triton")``, its flags read at once)."""
    step = DecodingStep(vocab_size=z.shape[1], device=z.device, top_k=top_k, top_p=top_p, temperature=temperature,
                        impl="triton", **head)
    return step(z, steps=steps, state=state, generator=generator)


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_greedy_equals_torch_path(head, temperature):
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(300, 70, generator=gen).round(decimals=1).to(DEVICE)  # many ties
    steps = torch.randint(-2 if head == "st" else 0, 60, (300,), generator=gen).to(DEVICE)
    state = torch.rand(300, generator=gen, dtype=torch.float64).neg().to(DEVICE) if head == "st" else None
    fused, fused_state = sample(z, head=head, eos_index=13, eps=0.02, steps=steps, state=state, top_k=1,
                                temperature=temperature, impl="triton")
    torch_path, torch_state = sample(z, head=head, eos_index=13, eps=0.02, steps=steps, state=state, top_k=1,
                                     temperature=temperature, impl="torch")
    assert torch.equal(fused, torch_path)
    with_top_p, _ = sample(z, head=head, eos_index=13, eps=0.02, steps=steps, state=state, top_k=1, top_p=0.5,
                           temperature=temperature, impl="triton")  # top-p after top-1: still greedy
    assert torch.equal(with_top_p, torch_path)
    if head == "st":
        torch.testing.assert_close(fused_state, torch_state)


@pytest.mark.parametrize("head", HEADS)
def test_fused_log_probs_of_chosen_tokens(head):
    z = (torch.randn(50, 33, generator=torch.Generator().manual_seed(1)) * 2).to(DEVICE)
    picked = fused_select(z, head=head, eos_index=4, eps=0.1, steps=7, greedy=False,
                          generator=torch.Generator().manual_seed(2))
    expected = effective_logits(z, head=head, eos_index=4, eps=0.1, steps=7).token_log_probs(picked.tokens)
    torch.testing.assert_close(picked.log_probs, expected, rtol=1e-6, atol=1e-6)


def _torch_head_math(z, head, eos, eps, steps, state, temperature):
    """L merged in float64 from the same scan's partials, then the head's float64 scalars in torch."""
    from scan_harness import scan_partials

    from nmst_fast.decoding.distribution import eos_terms

    parts = scan_partials(z, eos_index=None if head == "va" else eos, temperature=temperature).parts
    lse = torch.logsumexp(parts["max"].double() + parts["sum"].double().log(), dim=1)
    if head == "va":
        return lse, None, None
    log_norm, eos_zeta, _eos_log_prob, next_state = eos_terms(lse, z[:, eos].double(), head=head, eps=eps,
                                                              steps=steps, state=state)
    return log_norm, eos_zeta, next_state


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("eps", [1e-8, 0.5])
def test_kernel_head_math_equals_torch(head, eps):
    """The select kernel's float64 head math at extreme inputs: every row's greedy token and its
    log-prob equal torch's eos_terms on the same scan; ST's new state too."""
    gen = torch.Generator().manual_seed(int(eps * 1e8) + len(head))
    B, V, eos = 96, 41, 17
    z = (torch.randn(B, V, generator=gen) * 3).to(DEVICE)
    z[:, eos] = torch.tensor([-1e4, -30.0, -3.0, 0.0, 3.0, 30.0, 1e4, 0.5], device=DEVICE).repeat(B // 8)
    z[5] *= 1e3  # logits far from 0
    steps = torch.tensor([0, 1, 2, 7, 1000, 10**5, 10**7, -3], device=DEVICE).repeat_interleave(B // 8)
    state = (-torch.rand(B, generator=gen, dtype=torch.float64) * torch.tensor([1e-12, 1.0, 50.0]).repeat(B // 3)
             ).to(DEVICE) if head == "st" else None
    for temperature in (1.0, 0.7):
        picked = fused_select(z, head=head, eos_index=eos, eps=eps, steps=steps, state=state,
                              temperature=temperature, greedy=True)
        log_norm, eos_zeta, log_surv = _torch_head_math(z, head, eos, eps, steps, state, temperature)
        x = z.double() / temperature
        if head == "va":
            expected = x.gather(1, picked.tokens[:, None]).squeeze(1) - log_norm
        else:
            x[:, eos] = float("-inf")
            top = x.max(dim=1)
            eos_wins = eos_zeta > top.values
            assert torch.equal(picked.tokens == eos, eos_wins)
            expected = torch.where(eos_wins, eos_zeta, top.values) - log_norm
            assert torch.equal(torch.where(eos_wins, eos, top.indices), picked.tokens)
        finite = torch.isfinite(expected)
        assert torch.equal(torch.isfinite(picked.log_probs), finite)
        # atol: logits up to 3e4 cancel in ζ − log_norm, leaving a few float64 ulps of 3e4
        torch.testing.assert_close(picked.log_probs[finite], expected[finite], rtol=1e-12, atol=1e-10)
        if head == "st":
            torch.testing.assert_close(picked.state, log_surv, rtol=1e-13, atol=0)


def test_replicated_rows_share_one_scan_but_not_the_head_math():
    """Greedy over stride-0 rows (one prompt, many continuations) with per-row steps and state."""
    gen = torch.Generator().manual_seed(8)
    z = torch.randn(1, 50, generator=gen).to(DEVICE).expand(64, -1)
    steps = torch.arange(64, device=DEVICE) * 7
    for head in HEADS:
        state = torch.linspace(-1e-3, -2, 64, dtype=torch.float64, device=DEVICE) if head == "st" else None
        fused, fused_state = sample(z, head=head, eos_index=3, eps=0.05, steps=steps, state=state, top_k=1,
                                    impl="triton")
        expected, expected_state = sample(z.contiguous(), head=head, eos_index=3, eps=0.05, steps=steps,
                                          state=state, top_k=1, impl="torch")
        assert torch.equal(fused, expected)
        if head != "va":
            assert 0 < int((fused == 3).sum()) < 64  # eos wins only from some step on
        if head == "st":
            torch.testing.assert_close(fused_state, expected_state, rtol=1e-12, atol=0)


@pytest.mark.parametrize("head,t,draws", [slow("nmst", 1, KERNEL_DRAWS), slow("st", 20, KERNEL_DRAWS),
                                          slow("va", 1, KERNEL_DRAWS), ("st", 20, FAST_DRAWS)])
def test_fused_sampling_distribution(head, t, draws):
    """Draws through ``sample`` (the one-launch scan's draw) G-tested against the float64 reference."""
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    eos, eps = 2, 0.01
    z = _row(gen, V=19)
    state = _st_state_before(z, eos, eps, t) if head == "st" else None
    reference = torch.exp(_reference_log_probs(z, head, eos, eps, t))
    rows = z.to(DEVICE).unsqueeze(0).expand(draws, -1)
    rows_state = None if state is None else state.to(DEVICE).expand(draws)
    tokens, _ = sample(rows, head=head, eos_index=eos, eps=eps, steps=t, state=rows_state, impl="triton",
                       generator=torch.Generator().manual_seed(seed + 1))
    assert g_test_p(tokens.cpu(), reference) > G_TEST_MIN_P, f"seed={seed}"


def test_fused_rejects_large_k_and_nan():
    z = torch.randn(4, 20, device=DEVICE)
    with pytest.raises(ValueError, match="top_k"):
        sample(z, head="nmst", eos_index=0, top_k=MAX_CANDIDATES + 1, impl="triton")
    with pytest.raises(ValueError, match="impl"):
        sample(z, head="nmst", eos_index=0, impl="cuda")
    bad = z.clone()
    bad[3, 5] = float("nan")
    with pytest.raises(ValueError, match="row 3"):
        sample(bad, head="nmst", eos_index=0, top_k=1, impl="triton")


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("top_k,top_p", [(1, None), (None, None), (3, None), (3, 0.5), (None, 0.5)])
def test_deferred_rows_without_a_distribution_get_a_column_until_the_check(head, top_k, top_p):
    """Until ``check`` raises, a deferred step's row without a distribution yields some column in
    [0, V), never VA's eos_index of −1: a loop feeding it to an embedding must not index out of range."""
    z = torch.randn(5, 37, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    z[1] = float("-inf")  # no finite logit
    z[3, 5] = float("nan")
    step = DecodingStep(head=head, eos_index=4, vocab_size=37, device=z.device, top_k=top_k, top_p=top_p,
                        impl="triton")
    tokens = step(z, generator=torch.Generator().manual_seed(0), defer_checks=True).tokens.cpu()
    assert bool(((tokens >= 0) & (tokens < 37)).all()), tokens
    with pytest.raises(ValueError, match="row 1"):
        step.check()


def test_fused_paths_reject_bad_steps_and_state():
    z = torch.randn(4, 20, device=DEVICE)
    for kw in (dict(top_k=1), dict(), dict(top_k=3)):
        for impl in ("triton", "torch"):  # both paths take ST's state by one rule
            with pytest.raises(ValueError, match="state"):
                sample(z, head="st", eos_index=0, state=torch.zeros(3, dtype=torch.float64, device=DEVICE),
                       impl=impl, **kw)
            for not_a_log_prob in (torch.zeros(4, dtype=torch.long, device=DEVICE), [0.0] * 4):
                with pytest.raises(TypeError, match="state"):
                    sample(z, head="st", eos_index=0, state=not_a_log_prob, impl=impl, **kw)
        with pytest.raises(ValueError, match="steps"):
            sample(z, head="nmst", eos_index=0, steps=torch.ones(3, dtype=torch.long, device=DEVICE),
                   impl="triton", **kw)
        with pytest.raises(TypeError, match="steps"):
            sample(z, head="nmst", eos_index=0, steps=torch.ones(4, device=DEVICE), impl="triton", **kw)
        for value in (float("nan"), 0.5):  # not a log(1 − α): the kernels flag the row (no host check)
            state = torch.tensor([-1.0, -2.0, value, -1.0], dtype=torch.float64, device=DEVICE)
            with pytest.raises(ValueError, match="row 2"):
                sample(z, head="st", eos_index=0, state=state, impl="triton",
                       generator=torch.Generator(device=DEVICE).manual_seed(0), **kw)
    bad = z.clone()
    bad[2, 0] = float("nan")  # the eos logit
    with pytest.raises(ValueError, match="row 2"):
        sample(bad, head="nmst", eos_index=0, top_k=3, impl="triton")
    bad[2] = float("-inf")  # no finite logit at all
    with pytest.raises(ValueError, match="row 2"):
        sample(bad, head="va", eos_index=0, impl="triton", generator=torch.Generator().manual_seed(0))


# (BLOCK_V, splits) launches make several splits to merge and several tiles per split (CPU
# interpreter shapes: its tl.topk is slow, so the rows are short).
@pytest.mark.parametrize("V,K,eos,launch,temperature", [(5, 4, 0, None, 1.0), (37, 1, 36, (16, 3), 0.6),
                                                        (300, 64, 7, (64, 2), 1.0), (300, 128, None, (128, 2), 0.6),
                                                        (400, 16, 399, (64, 1), 1.0), (203, 8, 3, (32, 2), 0.6)])
def test_candidates_are_the_exact_top_k(V, K, eos, launch, temperature):
    """Across splits and tiles (several merges and skipped tiles), with many ties: (value desc, index asc)."""
    from scan_harness import row_scan

    gen = torch.Generator().manual_seed(V + K)
    z = (torch.randn(9, V, generator=gen) * 3).round(decimals=0).to(DEVICE)  # heavy ties
    z[1] = z[1].sort().values  # ascending rows: every tile improves the running top-K
    z[2, : V // 2] = float("-inf")
    z[3, ::2] = -0.0  # -0.0 and +0.0 tie: lower index first
    z[4, V // 3:] = float("-inf")  # fewer finite columns than K in the later tiles
    scan = row_scan(z, eos_index=eos, temperature=temperature, candidates=K, launch=launch)
    x = z.double() / temperature
    if eos is not None:
        x[:, eos] = float("-inf")
    order = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :K]
    got = scan["cand_idx"][:, : min(K, V)]
    valid = x.gather(1, order) > float("-inf")
    assert torch.equal(torch.where(valid, got, -1), torch.where(valid, order, -1))
    assert (got[~valid] == -1).all()  # fewer finite columns than K: padding, never a −inf column
    torch.testing.assert_close(scan["cand_val"][:, : min(K, V)].double()[valid], x.gather(1, order)[valid],
                               rtol=1e-6, atol=0)
    masked = x.clone()
    torch.testing.assert_close(scan["lse"].double(), torch.logsumexp(masked, dim=1), rtol=1e-5, atol=1e-5)
    assert torch.equal(scan["top_idx"], order[:, 0])


def _assert_exact_candidates(scan, x, K):
    """``scan``'s candidates are the K best of ``x`` (float64, eos and padding at −inf) by (value desc,
    column asc), with padding (−1) where fewer than K are finite."""
    order = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :K]
    valid = x.gather(1, order) > float("-inf")
    got = scan["cand_idx"][:, :K].cpu()
    assert torch.equal(torch.where(valid, got, -1), torch.where(valid, order, -1))
    assert (got[:, : order.shape[1]][~valid] == -1).all()


@pytest.mark.parametrize("K", [2, 4, 8, 16, 32, 64, 128])
def test_candidates_match_a_stable_sort_on_fresh_rows(K):
    """Candidate scans (the lanes' kept values, and the re-read where they do not settle a split) on
    fresh random rows: random V, tile width and split count, ties, −inf runs, and rows whose best
    values crowd into one lane (lane 3 of the tile raised: the re-read); the K best by (value desc,
    index asc)."""
    from scan_harness import row_scan

    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    block_v = int(2 ** torch.randint(max(3, K.bit_length() - 1), max(7, K.bit_length()), (1,), generator=gen))
    V = int(torch.randint(K + 1, 5 * block_v, (1,), generator=gen))
    launch = (block_v, int(torch.randint(1, 4, (1,), generator=gen)))
    z = torch.randn(8, V, generator=gen) * 2
    z[::2] = z[::2].round()  # ties
    z[1, torch.rand(V, generator=gen) < 0.5] = float("-inf")
    lanes = torch.arange(V) % block_v
    z[5, lanes == 3] += 8.0  # the best values in one lane: more than any depth keeps
    z[6, lanes < 2] += 8.0  # in two lanes
    z[7, lanes == 3] = 7.0  # a lane of ties
    scan = row_scan(z.to(DEVICE), eos_index=None, candidates=K, launch=launch)
    _assert_exact_candidates(scan, z.double(), K)
    assert scan["cand_idx"].shape[1] >= K or V < K, (seed, K, V, launch)


def _runners_up_rows(K: int, block_v: int, eos: int) -> torch.Tensor:
    """Rows whose K best sit in the lanes in each way that decides a candidate scan's path, over a
    floor of distinct low values (lower to the right). Tiles of ``block_v`` columns; 7 tiles."""
    from nmst_fast.kernels.row_scan import PAIR_MAX_K

    V = 7 * block_v
    floor = torch.full((V,), -5.0) - torch.arange(V) * 1e-4
    rows = floor.repeat(9, 1)
    spread = torch.linspace(9.0, 1.0, K)  # the K best in distinct lanes of the last tile
    last = 6 * block_v + torch.arange(K)
    for row in rows:
        row[last] = spread
    kth = spread[-1].item()
    rows[1, [1 * block_v, 2 * block_v]] = torch.tensor([8.5, 8.4])  # lane 0 holds 3 of the best
    rows[2, [1 * block_v, 2 * block_v, 3 * block_v, 4 * block_v]] = torch.tensor([8.5, 8.4, 8.3, 8.2])  # 5 of them
    rows[3, block_v] = kth  # a runner-up equal to the K-th at a lower column: it ranks above it
    # Lane 0 keeps 9 and depth − 1 values above the rest, and pushes out one equal to the K-th at a lower
    # column, which therefore ranks above it (equal is not strictly below: the split is read again).
    depth = 2 if K <= PAIR_MAX_K.value else 3  # the scan's DEPTH
    if K > depth:
        rows[4, block_v] = spread[K - depth]
        rows[4, torch.arange(2, depth + 1) * block_v] = torch.tensor([8.5, 8.4, 8.3])[: depth - 1]
    rows[5] = float("-inf")
    rows[5, [5, 5 + block_v, 5 + 3 * block_v]] = torch.tensor([1.0, 2.0, 3.0])  # fewer finite than K, one lane
    rows[6, eos] = 100.0  # eos is never a candidate
    rows[7, 1 + block_v] = 8.7  # two of the best in lane 1 (a runner-up)
    rows[8, torch.arange(V) % block_v == 2] = 4.0  # a lane of ties
    return rows


@pytest.mark.parametrize("K", [2, 4, 8, 16, 32, 64])
def test_lane_runners_up_and_their_fallback(K):
    """Candidate scans take each lane's max and runners-up (2 values per lane for K <= 16, 3 above) when
    what every lane pushed out ranks below the K-th of them, else read the split again. Rows built for
    each case — the best in distinct lanes, 2, 3 and 5 of them in one lane, a runner-up tied with the
    K-th at a lower column (it enters by key, not value), a pushed-out value equal to the K-th, fewer
    finite columns than K, eos, a lane of ties — all give the exact K best (value desc, column asc)."""
    from scan_harness import row_scan

    block_v = max(16, K)
    eos = 3 * block_v + 7
    z = _runners_up_rows(K, block_v, eos)
    launches = ((block_v, 1), (block_v, 2)) if K <= 16 else ((block_v, 1),)  # (the interpreter's tl.topk is slow)
    for launch in launches:
        scan = row_scan(z.to(DEVICE), eos_index=eos, candidates=K, launch=launch)
        x = z.double()
        x[:, eos] = float("-inf")
        _assert_exact_candidates(scan, x, K)


@pytest.mark.parametrize("K", [4, 16, 64])
def test_candidates_rank_by_tempered_value_where_raw_values_tie_after_rounding(K):
    """Lanes keep values in raw z order, candidates rank by x = z · inv_temp in fp32: adjacent fp32 z near
    1.9 times 0.55 round to one x, so a smaller z at a lower column ranks above a larger one its lane
    kept. One lane holds increasing z (each a new lane max, the kept ones last), the rest of the row far
    below: the candidates are the K best by (x desc, column asc), the dropped lower-column ties included."""
    from scan_harness import row_scan

    block_v = max(16, K)
    V = 12 * block_v
    z = torch.full((1, V), -20.0) - torch.arange(V) * 1e-3
    lane = torch.arange(3, V, block_v)
    z[0, lane] = 1.9 + torch.arange(len(lane), dtype=torch.float32) * 1.1920929e-7  # adjacent fp32 values
    temperature = 1 / 0.55
    scan = row_scan(z, eos_index=None, temperature=temperature, candidates=K, launch=(block_v, 1))
    x = (z * torch.tensor(1.0 / temperature, dtype=torch.float32)).double()
    assert len(set(x[0, lane].tolist())) < len(lane)  # the case exists: some x tie
    _assert_exact_candidates(scan, x, K)


def _split_scan_draw(z, head, eos, eps, t, state, seed, launch):
    """The one-launch drawing step with an int seed, and the partials its scan leaves (the scan alone,
    same seed and launch): (partials, selection)."""
    from scan_harness import scan_partials

    from nmst_fast.kernels.scan_select import scan_select

    seed = torch.tensor([seed], device=DEVICE)
    scan = scan_partials(z, eos_index=None if head == "va" else eos, seed=seed, launch=launch)
    return scan, scan_select(z, head=head, eos_index=eos, eps=eps, temperature=1.0, steps=t, state=state, seed=seed,
                             launch=launch)


def _check_against_torch(picked, z, *, head, eos, eps, steps, state, temperature=1.0, bad=(), greedy=False,
                         top_k=None, top_p=None, msg=""):
    """A kernel step against the torch path on the same logits (``bad``: the rows it must flag, left
    out): greedy tokens exactly; drawn tokens inside the (truncated) support; log-probabilities of
    the chosen tokens and ST's state to float64 rounding of the fp32 partials."""
    B = z.shape[0]
    if hasattr(picked, "flags"):  # a kernel's Selection; the fused step's result has raised on its flags already
        assert picked.flags.tolist() == [min(bad, default=B), B], msg
    ok = torch.ones(B, dtype=torch.bool)
    ok[list(bad)] = False
    rows = z.float().cpu()[ok]
    per_row = isinstance(steps, torch.Tensor)
    dist = effective_logits(rows, head=head, eos_index=eos, eps=eps, temperature=temperature,
                            steps=steps.cpu()[ok] if per_row else steps,
                            state=None if state is None else state.cpu()[ok])
    tokens = picked.tokens.cpu()[ok]
    if greedy:
        assert torch.equal(tokens, nmst_fast.decoding.greedy(dist)), msg
    else:
        kept, probs = nmst_fast.decoding.truncated_candidates(dist, top_k, top_p) if (top_k or top_p) else (None, None)
        allowed = (dist.log_probs() > -torch.inf if kept is None
                   else torch.zeros(rows.shape, dtype=torch.float64).scatter_add(1, kept, probs) > 0)
        assert bool(allowed.gather(1, tokens[:, None]).all()), msg
    scale = max(1.0, float(rows.masked_fill(~torch.isfinite(rows), 0).abs().max()) / temperature)
    torch.testing.assert_close(picked.log_probs.cpu()[ok], dist.token_log_probs(tokens), rtol=1e-6,
                               atol=1e-6 * scale, msg=msg)
    if head == "st":
        torch.testing.assert_close(picked.state.cpu()[ok], dist.state, rtol=1e-12, atol=1e-12, msg=msg)


@pytest.mark.parametrize("head,t,launch,draws", [slow("nmst", 3, (8, 3), KERNEL_DRAWS),
                                                 slow("va", 1, (16, 2), KERNEL_DRAWS), ("nmst", 3, (8, 3), FAST_DRAWS)])
def test_split_scan_draw_distribution_across_tiles_and_splits(head, t, launch, draws):
    """The scan's weighted reservoir over several tiles per split, and the finish's choice of a split:
    draws G-tested against the float64 reference. The row's tiles differ in scale (one tile ~12
    below the rest, the last one raising the running max), and V = 61 leaves a partial tile; (8, 3):
    3 splits of 3 tiles, eos left out of the scan; (16, 2): 2 splits of 2 tiles, every column scanned
    (the finish's per-head math: test_fused_sampling_distribution)."""
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    eos, eps = 2, 0.01
    z = _row(gen, V=61)
    z[8:16] -= 12.0
    z[48:56] += 3.0
    state = _st_state_before(z, eos, eps, t) if head == "st" else None
    reference = torch.exp(_reference_log_probs(z, head, eos, eps, t))
    rows = z.to(DEVICE).unsqueeze(0).expand(draws, -1)
    from nmst_fast.kernels.row_scan import split_layout
    from nmst_fast.kernels.scan_select import scan_select

    assert split_layout(61, *launch)[1] == {(8, 3): 3, (16, 2): 2}[launch]
    picked = scan_select(rows, head=head, eos_index=eos, eps=eps, temperature=1.0, steps=t,
                         state=None if state is None else state.to(DEVICE).expand(draws),
                         seed=torch.tensor([seed + 1], device=DEVICE), launch=launch)
    assert picked.flags.tolist() == [draws, draws]
    assert g_test_p(picked.tokens.cpu(), reference) > G_TEST_MIN_P, f"seed={seed}"


def test_split_scan_draw_is_reproducible_and_never_picks_masked_columns():
    """A seed and launch fix the draws; another seed changes them. Columns of no mass (−inf, and
    whole −inf tiles and splits) and eos (left out of the scan) are never a split's draw, and a
    row whose mass sits in one late tile draws from that tile only."""
    gen = torch.Generator().manual_seed(9)
    z = torch.randn(64, 301, generator=gen).to(DEVICE)
    z[2, :] = -1e4
    z[2, 295] = 1e4  # all the mass in one column of the last tile
    z[:, 128:256] = float("-inf")  # whole tiles and, at (64, 3), the whole second split
    z[1, :290] = float("-inf")
    runs = [_split_scan_draw(z, "nmst", 5, 0.01, 3, None, 77, launch) for launch in [(64, 3), (64, 3), (16, 4)]]
    assert torch.equal(runs[0][1].tokens, runs[1][1].tokens)
    assert not torch.equal(_split_scan_draw(z, "nmst", 5, 0.01, 3, None, 78, (64, 3))[1].tokens, runs[0][1].tokens)
    for scan, picked in runs:
        draws = scan.parts["draw_idx"].long()
        has_mass = scan.parts["sum"] > 0
        drawn = z.gather(1, torch.where(has_mass, draws, 0))
        assert bool(torch.isfinite(drawn[has_mass]).all()) and not bool((draws[has_mass] == 5).any())
        if scan.parts["max"].shape[1] == 3:
            assert not bool(has_mass[:, 1].any())
        assert int(picked.tokens[2]) in (5, 295)
        assert 290 <= int(picked.tokens[1]) or int(picked.tokens[1]) == 5


# (BLOCK_V, splits) forced in the interpreter; None: the automatic layout (on a GPU, split-V: 2 splits
# per row at B = 256, more below).
SCAN_SELECT_LAUNCHES = [None, (64, 1), (64, 3), (32, 7), (16, 13)]


@pytest.mark.parametrize("launch", SCAN_SELECT_LAUNCHES)
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("draw", [False, True])
def test_scan_select_equals_torch(head, draw, launch):
    """The one-launch step (each row finished by the last of its splits) against the torch path, for
    every head, greedy and the draw, one to 13 splits: greedy tokens exactly, drawn tokens of positive
    probability, the chosen tokens' log-probabilities and ST's states. On a GPU the batch is large
    (the rows' last arrivals race each other: a row finished from a split's partials not yet visible
    would differ), with ties, −inf columns, per-row steps, context rows, and a NaN row and a row
    without a finite non-eos logit, both flagged."""
    from nmst_fast.kernels.scan_select import scan_select

    seed_value = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed_value)
    B = 2048 if DEVICE == "cuda" else 24
    V = 50257 if DEVICE == "cuda" and launch is None else 200
    eos, eps, temperature = 7, 0.01, 0.8
    z = torch.randn(B, V, generator=gen) * 3
    z[::3] = z[::3].round()  # ties, across splits too
    z[1, torch.rand(V, generator=gen) < 0.7] = float("-inf")
    z[4] = float("-inf")  # no finite logit: flagged (the first bad row)
    z[9, 17] = float("nan")
    steps = torch.randint(-1, 40, (B,), generator=gen)
    state = -torch.rand(B, generator=gen, dtype=torch.float64) if head == "st" else None
    seed = torch.tensor([seed_value + 1], device=DEVICE) if draw else None
    for dtype in (torch.float32, torch.bfloat16):
        rows = z.to(dtype).to(DEVICE)
        picked = scan_select(rows, head=head, eos_index=eos, eps=eps, temperature=temperature, steps=steps.to(DEVICE),
                             state=None if state is None else state.to(DEVICE), seed=seed, launch=launch)
        _check_against_torch(picked, rows, head=head, eos=eos, eps=eps, steps=steps, state=state,
                             temperature=temperature, bad=(4, 9), greedy=not draw, msg=f"seed={seed_value} {dtype}")


@pytest.mark.parametrize("head,launch,top_k,top_p", [  # a forced tile holds the 2..16 candidates
    (head, launch, k, p) for head in HEADS for launch in SCAN_SELECT_LAUNCHES
    for k, p in [(1, None), (4, None), (3, 0.6), (10, 0.9)]
    if launch is None or launch[0] >= max(2, 1 << (k - 1).bit_length()) and launch[1] * k < 100]  # (CI's time)
    + [("st", (64, 3), 20, 0.9)])  # K = 32: tl.topk per entering tile (slow in the interpreter: once)
def test_scan_select_top_k_equals_torch(head, top_k, top_p, launch):
    """The one-launch top-k (then top-p) step against the torch path: every drawn token inside the
    float64 truncated set, its log-probability and ST's state, for every head and one to 13 splits;
    on a GPU over a large batch, where the rows' last arrivals race."""
    from nmst_fast.kernels.scan_select import scan_select

    seed_value = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed_value)
    B = 2048 if DEVICE == "cuda" else 24
    V = 50257 if DEVICE == "cuda" and launch is None else 200
    eos, eps = 7, 0.01
    z = torch.randn(B, V, generator=gen) * 3
    z[::3] = z[::3].round()
    z[1, torch.rand(V, generator=gen) < 0.9] = float("-inf")  # fewer finite logits than some k
    z[5, 11] = float("nan")  # flagged
    steps = torch.randint(-1, 40, (B,), generator=gen)
    state = -torch.rand(B, generator=gen, dtype=torch.float64) if head == "st" else None
    picked = scan_select(z.to(DEVICE), head=head, eos_index=eos, eps=eps, temperature=1.0, steps=steps.to(DEVICE),
                         state=None if state is None else state.to(DEVICE),
                         seed=torch.tensor([seed_value + 1], device=DEVICE), top_k=top_k,
                         top_p_threshold=top_p, launch=launch)
    _check_against_torch(picked, z, head=head, eos=eos, eps=eps, steps=steps, state=state, bad=(5,),
                         greedy=top_k == 1, top_k=top_k, top_p=top_p, msg=f"seed={seed_value}")


def _workspace_sync(device):
    """Every sync slot of the stream's step buffers, all layouts."""
    from nmst_fast.kernels import workspace

    layouts = workspace._BUFFERS[workspace.stream_key(torch.device(device))]
    return torch.cat([buffers[0] for buffers in layouts.values()])


@pytest.mark.parametrize("mode", ["greedy", "draw", "top-k"])
def test_scan_select_leaves_its_workspace_at_zero(mode):
    """No fill precedes the one-launch step: its arrival counters and the count of finished rows must
    be zero again when every launch ends — through layouts of 3 and 13 splits, a batch that shrinks and
    grows, flagged rows — and each step must still be right (a count left over would finish rows
    early, or never)."""
    from nmst_fast.kernels.scan_select import scan_select

    seed_value = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed_value)
    for launch in [(64, 3), (16, 13)]:
        for B in [24, 5, 24]:
            z = (torch.randn(B, 200, generator=gen) * 3).to(DEVICE)
            z[B // 2, 3] = float("nan")  # flagged
            seed = None if mode == "greedy" else torch.tensor([seed_value + B], device=DEVICE)
            args = dict(head="st", eos_index=7, eps=0.01, steps=5, state=None)
            truncation = dict(top_k=3, top_p_threshold=0.8) if mode == "top-k" else {}
            picked = scan_select(z, temperature=0.9, seed=seed, launch=launch, **truncation, **args)
            assert not bool(_workspace_sync(DEVICE).any()), f"seed={seed_value} {launch} B={B}"
            _check_against_torch(picked, z, head="st", eos=7, eps=0.01, steps=5, state=None, temperature=0.9,
                                 bad=(B // 2,), greedy=mode == "greedy", top_k=truncation.get("top_k"),
                                 top_p=truncation.get("top_p_threshold"), msg=f"seed={seed_value} {launch} B={B}")


def test_scan_select_zeroes_its_workspace_when_a_launch_fails(monkeypatch):
    """A launch that raises (an interpreter error, a compile failure) may have counted some rows in:
    the wrapper zeroes the workspace, so the next step is right."""
    import nmst_fast.kernels.scan_select as scan_select_module

    class _Fails:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                args[-1].fill_(3)  # the sync slots: counted in, then the launch dies
                raise RuntimeError("launch failed")
            return launch

    z = torch.randn(6, 40, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    args = dict(head="nmst", eos_index=2, eps=0.05, temperature=1.0, steps=3, state=None, seed=None,
                launch=(16, 3))
    real = scan_select_module._scan_select_kernel
    monkeypatch.setattr(scan_select_module, "_scan_select_kernel", _Fails())
    with pytest.raises(RuntimeError, match="launch failed"):
        scan_select_module.scan_select(z, **args)
    assert not bool(_workspace_sync(DEVICE).any())
    monkeypatch.setattr(scan_select_module, "_scan_select_kernel", real)
    picked = scan_select_module.scan_select(z, **args)
    _check_against_torch(picked, z, head="nmst", eos=2, eps=0.05, steps=3, state=None, greedy=True)


def test_scan_select_refuses_bad_truncation():
    from nmst_fast.kernels.scan_select import scan_select

    z = torch.randn(2, 10).to(DEVICE)
    args = dict(head="nmst", eos_index=1, eps=0.1, temperature=1.0, steps=1, state=None)
    with pytest.raises(ValueError, match="seed"):
        scan_select(z, seed=None, top_k=2, **args)
    with pytest.raises(ValueError, match="top_k"):
        scan_select(z, seed=torch.tensor([1]), top_k=0, **args)
    # k >= V keeps every token (the candidate list covers the row).
    picked = scan_select(z, seed=torch.tensor([1], device=DEVICE), top_k=16, **args)
    assert picked.flags.tolist() == [2, 2] and bool(((picked.tokens >= 0) & (picked.tokens < 10)).all())


@pytest.mark.parametrize("greedy", [True, False])
def test_rows_repeated_with_stride_zero(greedy):
    """One prompt, several continuations (rows expanded with stride 0, per-row steps): the one-launch
    step reads each row as it is, and agrees with the torch path; top-k and top-p as well."""
    z = torch.randn(1, 50, generator=torch.Generator().manual_seed(3)).to(DEVICE).expand(6, -1)
    steps = torch.arange(6, device=DEVICE) * 40
    picked = fused_select(z, head="nmst", eos_index=2, eps=0.05, steps=steps, greedy=greedy,
                          generator=torch.Generator(device=DEVICE).manual_seed(0))
    _check_against_torch(picked, z, head="nmst", eos=2, eps=0.05, steps=steps, state=None, greedy=greedy)
    for top_k, top_p in ((3, 0.8), (None, 0.8)):
        picked = fused_truncated(z, head="nmst", eos_index=2, eps=0.05, steps=steps, top_k=top_k, top_p=top_p,
                                 generator=torch.Generator(device=DEVICE).manual_seed(0))
        _check_against_torch(picked, z, head="nmst", eos=2, eps=0.05, steps=steps, state=None, top_k=top_k,
                             top_p=top_p)


# The one-launch top-k, then top-p, as a distribution: every row of the G-test batch is scanned, and its
# candidate list (a tl.sort per program) makes 3·10⁴ draws the interpreter's affordable size (its
# exactness: test_scan_select_top_k_equals_torch). Top-p alone is the row draw, G-tested per head in
# test_row_draw.
@pytest.mark.parametrize("head,t,top_k,top_p", [("nmst", 10**6, 3, None), ("st", 50, 4, 0.7)])
def test_fused_truncated_sampling_distribution(head, t, top_k, top_p):
    check_sampling_distribution(head, t, top_k, top_p, impl="triton", device=DEVICE,
                                draws=30_000 if DEVICE == "cpu" else KERNEL_DRAWS)


# Logits exact in fp32 whose probabilities are exact binary fractions or ties, so the cut is
# decided by the math, not by fp32 rounding of the logits.
@pytest.mark.parametrize("logits,top_k,top_p", [
    ([0, 0, 0, 0], None, 0.5), ([0, 0, 0, 0], None, 0.5 + 1e-6), ([0, 0, 0, 0], None, 0.75),
    ([0, 1, 1, 1], 2, None), ([0, 1, 1, 1], 3, 0.5), ([0, 1, 1, 1], 8, None), ([2, 0, 0, 0, 0], None, 0.9)])
def test_fused_truncation_boundaries(logits, top_k, top_p):
    """Mass hitting p exactly, ties at the cut (→ lower index), k >= V: the fused draw's kept set and
    frequencies equal the float64 reference truncation."""
    from nmst_fast.decoding.selection import truncated_candidates

    z = torch.tensor([logits], dtype=torch.float64)
    tokens, kept = truncated_candidates(effective_logits(z, head="va", eos_index=0), top_k, top_p)
    expected = torch.zeros(len(logits), dtype=torch.float64).scatter_add(0, tokens[0], kept[0])
    rows = 200_000 if top_k is None else 10_000  # the one-launch top-k scans every row (interpreted)
    draws, _ = sample(z.float().to(DEVICE).expand(rows, -1), head="va", eos_index=0, top_k=top_k,
                      top_p=top_p, impl="triton", generator=torch.Generator().manual_seed(len(logits)))
    assert g_test_p(draws.cpu(), expected) > 1e-5


def test_fused_top_k_generation_scores_are_model_log_probs():
    """The log-probs the fused path reports are the untruncated step log-probs of the drawn tokens."""
    from test_generation import TinyRNN, _contexts

    model = TinyRNN(head="nmst").double()
    contexts = _contexts(B=6)
    out = generate(model.to(DEVICE), contexts.to(DEVICE), strategy="top_k", top_k=3, max_length=30, impl="triton",
                   generator=torch.Generator().manual_seed(4))
    model = model.cpu()
    for b in range(contexts.shape[0]):
        seq = out.tokens[b, : int(out.lengths[b])].cpu()
        expected = sum(float(model.sequence_log_probs(contexts[b], seq[:i])[seq[i]]) for i in range(len(seq)))
        assert float(out.scores[b]) == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_gpu_report_device_steps_run():
    """The decoding report's CUDA-graph step for every strategy (run here in the interpreter)."""
    from benchmarks.decoding_cases import STRATEGIES
    from benchmarks.report_decoding import _device_step, _top_p_rounds

    logits = torch.randn(4, 300, device=DEVICE) * 3
    for k, p in STRATEGIES.values():
        _device_step(k, p, device=DEVICE)(logits)
    mean, most = _top_p_rounds(logits, None, 0.9).split(" / ")
    most, _, read = most.partition("; ")  # the row draw adds the rows that read the row again
    assert 1.0 <= float(mean) <= int(most) and read.endswith("read the row")
    assert _top_p_rounds(logits, 4, None) == "—"


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("early_stopping", [True, False])
def test_beam_search_on_the_device_matches_reference(head, early_stopping):
    """Beam search on the device's logits (a GPU when present) against the float64 reference search."""
    from test_generation import TinyRNN, _contexts, _reference_beam

    # The model of test_generation's stopping-rule test: the two rules return different hypotheses.
    model = TinyRNN(V=11, head=head, eps=0.05, scale=12.0, eos_bias=4.0, seed=1).double()
    contexts = _contexts(B=3, V=11)
    out = generate(model.to(DEVICE), contexts.to(DEVICE), strategy="beam", num_beams=3, max_length=12,
                   early_stopping=early_stopping)
    model = model.cpu()
    for b in range(contexts.shape[0]):
        score, seq, terminated = _reference_beam(model, contexts[b], 3, 12, early_stopping)
        assert out.tokens[b, : len(seq)].tolist() == seq
        assert int(out.lengths[b]) == len(seq) and bool(out.terminated[b]) == terminated
        assert float(out.scores[b]) == pytest.approx(score, rel=1e-6)


def test_flashinfer_benchmark_wiring(monkeypatch):
    """The decoding report's FlashInfer cases call the sampler each strategy needs (a stand-in
    module records the calls; flashinfer itself needs a GPU)."""
    import sys
    import types

    from benchmarks.decoding_cases import flashinfer_sampler

    calls = []

    def record(name):
        def sampler(probs_or_logits, *args, generator=None):
            calls.append((name, args))
            return torch.zeros(probs_or_logits.shape[0], dtype=torch.int32)
        return sampler

    fake = types.ModuleType("flashinfer.sampling")
    for name in ("sampling_from_logits", "top_k_sampling_from_probs", "top_p_sampling_from_probs",
                 "top_k_top_p_sampling_from_probs"):
        setattr(fake, name, record(name))
    package = types.ModuleType("flashinfer")
    package.sampling = fake
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.sampling", fake)
    logits = torch.randn(3, 10)
    for k, p in [(None, None), (4, None), (None, 0.4), (4, 0.4)]:
        assert flashinfer_sampler(k, p)(logits, None).shape == (3,)
    assert calls == [("sampling_from_logits", ()), ("top_k_sampling_from_probs", (4,)),
                     ("top_p_sampling_from_probs", (0.4,)), ("top_k_top_p_sampling_from_probs", (4, 0.4))]

    # gpu_check's background build: the flag goes with --flashinfer and --gpu, and builds every sampler once.
    from benchmarks import report_decoding

    for argv in (["--build-only"], ["--gpu", "--build-only"]):
        with pytest.raises(SystemExit):
            report_decoding.main(argv)
    calls.clear()
    monkeypatch.setattr(report_decoding, "make_logits", lambda B, V, device: torch.randn(B, V))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert report_decoding.build_flashinfer(None) >= 0
    # The loop timing calls the step back to back: once to warm up, then calls × repeats.
    seen = []
    assert report_decoding.loop_ms(lambda z, g: seen.append(z), logits, None, calls=3, repeats=2) >= 0
    assert len(seen) == 1 + 3 * 2
    assert calls == [("top_k_sampling_from_probs", (4,)), ("top_p_sampling_from_probs", (0.4,)),
                     ("top_p_sampling_from_probs", (0.9,)), ("sampling_from_logits", ())]


def test_gpu_report_rows_print_every_strategy(monkeypatch, capsys):
    """The GPU report's table (``gpu_main``) on the interpreter, its timers stubbed (each runs the
    timed function once): a row per strategy and batch, each step run."""
    import triton.testing

    from benchmarks import report_decoding
    from benchmarks.decoding_cases import BATCHES, STRATEGIES

    ran = []

    def timer(fn, *args, **kwargs):
        ran.append(1)
        fn(*args) if args else fn()
        return 1.0

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kwargs: timer(fn))
    monkeypatch.setattr(report_decoding, "cold_graph_ms", lambda step, z: timer(step, z))
    monkeypatch.setattr(report_decoding, "loop_ms", lambda f, z, g: timer(f, z, g))
    monkeypatch.setattr(report_decoding, "copy_bandwidth", lambda: 1e12)
    report_decoding.gpu_main(vocabs=(300,), device=DEVICE)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(BATCHES) * len(STRATEGIES)  # the header, then a row each
    assert len(ran) == 4 * len(BATCHES) * len(STRATEGIES)  # fast, sort-based, loop, device step


@pytest.mark.parametrize("head,eos_logit", [("st", float("-inf")), ("nmst", float("inf"))])
def test_certain_eos_is_drawn_without_nan(head, eos_logit):
    """An eos logit that makes α_t = 1 (a = log(1 − α) = −inf): every path draws eos with log-prob 0,
    where ζ_eos = L + log(1 − e^a) − a and L − a used to give inf − inf."""
    z = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    z[:, 4] = eos_logit
    log_p, _ = nmst_fast.decoding.step_log_probs(z, head=head, eos_index=4, eps=0.01, steps=3)
    assert not bool(log_p.isnan().any())
    assert log_p[:, 4].tolist() == [0.0] * 3 and bool((log_p[:, :4].exp() == 0).all())  # −1e300 or −inf
    args = dict(head=head, eos_index=4, eps=0.01, steps=3)
    for impl in ("torch", "triton"):
        for truncation in (dict(top_k=1), dict(), dict(top_k=3), dict(top_p=0.5)):
            tokens, _ = sample(z.to(DEVICE), impl=impl, generator=torch.Generator().manual_seed(0), **truncation,
                               **args)
            assert tokens.tolist() == [4] * 3, (impl, truncation)
    for greedy in (True, False):
        picked = fused_select(z.to(DEVICE), greedy=greedy, generator=torch.Generator().manual_seed(0), **args)
        assert picked.log_probs.tolist() == [0.0] * 3
    picked = fused_truncated(z.to(DEVICE), top_p=0.5, generator=torch.Generator().manual_seed(0), **args)
    assert picked.log_probs.tolist() == [0.0] * 3


def test_lane_scan_matches_float64_on_fresh_rows():
    """Greedy's scan (per-lane state, no per-tile reduction): the first argmax, its value and the
    logsumexp of every split merge against float64, on fresh random rows — random V, tile width,
    split count, eos anywhere (first, last, inside a whole tile, in the partial last tile, none),
    temperature, ties, ±0.0, −inf runs, a whole −inf split, values near ±3e38, and NaN/+inf rows
    (their logsumexp is NaN or +inf, which the select kernels flag)."""
    from scan_harness import row_scan

    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    for case in range(6):
        V = int(torch.randint(3, 300, (1,), generator=gen))
        launch = (int(2 ** torch.randint(3, 7, (1,), generator=gen)), int(torch.randint(1, 4, (1,), generator=gen)))
        eos = [None, 0, V - 1, V // 2, int(torch.randint(0, V, (1,), generator=gen)), V - 2][case]
        temperature = [1.0, 0.7, 1.9][case % 3]
        z = torch.randn(10, V, generator=gen) * 3
        z[::2] = z[::2].round()  # ties
        z[1, torch.rand(V, generator=gen) < 0.5] = float("-inf")
        z[2, ::2] = -0.0
        z[3, : V // 2] = float("-inf")
        z[4] = z[4].sort().values  # every tile raises every lane's max
        z[5] *= 1e37  # near the fp32 range: no overflow in the lane sums
        z[6] = float("-inf")
        z[6, -1] = 1.0  # one finite column (eos's, when eos is last)
        bad_col = V // 3 if V // 3 != eos else (eos + 1) % V  # not eos's column, which the scan leaves out
        z[7, bad_col] = float("nan")
        z[8, bad_col] = float("inf")
        scan = row_scan(z.to(DEVICE), eos_index=eos, temperature=temperature, launch=launch)
        x = z.double() / temperature
        if eos is not None:
            x[:, eos] = float("-inf")
        ok = torch.isfinite(x).any(dim=1) & ~torch.isnan(x).any(dim=1) & ~(x == float("inf")).any(dim=1)
        order = torch.sort(torch.nan_to_num(x, nan=float("-inf")), dim=1, descending=True, stable=True).indices[:, 0]
        where = f"seed={seed} V={V} launch={launch} eos={eos} T={temperature}"
        got_idx, got_val, lse = scan["top_idx"].cpu(), scan["top_val"].cpu().double(), scan["lse"].cpu().double()
        assert torch.equal(got_idx[ok], order[ok]), where
        want_val = (z.float() * (1.0 / temperature)).double().gather(1, order[:, None])[ok, 0]
        assert torch.equal(got_val[ok], want_val), where
        torch.testing.assert_close(lse[ok], torch.logsumexp(x[ok], dim=1), rtol=1e-5, atol=1e-5, msg=where)
        empty = ~torch.isfinite(x).any(dim=1) & ~torch.isnan(x).any(dim=1) & ~(x == float("inf")).any(dim=1)
        assert (lse[empty] == float("-inf")).all() and (got_idx[empty] == 0).all(), where
        assert not torch.isfinite(lse[7]) and not torch.isfinite(lse[8]), where  # NaN / +inf rows


@pytest.mark.parametrize("K", [2, 4, 16, 32])
def test_lane_candidates_and_their_fallback(K):
    """Small-K candidate scans take the lanes' maxima (16-column tiles here: lane l holds columns
    l, l + 16, ...) when every lane's second largest ranks below the K-th of them, else read the
    split again by tiles. Rows built for each case — the best values in distinct lanes over a low
    floor (lanes suffice), the two best in one lane (re-read), a tie with a lower column in another
    lane, a second value equal to the K-th, fewer finite columns than K — all give the exact K best
    (value desc, column asc), −inf columns as padding (index −1), eos never among them. K = 32 takes
    tl.topk of each entering tile instead."""
    from scan_harness import row_scan

    V, eos = 100, 37
    z = torch.full((6, V), -5.0)
    z[:, torch.arange(V)] -= torch.arange(V) * 1e-3  # distinct floor values, lower to the right
    top = torch.tensor([3, 20, 41, 58, 75, 92, 10, 27, 44, 61, 78, 95, 12, 29, 46, 63])  # 16 lanes, distinct
    z[0, top] = torch.linspace(9.0, 1.0, 16)  # distinct lanes: the lanes' maxima settle it
    z[1] = z[0]
    z[1, 3 + 16] = 8.5  # the second best shares lane 3 with the best
    z[2] = z[0]
    z[2, 20 + 32] = z[2, 20]  # a tie in lane 4 (column 52 after column 20)
    z[3] = z[0]
    z[3, 3 + 48] = z[0, top[min(K, 16) - 1]]  # a lane's second equals the K-th: not strictly below
    z[4] = float("-inf")
    z[4, [5, 21]] = torch.tensor([1.0, 2.0])  # two finite columns, both in lane 5: re-read, padding
    z[5] = z[0]
    z[5, eos] = 100.0  # eos is never a candidate
    scan = row_scan(z.to(DEVICE), eos_index=eos, candidates=K, launch=(max(16, K), 1))  # tiles hold K
    x = z.double()
    x[:, eos] = float("-inf")
    order = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :K]
    valid = x.gather(1, order) > float("-inf")
    got = scan["cand_idx"][:, :K].cpu()
    assert torch.equal(torch.where(valid, got, -1), torch.where(valid, order, -1))
    assert (got[~valid] == -1).all()  # padding, not a column, where fewer than K are finite


def test_greedy_pick_does_not_depend_on_the_split_layout():
    """Two logits z₁ < z₂ whose z · (1/T) round to one fp32 value: the scan ranks raw z, so every
    split layout (both in one split, or in two) picks z₂'s column, as the float64 reference does."""
    from scan_harness import row_scan

    z = torch.zeros(1, 16)
    z[0, 2] = torch.tensor(1069547522, dtype=torch.int32).view(torch.float32)  # ≈ 1.5000002
    z[0, 9] = torch.tensor(1069547523, dtype=torch.int32).view(torch.float32)  # one ulp above
    assert z[0, 2] * (1.0 / 3.0) == z[0, 9] * (1.0 / 3.0)  # tied after the fp32 scaling
    for launch in ((16, 1), (8, 1), (8, 2), (4, 4)):
        assert int(row_scan(z.to(DEVICE), eos_index=None, temperature=3.0, launch=launch)["top_idx"]) == 9
    z[0, 15] = -30.0  # eos: improbable under VA and NMST alike
    for head in ("va", "nmst"):
        picked = fused_select(z.to(DEVICE), head=head, eos_index=15, steps=1, temperature=3.0, greedy=True)
        assert int(picked.tokens) == 9


@pytest.mark.parametrize("sms", [132, 78, 16])
def test_cuda_launch_shapes(sms):
    """The GPU split-V layouts (pure functions of B, V and the SM count): the plain and drawing scans
    fill about one wave of SCAN_PROGRAMS_PER_SM programs per SM and never more (their 128 registers
    let 4 reside, ``compile_check --resources``); candidate scans one wave of 4 (small K) or 3 (large K,
    whose final tl.topk holds 168 registers), capped so that the finish merges at most FINISH_KEYS
    keys; every split holds at least one tile and every launch
    at least one split."""
    from nmst_fast.kernels import row_scan
    from nmst_fast.kernels.host_math import cdiv

    assert row_scan.SCAN_PROGRAMS_PER_SM == 4  # the 4 resident programs the registers allow
    for B in (1, 2, 31, 32, 64, 256, 4096):
        for V in (257, 33278, 50257, 128256):
            _, block_v, splits = row_scan.cuda_launch_shape(B, V, 0, sms)
            assert block_v == min(2048, 1 << (V - 1).bit_length())
            assert 1 <= splits <= cdiv(V, block_v)
            assert splits == 1 or B * splits <= 4 * sms < B * (splits + 1) or splits == cdiv(V, block_v)
            for K, per_sm in ((4, 4), (16, 4), (32, 3), (128, 3)):
                _, block_v, splits = row_scan.cuda_launch_shape(B, V, K, sms)
                assert block_v == min(1024, 1 << (V - 1).bit_length())
                # At most one wave, and no more keys than the row's finish merges.
                assert splits == max(1, min(per_sm * sms // B, row_scan.FINISH_KEYS // K, cdiv(V, block_v)))
    # Top-k 4 at 256 × 50257 on 132 SMs: 2 splits (512 programs, one wave), not 3 (1.16 waves); top-k 50: 1.
    assert row_scan.cuda_launch_shape(256, 50257, 4, 132)[2] == 2
    assert row_scan.cuda_launch_shape(256, 50257, 64, 132)[2] == 1
    for K in (0, 4):  # an empty batch: a shape, not a ZeroDivisionError
        assert row_scan.cuda_launch_shape(0, 50257, K, sms) == row_scan.cuda_launch_shape(1, 50257, K, sms)
    # The shapes the H200 sweep measured best (132 SMs): B = 256 → 2 splits, 64 → 8, 32 → 16, 1 → all 63 tiles.
    assert [row_scan.cuda_launch_shape(B, 128256, 0, 132)[2] for B in (256, 64, 32, 1)] == [2, 8, 16, 63]
