"""Top-p by rejection rounds in one program per row (nmst_fast/kernels/row_draw.py). Draws as a distribution,
every draw inside the float64 nucleus, reproducibility, the round count, the fallback to the cut. The row draw's
plain sampling: its G-tests are test_decoding_fused's (path "row draw"); here the rest."""

import pytest
import torch

import nmst_fast.kernels.nucleus as nucleus
import nmst_fast.kernels.row_draw as row_draw
import nmst_fast.kernels.row_scan as row_scan
from nmst_fast.decoding import effective_logits, truncated_candidates
from nmst_fast.decoding.fused import fused_truncated
from nmst_fast.decoding.reference import truncated_distribution
from nmst_fast.decoding.truncation import TOP_P_SLACK

from helpers import DEVICE
from test_decoding import DRAWS, _g_test, _reference_log_probs, _row, _st_state_before
from test_nucleus import BOUNDARY, _random_case


def _draw(z: torch.Tensor, *, head: str, eos: int, eps: float = 1e-3, t=5, state=None, top_p: float,
          temperature: float = 1.0, seed: int = 0, round_candidates=None):
    return row_draw.draw_rows(z, head=head, eos_index=eos, eps=eps, temperature=temperature, steps=t,
                              state=state, top_p_threshold=top_p - TOP_P_SLACK,
                              seed=torch.tensor([seed], device=z.device), round_candidates=round_candidates)


@pytest.mark.parametrize("head,top_p", [("nmst", 0.3), ("nmst", 0.9), ("st", 0.9), ("va", 0.5)])
def test_rejection_draw_distribution(head, top_p):
    """10⁶ draws from one random row with ties (fresh seed), G-tested against the float64 truncated
    reference; p = 0.3 takes several rounds on many rows."""
    seed = torch.seed() % 2**31
    z = _row(torch.Generator().manual_seed(seed))
    eos, eps, t = 2, 0.002, 40
    state = _st_state_before(z, eos, eps, t) if head == "st" else None
    reference = truncated_distribution(_reference_log_probs(z, head, eos, eps, t).unsqueeze(0), None, top_p)[0]
    picked, rounds = _draw(z.to(DEVICE).unsqueeze(0).expand(DRAWS, -1), head=head, eos=eos, eps=eps, t=t,
                           state=None if state is None else state.to(DEVICE).expand(DRAWS), top_p=top_p,
                           seed=seed + 1)
    assert picked.flags.tolist() == [DRAWS, DRAWS]
    assert _g_test(picked.tokens.cpu(), reference) > 1e-5, f"seed={seed}"


@pytest.mark.parametrize("head,round_candidates", [("nmst", 4), ("st", 2)])
def test_several_candidates_per_round_draw_exactly(head, round_candidates):
    """Several candidates per round: each round examines the first its bounds do not reject (the
    rest are dropped unexamined), an exact rejection sampler too. A flat 40-token row (fresh seed)
    whose nucleus at p = 0.5 holds 5-10 tokens, so a round often has several candidates the bounds
    keep and any preference among them (say, for the larger value) would show; 10⁶ draws G-tested
    against the float64 truncated reference, some rows taking more than one round."""
    eos, eps, t, top_p = 2, 0.01, 3, 0.5
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    while True:  # a fresh row whose nucleus holds at least 4 tokens (a few random rows hold 3)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        z = _row(torch.Generator().manual_seed(seed), V=40) * 0.5
        z[eos] = 3.0 if head == "st" else -1.0  # eos inside the nucleus, not all of it (ST's α_3 ≈ 0.14)
        state = _st_state_before(z, eos, eps, t) if head == "st" else None
        reference = truncated_distribution(_reference_log_probs(z, head, eos, eps, t).unsqueeze(0), None, top_p)[0]
        if int((reference > 0).sum()) >= 4:
            break
    picked, rounds = _draw(z.to(DEVICE).unsqueeze(0).expand(DRAWS, -1), head=head, eos=eos, eps=eps, t=t,
                           state=None if state is None else state.to(DEVICE).expand(DRAWS), top_p=top_p,
                           seed=seed + 1, round_candidates=round_candidates)
    assert picked.flags.tolist() == [DRAWS, DRAWS] and int(rounds.max()) >= 2
    assert _g_test(picked.tokens.cpu(), reference) > 1e-5, f"seed={seed}"


