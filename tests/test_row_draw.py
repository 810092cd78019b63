"""Top-p by rejection rounds in one program per row (nmst_fast/kernels/row_draw.py): draws as a distribution,
every draw inside the float64 nucleus, reproducibility, the round count, the fallback to the torch path."""

import pytest
import torch

import nmst_fast.kernels.row_draw as row_draw
from nmst_fast.decoding import DecodingStep, effective_logits, sample, truncated_candidates
from nmst_fast.decoding.truncation import TOP_P_SLACK
from nmst_fast.reference import truncated_distribution

from helpers import DEVICE, FAST_DRAWS, G_TEST_MIN_P, KERNEL_DRAWS, g_test_p, slow
from test_decoding import _reference_log_probs, _row, _st_state_before

HEADS = ("nmst", "st", "va")
BOUNDARY = 2e-6  # fp32 exponentials decide a cut whose float64 mass is this close to p either way


def _random_case(gen: torch.Generator) -> dict:
    """Logits with the shapes that stress the cut: ties, quantized (bf16) values, flat halves, −inf."""
    B = int(torch.randint(1, 7, (1,), generator=gen))
    V = int(torch.randint(2, 5000, (1,), generator=gen))
    z = torch.randn(B, V, generator=gen) * float(torch.rand(1, generator=gen)) * 8
    kind = int(torch.randint(0, 6, (1,), generator=gen))
    if kind == 1:
        z = z.round()  # heavy ties
    elif kind == 2:
        z = z.to(torch.bfloat16).float()
    elif kind == 3:
        z[:, : V // 2] = 0.0  # a tie of thousands at the cut
    elif kind == 4:
        z[:, ::3] = float("-inf")
    elif kind == 5:
        z = z.to(torch.bfloat16)  # the kernel reads bf16; the reference gets the same values in fp32
    head = HEADS[int(torch.randint(0, 3, (1,), generator=gen))]
    return dict(z=z, head=head, eos=int(torch.randint(0, V, (1,), generator=gen)),
                top_p=float(torch.rand(1, generator=gen)) * 0.999 + 0.001,
                temperature=[1.0, 0.7, 1.5][int(torch.randint(0, 3, (1,), generator=gen))],
                eps=[1e-8, 1e-3, 0.5][int(torch.randint(0, 3, (1,), generator=gen))],
                t=(int(torch.randint(-1, 10**6, (1,), generator=gen))
                   // int(torch.randint(1, 10**4, (1,), generator=gen))),
                state=torch.rand(B, generator=gen, dtype=torch.float64) * -3 if head == "st" else None)


def _draw(z: torch.Tensor, *, head: str, eos: int, eps: float = 1e-3, t=5, state=None, top_p: float,
          temperature: float = 1.0, seed: int = 0, launch=None):
    picked, rounds, _ = row_draw.draw_rows(z, head=head, eos_index=eos, eps=eps, temperature=temperature, steps=t,
                                           state=state, top_p_threshold=top_p - TOP_P_SLACK,
                                           seed=torch.tensor([seed], device=z.device), launch=launch)
    return picked, rounds


@pytest.mark.parametrize("head,top_p,draws", [slow("nmst", 0.3, KERNEL_DRAWS), slow("st", 0.9, KERNEL_DRAWS),
                                              slow("va", 0.5, KERNEL_DRAWS), ("nmst", 0.3, FAST_DRAWS)])
def test_rejection_draw_distribution(head, top_p, draws):
    """Draws of top-p through ``sample`` (the row draw) from one random row with ties (fresh seed),
    G-tested against the float64 truncated reference; p = 0.3 takes several rounds on many rows."""
    seed = torch.seed() % 2**31
    z = _row(torch.Generator().manual_seed(seed))
    eos, eps, t = 2, 0.002, 40
    state = _st_state_before(z, eos, eps, t) if head == "st" else None
    reference = truncated_distribution(_reference_log_probs(z, head, eos, eps, t).unsqueeze(0), None, top_p)[0]
    tokens, _ = sample(z.to(DEVICE).unsqueeze(0).expand(draws, -1), head=head, eos_index=eos, eps=eps,
                       steps=t, state=None if state is None else state.to(DEVICE).expand(draws), top_p=top_p,
                       impl="triton", generator=torch.Generator().manual_seed(seed + 1))
    assert g_test_p(tokens.cpu(), reference) > G_TEST_MIN_P, f"seed={seed}"


@pytest.mark.parametrize("block_v,cases", [slow(16, 8), slow(64, 8), (None, 8), (16, 2)])
def test_draws_lie_in_the_float64_nucleus(block_v, cases):
    """Random rows (fresh seeds; ties, bf16, flat halves, −inf runs, every head, eos anywhere, ε, t,
    temperature, ST states, p from 0.001 to 1, magnitudes up to 1e4 and near the fp32 limit), each
    drawn 40 times, with 16- and 64-column tiles (many columns per lane, as at V = 50257) and the
    default: every draw is a token of the float64 torch nucleus (a cut within BOUNDARY of p may
    differ), so no round the lane-maxima bounds decide without a pass keeps a token outside it;
    log-probs are the untruncated ones, ST's state is torch's. 8 random cases; the fast set's 16-column
    tiles take 2 (the interpreter pays per tile)."""
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    copies = 40
    for _ in range(cases):
        case = _random_case(gen)
        z, head, eos = case["z"], case["head"], case["eos"]
        if bool(torch.rand(1, generator=gen) < 0.3):  # large magnitudes: the bounds' slack must cover their rounding
            z = (z.float() * 100 + float(torch.randn(1, generator=gen)) * 1e4).to(z.dtype)
        B, V = z.shape
        args = dict(head=head, eos_index=eos, eps=case["eps"], temperature=case["temperature"], steps=case["t"])
        state = None if case["state"] is None else case["state"].repeat_interleave(copies).to(DEVICE)
        launch = None if block_v is None else dict(row_draw._default_launch(B * copies, V, -1), BLOCK_V=block_v,
                                                   NTILES=row_draw.tile_table_width(V, block_v))
        picked, rounds = _draw(z.repeat_interleave(copies, dim=0).to(DEVICE), head=head, eos=eos, eps=case["eps"],
                               t=case["t"], state=state, top_p=case["top_p"], temperature=case["temperature"],
                               seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen)), launch=launch)
        assert int(picked.flags[0]) == B * copies, (seed, case)
        # A tiny p (here down to 0.001) can leave a row rejected after MAX_ROUNDS: flagged (flags[1]) for
        # the caller's torch path, its token invalid (test_rows_left_rejected_take_the_torch_path); the
        # rows that took every round are left out below.
        served = (rounds.cpu() < row_draw.MAX_ROUNDS).view(B, copies)
        assert int(picked.flags[1]) == B * copies or not bool(served.all()), (seed, case)
        dist = effective_logits(z.float(), **args, state=case["state"])
        tokens, probs = truncated_candidates(dist, None, case["top_p"])
        expected = torch.zeros(B, V, dtype=torch.float64).scatter_add(1, tokens, probs)
        drawn = picked.tokens.cpu().view(B, copies)
        log_p = dist.log_probs()
        for b in range(B):
            outside = (expected[b, drawn[b]] == 0) & served[b]
            if bool(outside.any()):
                ranked = torch.exp(torch.sort(log_p[b], descending=True, stable=True).values)
                margin = float((torch.cumsum(ranked, 0) - ranked - case["top_p"]).abs().min())
                assert margin < BOUNDARY, (seed, b, case)
        # log_norm comes from fp32 exponentials summed per lane: ~1e-6 of L, which grows with the logits.
        scale = float(z.float().masked_fill(z.float().isinf(), 0).abs().max()) / case["temperature"]
        torch.testing.assert_close(picked.log_probs.cpu().view(B, copies)[served], log_p.gather(1, drawn)[served],
                                   rtol=1e-6, atol=1e-5 * max(1.0, scale))
        if head == "st":
            torch.testing.assert_close(picked.state.cpu().view(B, copies)[:, 0], dist.state)


def test_a_seed_reproduces_the_draws():
    z = (torch.randn(200, 700, generator=torch.Generator().manual_seed(1)) * 2).to(DEVICE)
    first, _ = _draw(z, head="nmst", eos=4, top_p=0.5, seed=11)
    again, _ = _draw(z, head="nmst", eos=4, top_p=0.5, seed=11)
    other, _ = _draw(z, head="nmst", eos=4, top_p=0.5, seed=12)
    assert torch.equal(first.tokens, again.tokens)
    assert not torch.equal(first.tokens, other.tokens)


def test_rounds_stay_few():
    """Each round accepts with probability >= p (the nucleus's share of the set drawn from), so the
    mean round count is at most 1 / p; on peaked N(0, 9) logits at V = 20000 it is close to 1."""
    z = (torch.randn(64, 20000, generator=torch.Generator().manual_seed(3)) * 3).to(DEVICE)
    for top_p in (0.9, 0.4):
        picked, rounds = _draw(z, head="nmst", eos=0, t=100, top_p=top_p, seed=5)
        assert picked.flags.tolist() == [64, 64]
        assert 1.0 <= float(rounds.double().mean()) <= 1.0 / top_p + 0.25, top_p
        assert int(rounds.max()) < row_draw.MAX_ROUNDS