def test_draws_lie_in_the_float64_nucleus():
    """Random rows (fresh seeds; ties, bf16, flat halves, −inf, every head, ε, t, temperature, ST
    states, 1 to 4 candidates per round), each drawn 64 times: every draw is a token of the float64
    torch nucleus (a cut within BOUNDARY of p may differ), log-probs are the untruncated ones, ST's
    state is torch's."""
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    copies = 64
    for _ in range(10):
        case = _random_case(gen)
        z, head, eos = case["z"], case["head"], case["eos"]
        B = z.shape[0]
        args = dict(head=head, eos_index=eos, eps=case["eps"], temperature=case["temperature"], steps=case["t"])
        state = None if case["state"] is None else case["state"].repeat_interleave(copies).to(DEVICE)
        picked, rounds = _draw(z.repeat_interleave(copies, dim=0).to(DEVICE), head=head, eos=eos, eps=case["eps"],
                               t=case["t"], state=state, top_p=case["top_p"], temperature=case["temperature"],
                               seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen)),
                               round_candidates=int(2 ** torch.randint(0, 3, (1,), generator=gen)))
        assert int(picked.flags[0]) == B * copies, (seed, case)
        # A tiny p (here down to 0.001) can leave a row rejected after MAX_ROUNDS: flagged (flags[1]) for
        # the caller's cut, its token invalid (test_rows_left_rejected_are_drawn_from_the_cut); the rows
        # that took every round are left out below.
        served = (rounds.cpu() < row_draw.MAX_ROUNDS).view(B, copies)
        assert int(picked.flags[1]) == B * copies or not bool(served.all()), (seed, case)
        dist = effective_logits(z.float(), **args, state=case["state"])
        tokens, probs = truncated_candidates(dist, None, case["top_p"])
        expected = torch.zeros(B, z.shape[1], dtype=torch.float64).scatter_add(1, tokens, probs)
        drawn = picked.tokens.cpu().view(B, copies)
        log_p = dist.log_probs()
        for b in range(B):
            outside = (expected[b, drawn[b]] == 0) & served[b]
            if bool(outside.any()):
                ranked = torch.exp(torch.sort(log_p[b], descending=True, stable=True).values)
                margin = float((torch.cumsum(ranked, 0) - ranked - case["top_p"]).abs().min())
                assert margin < BOUNDARY, (seed, b, case)
        # log_norm comes from fp32 exponentials summed per 2048-column tile: ~1e-6 of L.
        torch.testing.assert_close(picked.log_probs.cpu().view(B, copies)[served], log_p.gather(1, drawn)[served],
                                   rtol=1e-6, atol=1e-5)
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
    mean round count is at most 1 / p; on peaked N(0, 9) logits at V = 20000 it is close to 1. Four
    candidates per round take fewer rounds at p = 0.4 (where the bounds reject most candidates)."""
    z = (torch.randn(64, 20000, generator=torch.Generator().manual_seed(3)) * 3).to(DEVICE)
    mean_rounds = {}
    for top_p in (0.9, 0.4):
        for round_candidates in (1, 4):
            picked, rounds = _draw(z, head="nmst", eos=0, t=100, top_p=top_p, seed=5, round_candidates=round_candidates)
            assert picked.flags.tolist() == [64, 64]
            assert 1.0 <= float(rounds.double().mean()) <= 1.0 / top_p + 0.25, top_p
            assert int(rounds.max()) < row_draw.MAX_ROUNDS
            mean_rounds[top_p, round_candidates] = float(rounds.double().mean())
    assert mean_rounds[0.4, 4] < mean_rounds[0.4, 1], mean_rounds
    with pytest.raises(ValueError, match="round_candidates"):
        _draw(z[:2], head="nmst", eos=0, top_p=0.5, round_candidates=8)


@pytest.mark.parametrize("rows", [1, 16])
def test_rows_left_rejected_are_drawn_from_the_cut(monkeypatch, rows):
    """With one round allowed, a flat row and p = 0.05 leave rows rejected: the step draws the batch
    from the nucleus cut; with the cut also unable to converge, the torch path (None here)."""
    z = torch.randn(rows, 400, generator=torch.Generator().manual_seed(0)).to(DEVICE) * 0.1
    monkeypatch.setattr(row_draw, "MAX_ROUNDS", 1)
    picked, rounds = _draw(z, head="va", eos=0, top_p=0.05, seed=3)
    assert picked.flags[1] < rows and int(rounds.max()) <= 1  # a rejected row records no round
    paths = []
    real = nucleus.nucleus_select
    monkeypatch.setattr(nucleus, "nucleus_select", lambda *a, **k: paths.append("cut") or real(*a, **k))
    real_drawer = row_draw.draw_rows
    monkeypatch.setattr(row_draw, "draw_rows", lambda *a, **k: paths.append("draw_rows") or real_drawer(*a, **k))
    served = fused_truncated(z, head="va", eos_index=0, top_p=0.05, generator=torch.Generator().manual_seed(0))
    assert served is not None
    assert paths == ["draw_rows", "cut"]
    dist = effective_logits(z.cpu(), head="va", eos_index=0)
    tokens, probs = truncated_candidates(dist, None, 0.05)
    expected = torch.zeros(rows, 400, dtype=torch.float64).scatter_add(1, tokens, probs)
    assert bool((expected.gather(1, served.tokens.cpu()[:, None]) > 0).all())
    # The same seed, so the rounds leave the same rows rejected (unseeded, the one round accepted the
    # single row's draw for 5 of 200 seeds, and the step never reached the cut).
    monkeypatch.setattr(nucleus, "MAX_PASSES", 0)
    paths.clear()
    assert fused_truncated(z, head="va", eos_index=0, top_p=0.05, generator=torch.Generator().manual_seed(0)) is None
    assert paths == ["draw_rows", "cut"]


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


def test_plain_draws_reproduce_and_report_nan_rows():
    """Plain sampling: one round per row, a seed reproduces the draws, log-probs are the step's,
    ST's state is torch's, and a NaN row is flagged, not drawn."""
    z = (torch.randn(300, 700, generator=torch.Generator().manual_seed(2)) * 2).to(DEVICE)
    state = torch.rand(300, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEVICE) * -2
    args = dict(head="st", eos_index=9, eps=0.01, temperature=0.8, steps=6, state=state)
    first, rounds = row_draw.draw_rows(z, seed=torch.tensor([5], device=DEVICE), **args)
    again, _ = row_draw.draw_rows(z, seed=torch.tensor([5], device=DEVICE), **args)
    other, _ = row_draw.draw_rows(z, seed=torch.tensor([6], device=DEVICE), **args)
    assert first.flags.tolist() == [300, 300] and torch.equal(first.tokens, again.tokens)
    assert bool((rounds == 1).all())
    assert not torch.equal(first.tokens, other.tokens)
    dist = effective_logits(z.cpu(), head="st", eos_index=9, eps=0.01, temperature=0.8, steps=6, state=state.cpu())
    torch.testing.assert_close(first.log_probs.cpu(), dist.token_log_probs(first.tokens.cpu()), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(first.state.cpu(), dist.state)
    z[17, 3] = float("nan")
    assert row_draw.draw_rows(z, seed=torch.tensor([5], device=DEVICE), **args)[0].flags.tolist() == [17, 300]


def test_a_rejected_eos_becomes_the_pivot():
    """Eos holds ~0.28 of the mass but lies outside the nucleus (two tokens of ~0.33 each reach
    p = 0.5 first): a round that draws eos is rejected and the next draws only among the tokens
    ranked before eos. 10⁶ draws G-tested; eos is never drawn."""
    V, eos = 12, 7
    z = torch.full((V,), -2.0)
    z[3], z[9] = 2.0, 2.0 - 1e-3  # the nucleus: {3, 9}
    z[eos] = -2.0  # α_20 = 1 − σ(2)·0.99^20 ≈ 0.28
    reference_log_p = _reference_log_probs(z, "nmst", eos, 0.01, 20)
    assert 0.1 < float(reference_log_p[eos].exp()) < 0.35
    reference = truncated_distribution(reference_log_p.unsqueeze(0), None, 0.5)[0]
    assert torch.nonzero(reference).flatten().tolist() == [3, 9]
    picked, rounds = _draw(z.to(DEVICE).unsqueeze(0).expand(DRAWS, -1), head="nmst", eos=eos, eps=0.01, t=20,
                           top_p=0.5, seed=int(torch.seed() % 2**31))
    assert picked.flags.tolist() == [DRAWS, DRAWS] and int(rounds.max()) >= 2
    assert _g_test(picked.tokens.cpu(), reference) > 1e-5


def test_first_crossing_picks_only_positive_weights():
    """The inverse-CDF step shared by the row draw, the nucleus draw and the split draw picks a positive weight:
    a GPU's parallel scan is not monotone to the last ulp, so a zero weight after the crossing can
    read above the target (an H200 drew a token outside the nucleus that way). A negative target
    (rounding below the start of the CDF) makes the first zero weights cross here too."""
    import triton
    import triton.language as tl

    @triton.jit
    def crossing_kernel(w_ptr, target_ptr, pick_ptr, before_ptr, N: tl.constexpr):
        index = tl.arange(0, N)[None, :]
        one = tl.arange(0, 1)
        pick, before = row_scan.first_crossing(tl.load(w_ptr + index), tl.load(target_ptr + one), index, N)
        tl.store(pick_ptr + one, pick)
        tl.store(before_ptr + one, before)

    def first_crossing(weights, target):
        w = torch.tensor([weights], dtype=torch.float64, device=DEVICE)
        pick = torch.empty(1, dtype=torch.int32, device=DEVICE)
        before = torch.empty(1, dtype=torch.float64, device=DEVICE)
        crossing_kernel[(1,)](w, torch.tensor([target], dtype=torch.float64, device=DEVICE), pick, before,
                              N=len(weights))
        return int(pick.item()), float(before.item())

    weights = [0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 0.5, 0.0]
    assert first_crossing(weights, -1e-30) == (2, 0.0)  # not column 0 (zero weight, cum 0 > target)
    assert first_crossing(weights, 0.5) == (2, 0.0)
    assert first_crossing(weights, 1.0) == (3, 1.0)
    assert first_crossing(weights, 3.2) == (6, 3.0)
    assert first_crossing(weights, 3.5) == (6, 3.0)  # rounding past the total: the last positive weight
    assert first_crossing([0.0] * 8, 0.0)[0] == -1  # nothing to draw: the callers treat it as no token


@pytest.mark.parametrize("top_p", [None, 0.5])
def test_prefetch_changes_no_draw(top_p):
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
        picked, rounds = row_draw.draw_rows(z, head="st", eos_index=3, eps=1e-3, temperature=0.8, steps=4,
                                            state=state, seed=torch.tensor([11], device=DEVICE),
                                            top_p_threshold=top_p, launch=default | {"PREFETCH": prefetch})
        runs.append((picked.tokens.cpu(), picked.log_probs.cpu(), rounds.cpu(), picked.state.cpu()))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_top_p_layout_follows_the_batch():
    """Top-p on a GPU: one wide 16-warp program per row while every row has an SM to itself; above
    that, compact 8-warp programs capped at 128 registers, two per SM, so the batch runs in one wave
    where the wide ones took two (H100: 132 SMs, B = 256). The cap is a compile option the launch
    passes on; plain sampling keeps its launch."""
    for sms in (78, 132):
        assert row_draw.top_p_layout(1, sms) == row_draw.top_p_layout(sms, sms) == row_draw.WIDE_TOP_P
        assert row_draw.top_p_layout(sms + 1, sms) == row_draw.top_p_layout(10**6, sms) == row_draw.COMPACT_TOP_P
    wide = row_draw.cuda_launch(50257, top_p=True, **row_draw.WIDE_TOP_P)
    compact = row_draw.cuda_launch(50257, top_p=True, **row_draw.COMPACT_TOP_P)
    assert (wide["BLOCK_V"], wide["num_warps"], "maxnreg" in wide) == (2048, 16, False)
    assert (compact["BLOCK_V"], compact["num_warps"], compact["maxnreg"]) == (1024, 8, 128)
    assert compact["NTILES"] >= -(-50257 // 1024)  # the lane's column table holds all its tiles
    assert "maxnreg" not in row_draw.cuda_launch(50257)
    layout = row_draw.top_p_layout(2, 132)
    layout["num_warps"] = 4  # the caller's copy: the module's layouts stay as they are
    assert row_draw.WIDE_TOP_P["num_warps"] == 16


def test_launch_sweep_runs_every_variant():
    """benchmarks.profile_decoding's sweeps (GPU tuning) pass each launch variant through draw_rows
    and the scan + select (greedy and sampling); here in the interpreter, with a counting timer, on a vocabulary of
    one to two tiles per width."""
    from benchmarks.profile_decoding import sweep, variants

    logits = torch.randn(3, 2100, device=DEVICE) * 3
    timed = []
    for top_p in (None, 0.9):
        rows = sweep(logits, top_p, variants(), lambda step, z: timed.append(step(z)) or 1.0)
        assert [variant for variant, _ in rows] == variants()
    assert len(timed) == 2 * len(variants())
    assert {v.launch(2100)["NTILES"] for v in variants()} == {8}  # 2 tiles of 2048, 1 of 4096: padded
    from benchmarks.profile_decoding import scan_sweep

    launches = [(1024, 1), (1024, 3), (2048, 2)]
    for draw in (False, True):
        rows = scan_sweep(logits, launches, lambda step, z: timed.append(step(z)) or 1.0, draw=draw)
        assert [launch for launch, _ in rows] == launches
    from benchmarks.profile_decoding import top_k_parts

    parts = top_k_parts(logits, 4, lambda step, z: timed.append(step(z)) or 1.0)
    assert [name for name, _ in parts] == ["candidate scan", "scan + select", "one launch"]
    from benchmarks.profile_decoding import bounds_sweep

    rows = bounds_sweep(logits, lambda step, z: timed.append(step(z)) or 1.0)
    assert [(p, b) for p, b, _, _ in rows] == [(0.4, True), (0.4, False), (0.9, True), (0.9, False)]
    assert all(passes >= 0 for *_, passes in rows)
    assert len(timed) == 2 * len(variants()) + 13
    from benchmarks.profile_decoding import round_candidates_sweep

    rows = round_candidates_sweep(logits, lambda step, z: 1.0)
    assert [(p, c) for p, c, *_ in rows] == [(0.4, 1), (0.4, 2), (0.4, 4), (0.9, 1), (0.9, 2), (0.9, 4)]
    assert all(1.0 <= mean <= most < row_draw.MAX_ROUNDS for *_, mean, most in rows)
    from benchmarks.profile_decoding import top_p_layout_sweep

    rows = top_p_layout_sweep(logits, lambda step, z: 1.0)
    assert [(p, name) for p, name, *_ in rows] == [(0.4, "wide"), (0.4, "compact"), (0.9, "wide"), (0.9, "compact")]
    assert all(1.0 <= mean < row_draw.MAX_ROUNDS and passes >= 0 for *_, mean, passes in rows)
    top_k_launches = [(1024, 2), (2048, 1)]  # the top-k-scan table's steps (one-launch top-k)
    rows = scan_sweep(logits, top_k_launches, lambda step, z: timed.append(step(z)) or 1.0, top_k=4)
    assert [launch for launch, _ in rows] == top_k_launches and len(timed) == 2 * len(variants()) + 15
    from benchmarks.profile_decoding import _TABLE_RUNNERS, TABLES, bare_read, main, read_floor_parts

    parts = read_floor_parts(logits, lambda step, z: timed.append(step(z)) or 1.0)
    assert [name.split(" (")[0] for name, _ in parts] == [
        "bare read", "torch.amax(dim=1)", "greedy scan alone", "greedy, scan + select", "greedy, one launch",
        "sampling, row draw", "sampling, one launch"]
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


def _scaled_tiles_row(gen: torch.Generator) -> torch.Tensor:
    """V = 61 with ties, one tile ~12 below the rest and a late tile raising the running max."""
    z = _row(gen, V=61)
    z[8:16] -= 12.0
    z[48:56] += 3.0
    return z


@pytest.mark.parametrize("case,round_candidates", [("eos pivot", None), ("st tiles", None), ("va tiles", None),
                                                   ("eos pivot", 4), ("va tiles", 2)])
def test_rounds_distribution_on_pivot_and_scaled_rows(case, round_candidates):
    """10⁶ draws G-tested against the float64 truncated reference (fresh seed): a rejected eos
    becoming the pivot (NMST; eos must never be drawn); ST and VA rows whose tiles differ in scale
    across 8- and 16-column tiles, with p = 0.3 for VA (several rounds on most rows); one and several
    candidates per round."""
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    if case == "eos pivot":
        (z, eos, eps, t, top_p), head, block_v = _eos_pivot_row(), "nmst", 4
    else:
        z, eos, eps, t = _scaled_tiles_row(gen), 2, 0.01, 3
        z[eos] = 3.0  # ST's α_3 ≈ 0.2: eos inside the nucleus, not all of it
        head, top_p, block_v = ("st", 0.9, 16) if case == "st tiles" else ("va", 0.3, 8)
    state = _st_state_before(z, eos, eps, t) if head == "st" else None
    reference = truncated_distribution(_reference_log_probs(z, head, eos, eps, t).unsqueeze(0), None, top_p)[0]
    rows = z.to(DEVICE).unsqueeze(0).expand(DRAWS, -1)
    launch = row_draw.default_launch(rows, top_p=True, candidates=round_candidates or 1)
    if not rows.is_cuda:  # the interpreter: as many elements per program as the default tiles hold
        launch["BLOCK_B"] *= launch["BLOCK_V"] // block_v
    launch |= {"BLOCK_V": block_v, "NTILES": row_draw.tile_table_width(z.shape[0], block_v)}
    picked, rounds = row_draw.draw_rows(rows, head=head, eos_index=eos, eps=eps, temperature=1.0, steps=t,
                                        state=None if state is None else state.to(DEVICE).expand(DRAWS),
                                        top_p_threshold=top_p - TOP_P_SLACK,
                                        seed=torch.tensor([seed + 1], device=DEVICE), launch=launch,
                                        round_candidates=round_candidates)
    assert picked.flags.tolist() == [DRAWS, DRAWS]
    assert int(rounds.max()) >= 2
    if case == "eos pivot":
        assert (float(reference[eos]) == 0.0
                and 0.1 < float(_reference_log_probs(z, head, eos, eps, t)[eos].exp()) < 0.35)
    assert _g_test(picked.tokens.cpu(), reference) > 1e-5, f"seed={seed}"


@pytest.mark.parametrize("head,top_p,eos", [("nmst", None, 20), ("st", 0.8, 60), ("va", 0.6, 3), ("nmst", 0.95, 99)])
def test_row_draw_lanes_across_tiles(head, top_p, eos):
    """The row draw with 16-column tiles on a 101-column row: its lanes (a column position followed
    across seven tiles) carry the passes' sums, and a lane's columns are gathered to draw from it.
    eos in a whole tile (masked span between unmasked ones), in the partial last tile or the first;
    10⁶ draws G-tested against the float64 (truncated) distribution, PREFETCH on and off alike."""
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    V, t, eps = 101, 4, 0.02
    z = _row(gen, V) * 1.5
    z[30:46] -= 6.0  # a light tile
    z[80:96] += 2.0  # a heavy one, after the light
    state = _st_state_before(z, eos, eps, t) if head == "st" else None
    log_p = _reference_log_probs(z, head, eos, eps, t)
    expected = torch.exp(log_p) if top_p is None else truncated_distribution(log_p.unsqueeze(0), None, top_p)[0]
    launch = dict(BLOCK_B=row_draw._interpreter_launch(DRAWS, V)["BLOCK_B"] * 8, BLOCK_V=16,
                  NTILES=nucleus.tile_table_width(V, 16))
    rows = z.to(DEVICE).unsqueeze(0).expand(DRAWS, -1)
    runs = []
    for prefetch in (True, False):
        picked, _ = row_draw.draw_rows(
            rows, head=head, eos_index=eos, eps=eps, temperature=1.0, steps=t,
            state=None if state is None else state.to(DEVICE).expand(DRAWS),
            seed=torch.tensor([seed], device=DEVICE), top_p_threshold=None if top_p is None else top_p - TOP_P_SLACK,
            launch=launch | {"PREFETCH": prefetch})
        assert picked.flags.tolist() == [DRAWS, DRAWS]
        runs.append(picked.tokens.cpu())
    assert torch.equal(runs[0], runs[1])
    assert _g_test(runs[0], expected) > 1e-5, f"seed={seed}"


@pytest.mark.parametrize("top_p", [None, 0.9])
def test_row_draw_takes_logits_near_the_fp32_limit(top_p):
    """A row whose largest x is near the fp32 maximum (2.4e38; or 2.4e36 at temperature 0.01) is
    drawn in one round: the weights are 2^((x − M)·log2 e) — x·log2 e − M·log2 e overflowed to
    inf − inf there, so the top column could never be drawn and every round was rejected."""
    for big, temperature in ((2.4e38, 1.0), (1.2e38, 0.5), (2.4e36, 0.01)):
        z = torch.tensor([[0.0, big, -1.0, 5.0]], device=DEVICE).expand(4, -1)
        picked, rounds = row_draw.draw_rows(z, head="va", eos_index=0, eps=1e-3, temperature=temperature, steps=1,
                                            state=None, seed=torch.tensor([1], device=DEVICE),
                                            top_p_threshold=top_p)
        assert picked.flags.tolist() == [4, 4] and (rounds == 1).all()
        assert (picked.tokens == 1).all()


@pytest.mark.parametrize("block_v,round_candidates", [(16, 1), (64, 1), (None, 1), (64, 4)])
def test_bounds_never_contradict_the_pass(block_v, round_candidates):
    """The rounds the lane-maxima bounds decide without reading the row (top-p): ``verify`` reads it
    anyway and counts every bound decision the pass would have made the other way — there must be
    none — over fresh random cases (ties, bf16 values, a flat half, −inf runs, every head, eos
    anywhere, temperatures, magnitudes up to 1e4 and near the fp32 limit, p from 0.001 to 1), with
    16- and 64-column tiles (many columns per lane, as at V = 50257) and the default. With one
    candidate per round the draws are the same with and without the audit (with several, the audit
    examines each round's first draw instead of the first the bounds keep), and every draw lies in
    the float64 nucleus."""
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    for _ in range(12):
        case = _random_case(gen)
        z = case["z"]
        if bool(torch.rand(1, generator=gen) < 0.3):  # large magnitudes: the slack must cover their rounding
            z = (z.float() * 100 + float(torch.randn(1, generator=gen)) * 1e4).to(z.dtype)
        rows = z.repeat_interleave(40, dim=0).to(DEVICE)
        B, V = rows.shape
        args = dict(head=case["head"], eos_index=case["eos"], eps=case["eps"], temperature=case["temperature"],
                    steps=case["t"], top_p_threshold=case["top_p"] - TOP_P_SLACK,
                    state=None if case["state"] is None else case["state"].repeat_interleave(40).to(DEVICE),
                    seed=torch.tensor([seed], device=DEVICE))
        launch = None if block_v is None else dict(row_draw._interpreter_launch(B, V, round_candidates),
                                                   BLOCK_V=block_v, NTILES=nucleus.tile_table_width(V, block_v))
        contradicted = torch.zeros(B, dtype=torch.int32, device=DEVICE)
        audited, _ = row_draw.draw_rows(rows, launch=launch, passes=contradicted, verify=True,
                                        round_candidates=round_candidates, **args)
        plain, _ = row_draw.draw_rows(rows, launch=launch, round_candidates=round_candidates, **args)
        assert int(contradicted.sum()) == 0, f"seed={seed} {case['head']} p={case['top_p']}"
        if round_candidates == 1:
            assert torch.equal(audited.tokens, plain.tokens) and torch.equal(audited.flags, plain.flags)
        served = plain.flags[1] == B  # a row left after MAX_ROUNDS (flags[1]) is the caller's to redraw
        dist = effective_logits(z.float(), **{k: case[k] for k in ("head", "eps", "temperature")},
                                eos_index=case["eos"], steps=case["t"], state=case["state"])
        tokens, probs = truncated_candidates(dist, None, case["top_p"])
        allowed = torch.zeros(z.shape, dtype=torch.float64).scatter_add(1, tokens, probs).repeat_interleave(40, dim=0)
        ok = allowed.gather(1, plain.tokens.cpu()[:, None])[:, 0] > 0
        if served and plain.flags[0] == B:
            # Within ~1e-7 of p the fp32 sums may place the cut one token off the float64 one.
            assert float(ok.double().mean()) > 0.97, f"seed={seed}"


def test_bounds_settle_most_rounds_of_peaked_rows():
    """Without a pass for most rounds, top-p costs about one read: on rows like the benchmark's
    (z ~ N(0, 3²)) with 64-column tiles (25 columns per lane, as at V = 50257 with 2048-column
    tiles), few rounds read the row; with ``bounds=False`` every round does. (The draws' distribution
    with the bounds: every G-test of the row draw runs with them.)"""
    seed = torch.seed() % 2**31
    z = torch.randn(2000, 1600, generator=torch.Generator().manual_seed(seed)).to(DEVICE) * 3
    launch = dict(row_draw._interpreter_launch(2000, 1600), BLOCK_V=64, NTILES=nucleus.tile_table_width(1600, 64))
    for top_p, most in ((0.4, 0.1), (0.9, 0.3)):
        args = dict(head="nmst", eos_index=7, eps=1e-3, temperature=1.0, steps=30, state=None,
                    top_p_threshold=top_p - TOP_P_SLACK, seed=torch.tensor([seed], device=DEVICE), launch=launch)
        for bounds in (True, False):
            passes = torch.zeros(2000, dtype=torch.int32, device=DEVICE)
            picked, rounds = row_draw.draw_rows(z, bounds=bounds, passes=passes, **args)
            assert picked.flags.tolist() == [2000, 2000]
            if bounds:
                assert float(passes.double().mean()) < most, f"seed={seed} p={top_p}"
            else:
                assert torch.equal(passes, rounds)  # every round read the row