@pytest.mark.parametrize("rows", [1, 16])
def test_rows_left_rejected_take_the_torch_path(monkeypatch, rows):
    """With one round allowed, a flat row and p = 0.05 leave rows rejected: the kernel flags them.
    A step that reads its flags at once (``sample``) draws the batch by the torch path, inside each
    row's float64 nucleus; one that defers them raises at its check (RuntimeError), never returning
    the unresolved row's token silently."""
    z = torch.randn(rows, 400, generator=torch.Generator().manual_seed(0)).to(DEVICE) * 0.1
    monkeypatch.setattr(row_draw, "MAX_ROUNDS", 1)
    picked, rounds = _draw(z, head="va", eos=0, top_p=0.05, seed=3)
    assert picked.flags[1] < rows and int(rounds.max()) <= 1  # a rejected row records no round
    step = DecodingStep(head="va", eos_index=0, vocab_size=400, device=z.device, top_p=0.05, impl="triton")
    # The same seed, so the rounds leave the same rows rejected (unseeded, the one round accepted the
    # single row's draw for 5 of 200 seeds).
    step(z, generator=torch.Generator().manual_seed(0), defer_checks=True)
    with pytest.raises(RuntimeError, match="without a token"):
        step.check()
    step.check()  # the log is read once
    tokens, _ = sample(z, head="va", eos_index=0, top_p=0.05, impl="triton", generator=torch.Generator().manual_seed(0))
    dist = effective_logits(z.cpu(), head="va", eos_index=0)
    kept, probs = truncated_candidates(dist, None, 0.05)
    expected = torch.zeros(rows, 400, dtype=torch.float64).scatter_add(1, kept, probs)
    assert bool((expected.gather(1, tokens.cpu()[:, None]) > 0).all())


def test_fp32_floor_of_eos_values():
    """The pivot of a rejected eos: the largest fp32 <= ζ_eos, exact flag when ζ_eos is an fp32."""
    import triton
    import triton.language as tl

    @triton.jit
    def floor_kernel(v_ptr, out_ptr, exact_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        f, exact = row_draw._fp32_floor(tl.load(v_ptr + i))
        tl.store(out_ptr + i, f)
        tl.store(exact_ptr + i, exact.to(tl.int32))

    values = torch.tensor([0.1, -0.1, 1.5, -2.0, 1e-50, -1e-50, 0.0, 1e300, -1e300, float("inf"), float("-inf"),
                           3.0000001, -7.25, 1e-40, 0.3], dtype=torch.float64, device=DEVICE)
    n = 16
    padded = torch.cat([values, values.new_zeros(n - values.numel())])
    out = torch.empty(n, dtype=torch.float32, device=DEVICE)
    exact = torch.empty(n, dtype=torch.int32, device=DEVICE)
    floor_kernel[(1,)](padded, out, exact, N=n)
    for v, f, e in zip(values.tolist(), out.tolist(), exact.tolist()):
        f32 = torch.tensor(v, dtype=torch.float32).item()
        assert f <= v and bool(e) == (f == v), (v, f, e)
        up = torch.nextafter(torch.tensor(f, dtype=torch.float32), torch.tensor(float("inf"))).item()
        assert f == v or up > v, (v, f)  # no fp32 lies in (f, v]
        if f32 == v:
            assert f == v


def test_draws_reproduce_and_report_nan_rows():
    """A seed reproduces the draws, log-probs are the step's, ST's state is torch's, and a NaN row is
    flagged, not drawn."""
    z = (torch.randn(300, 700, generator=torch.Generator().manual_seed(2)) * 2).to(DEVICE)
    state = torch.rand(300, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEVICE) * -2
    args = dict(head="st", eos=9, eps=0.01, temperature=0.8, t=6, state=state, top_p=0.7)
    first, _ = _draw(z, seed=5, **args)
    again, _ = _draw(z, seed=5, **args)
    other, _ = _draw(z, seed=6, **args)
    assert first.flags.tolist() == [300, 300] and torch.equal(first.tokens, again.tokens)
    assert not torch.equal(first.tokens, other.tokens)
    dist = effective_logits(z.cpu(), head="st", eos_index=9, eps=0.01, temperature=0.8, steps=6, state=state.cpu())
    torch.testing.assert_close(first.log_probs.cpu(), dist.token_log_probs(first.tokens.cpu()), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(first.state.cpu(), dist.state)
    z[17, 3] = float("nan")
    assert _draw(z, seed=5, **args)[0].flags.tolist() == [17, 300]


def test_prefetch_changes_no_draw():
    """PREFETCH (the next tile's load issued before this tile's reductions) only reorders loads:
    the same seed gives the same tokens, log-probs, rounds and ST state with it off (a tuning
    variant of benchmarks.profile_decoding) as with it on (the default)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    z = (torch.randn(6, 700, generator=gen) * 2).to(DEVICE)
    state = -torch.rand(6, dtype=torch.float64, generator=gen).to(DEVICE)
    default = row_draw.default_launch(z)
    assert default["PREFETCH"]
    runs = []
    for prefetch in (True, False):
        picked, rounds = _draw(z, head="st", eos=3, eps=1e-3, temperature=0.8, t=4, state=state, seed=11, top_p=0.5,
                               launch=default | {"PREFETCH": prefetch})
        runs.append((picked.tokens.cpu(), picked.log_probs.cpu(), rounds.cpu(), picked.state.cpu()))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_top_p_layout_follows_the_batch(monkeypatch):
    """Top-p on a GPU: one wide 16-warp program per row while every row has an SM to itself; above
    that, compact 8-warp programs capped at 128 registers, two per SM, so the batch runs in one wave
    where the wide ones took two (H100: 132 SMs, B = 256). The cap is a compile option the launch
    passes on."""
    wide = row_draw.cuda_launch(50257, **row_draw.TOP_P_LAYOUTS["wide"])
    compact = row_draw.cuda_launch(50257, **row_draw.TOP_P_LAYOUTS["compact"])
    for sms in (78, 132):
        monkeypatch.setattr(row_draw, "multi_processors", lambda index, sms=sms: sms)
        launch = row_draw._default_launch.__wrapped__  # uncached: the SM count is patched
        assert launch(1, 50257, 0) == launch(sms, 50257, 0) == wide
        assert launch(sms + 1, 50257, 0) == launch(10**6, 50257, 0) == compact
    assert (wide["BLOCK_V"], wide["num_warps"], "maxnreg" in wide) == (2048, 16, False)
    assert (compact["BLOCK_V"], compact["num_warps"], compact["maxnreg"]) == (1024, 8, 128)
    assert compact["NTILES"] >= -(-50257 // 1024)  # the lane's column table holds all its tiles
    assert row_draw.cuda_launch(50257) == wide


def test_launch_sweep_runs_every_variant():
    """benchmarks.profile_decoding's sweeps (GPU tuning) pass each launch variant through draw_rows
    and the scan + select (greedy and sampling); here in the interpreter, with a counting timer, on a
    vocabulary of one to two tiles per width."""
    from benchmarks.profile_decoding import sweep, variants

    logits = torch.randn(3, 2100, device=DEVICE) * 3
    timed = []
    for top_p in (0.4, 0.9):
        rows = sweep(logits, top_p, variants(), lambda step, z: timed.append(step(z)) or 1.0)
        assert [variant for variant, _ in rows] == variants()
    assert len(timed) == 2 * len(variants())
    assert {v.launch(2100)["NTILES"] for v in variants()} == {8}  # 2 tiles of 2048, 1 of 4096: padded
    from benchmarks.profile_decoding import scan_sweep

    launches = [(1024, 1), (1024, 3), (2048, 2)]
    for draw in (False, True):
        rows = scan_sweep(logits, launches, lambda step, z: timed.append(step(z)) or 1.0, draw=draw)
        assert [launch for launch, _ in rows] == launches
    assert len(timed) == 2 * len(variants()) + 6
    from benchmarks.profile_decoding import top_p_layout_sweep

    rows = top_p_layout_sweep(logits, lambda step, z: 1.0)
    assert [(p, name) for p, name, *_ in rows] == [(0.4, "wide"), (0.4, "compact"), (0.9, "wide"), (0.9, "compact")]
    assert all(1.0 <= mean < row_draw.MAX_ROUNDS and passes >= 0 for *_, mean, passes in rows)
    top_k_launches = [(1024, 2), (2048, 1)]  # the top-k-scan table's steps (one-launch top-k)
    rows = scan_sweep(logits, top_k_launches, lambda step, z: timed.append(step(z)) or 1.0, top_k=4)
    assert [launch for launch, _ in rows] == top_k_launches and len(timed) == 2 * len(variants()) + 8
    from benchmarks.profile_decoding import _TABLE_RUNNERS, TABLES, bare_read, main, read_floor_parts

    parts = read_floor_parts(logits, lambda step, z: timed.append(step(z)) or 1.0)
    assert [name.split(" (")[0] for name, _ in parts] == [
        "bare read", "torch.amax(dim=1)", "greedy, one launch", "sampling, one launch"]
    for block_v, splits in ((1024, 1), (1024, 3), (512, 2)):  # the read floor's kernel reads every column once
        sums = bare_read(logits, block_v, splits)
        torch.testing.assert_close(sums.sum(dim=1).double(), logits.double().sum(dim=1), rtol=1e-5, atol=1e-3)
    assert set(_TABLE_RUNNERS) == set(TABLES)
    with pytest.raises(SystemExit):  # an unknown table is refused before anything runs
        main(["--tables", "scan,nonsense"])


def _eos_pivot_row() -> tuple[torch.Tensor, int, float, int, float]:
    """Eos holds ~0.28 of the mass but lies outside the nucleus {3, 9} of p = 0.5: (z, eos, eps, t, p)."""
    V, eos = 12, 7
    z = torch.full((V,), -2.0)
    z[3], z[9] = 2.0, 2.0 - 1e-3
    z[eos] = -2.0  # α_20 = 1 − σ(2)·0.99^20 ≈ 0.28
    return z, eos, 0.01, 20, 0.5


@pytest.mark.parametrize("draws", [slow(KERNEL_DRAWS), FAST_DRAWS])
def test_a_rejected_eos_becomes_the_pivot(draws):
    """Eos holds ~0.28 of the mass but lies outside the nucleus (two tokens of ~0.33 each reach
    p = 0.5 first): a round that draws eos is rejected and the next draws only among the tokens
    ranked before eos (4-column tiles). Draws G-tested against the float64 truncated reference
    (fresh seed); eos is never drawn."""
    seed = torch.seed() % 2**31
    z, eos, eps, t, top_p = _eos_pivot_row()
    log_p = _reference_log_probs(z, "nmst", eos, eps, t)
    reference = truncated_distribution(log_p.unsqueeze(0), None, top_p)[0]
    assert torch.nonzero(reference).flatten().tolist() == [3, 9] and 0.1 < float(log_p[eos].exp()) < 0.35
    rows = z.to(DEVICE).unsqueeze(0).expand(draws, -1)
    launch = row_draw.default_launch(rows)
    if not rows.is_cuda:  # the interpreter: as many elements per program as the default tiles hold
        launch["BLOCK_B"] *= launch["BLOCK_V"] // 4
    launch |= {"BLOCK_V": 4, "NTILES": row_draw.tile_table_width(z.shape[0], 4)}
    picked, rounds = _draw(rows, head="nmst", eos=eos, eps=eps, t=t, top_p=top_p, seed=seed + 1, launch=launch)
    assert picked.flags.tolist() == [draws, draws] and int(rounds.max()) >= 2
    assert g_test_p(picked.tokens.cpu(), reference) > G_TEST_MIN_P, f"seed={seed}"


@pytest.mark.parametrize("head,top_p,eos,draws", [slow("st", 0.3, 60, KERNEL_DRAWS),
                                                  slow("nmst", 0.95, 99, KERNEL_DRAWS), ("st", 0.3, 60, FAST_DRAWS)])
def test_row_draw_lanes_across_tiles(head, top_p, eos, draws):
    """16-column tiles on a 101-column row whose tiles differ in scale (one ~6 below the rest, a late
    one raising the running max): its lanes (a column position followed across seven tiles) carry
    the passes' sums, and a lane's columns are gathered to draw from it. eos in a whole tile (masked
    span between unmasked ones) or in the partial last tile; p = 0.3 takes several rounds on most
    rows. Draws G-tested against the float64 truncated distribution (fresh seed)."""
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    V, t, eps = 101, 4, 0.02
    z = _row(gen, V) * 1.5
    z[30:46] -= 6.0  # a light tile
    z[80:96] += 2.0  # a heavy one, after the light
    state = _st_state_before(z, eos, eps, t) if head == "st" else None
    expected = truncated_distribution(_reference_log_probs(z, head, eos, eps, t).unsqueeze(0), None, top_p)[0]
    launch = dict(BLOCK_B=row_draw._default_launch(draws, V, -1)["BLOCK_B"] * 8, BLOCK_V=16,
                  NTILES=row_draw.tile_table_width(V, 16), PREFETCH=True)
    picked, _ = _draw(z.to(DEVICE).unsqueeze(0).expand(draws, -1), head=head, eos=eos, eps=eps, t=t,
                      state=None if state is None else state.to(DEVICE).expand(draws), seed=seed, top_p=top_p,
                      launch=launch)
    assert picked.flags.tolist() == [draws, draws]
    assert g_test_p(picked.tokens.cpu(), expected) > G_TEST_MIN_P, f"seed={seed}"


def test_row_draw_takes_logits_near_the_fp32_limit():
    """A row whose largest x is near the fp32 maximum (2.4e38; or 2.4e36 at temperature 0.01) is
    drawn in one round: the weights are 2^((x − M)·log2 e) — x·log2 e − M·log2 e overflowed to
    inf − inf there, so the top column could never be drawn and every round was rejected."""
    for big, temperature in ((2.4e38, 1.0), (1.2e38, 0.5), (2.4e36, 0.01)):
        z = torch.tensor([[0.0, big, -1.0, 5.0]], device=DEVICE).expand(4, -1)
        picked, rounds = _draw(z, head="va", eos=0, temperature=temperature, t=1, seed=1, top_p=0.9)
        assert picked.flags.tolist() == [4, 4] and (rounds == 1).all()
        assert (picked.tokens == 1).all()


def test_bounds_settle_most_rounds_of_peaked_rows():
    """Without a pass for most rounds, top-p costs about one read: on rows like the benchmark's
    (z ~ N(0, 3²)) with 64-column tiles (25 columns per lane, as at V = 50257 with 2048-column
    tiles), few rounds read the row. (The draws' distribution with the bounds: every G-test above.)"""
    seed = torch.seed() % 2**31
    # 800 rows: the mean passes per row measured 0.02-0.04 (p = 0.4) and 0.08-0.13 (p = 0.9), a standard
    # error of about 0.01 under bounds three times those.
    z = torch.randn(800, 1600, generator=torch.Generator().manual_seed(seed)).to(DEVICE) * 3
    launch = dict(row_draw._default_launch(800, 1600, -1), BLOCK_V=64, NTILES=row_draw.tile_table_width(1600, 64))
    for top_p, most in ((0.4, 0.1), (0.9, 0.3)):
        picked, rounds, passes = row_draw.draw_rows(
            z, head="nmst", eos_index=7, eps=1e-3, temperature=1.0, steps=30, state=None,
            top_p_threshold=top_p - TOP_P_SLACK, seed=torch.tensor([seed], device=DEVICE), launch=launch)
        assert picked.flags.tolist() == [800, 800]
        assert bool((passes <= rounds).all()) and int(rounds.min()) >= 1
        assert float(passes.double().mean()) < most, f"seed={seed} p={top_p}"
