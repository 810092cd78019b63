"""The C++ selection kernel of CPU decoding steps (``kernels/cpu/select_rows.cpp`` through ``DecodingStep``'s
"auto" path on CPU): draws G-tested against the float64 reference for every head, strategy, temperature and eos
position, at V from 2 to 151936 (flat and peaked rows, so top-p's boundary search by histogram runs), greedy equal
to the reference's argmax, the log-probabilities and ST's state the reference's, bad rows refused by index."""

from __future__ import annotations

import math

import pytest
import torch

import nmst_fast
from nmst_fast.decoding import DecodingStep
from nmst_fast.decoding.cpu_rows import CPURows
from nmst_fast.kernels.cpu import row_kernels
from nmst_fast.reference import truncated_distribution

from helpers import G_TEST_MIN_P, g_test_p

HEADS = ("nmst", "st", "va")
EPS = 0.002
TRUNCATIONS = [(None, None, None), (3, None, None), (30, None, None), (None, 0.6, None), (None, 0.95, None),
               (5, 0.7, None), (None, None, 0.1), (None, 0.95, 0.05), (None, 0.3, 0.02), (30, 0.9, 0.2), (5, None, 0.5)]


def reference_log_probs(z: torch.Tensor, head: str, eos: int, t: int, temperature: float) -> torch.Tensor:
    """(V,) float64 log p of the step at t for the row ``z`` (float32), temperature dividing the non-eos logits
    (every logit for VA); ST's eos logit held at z[eos] over steps 1..t."""
    tempered = z.double() / temperature
    if head != "va":
        tempered[eos] = z[eos].double()
    if head == "st":
        return nmst_fast.nmst_log_probs(tempered.expand(1, t, -1), eos_index=eos, eps=EPS, head="st")[0, -1]
    return nmst_fast.nmst_log_probs(tempered[None], eos_index=eos, eps=EPS, head=head, steps=torch.tensor([t]))[0]


def st_state_before(z: torch.Tensor, eos: int, t: int) -> torch.Tensor:
    """ST's running log(1 − α) after steps 1..t−1 at a constant eos logit (float64, (1,))."""
    term = torch.nn.functional.logsigmoid(z[eos].double()) + math.log1p(-EPS)
    return (term * (t - 1)).reshape(1)


def kernel_step(head: str, eos: int, V: int, top_k=None, top_p=None, temperature: float = 1.0,
                min_p=None) -> DecodingStep:
    step = DecodingStep(head=head, eos_index=eos, vocab_size=V, eps=EPS, top_k=top_k, top_p=top_p, min_p=min_p,
                        temperature=temperature)
    assert step._cpu_rows_wanted and row_kernels() is not None
    return step


def draws_of(row: torch.Tensor, step: DecodingStep, head: str, eos: int, t: int, draws: int, seed: int):
    state = st_state_before(row, eos, t).expand(draws).contiguous() if head == "st" else None
    out = step(row[None].expand(draws, -1), steps=t, state=state, generator=torch.Generator().manual_seed(seed))
    assert isinstance(step._cpu_rows, CPURows)  # the kernel served the call
    return out


def small_row(gen: torch.Generator, V: int) -> torch.Tensor:
    z = torch.randn(V, generator=gen, dtype=torch.float64) * 2
    z[5] = z[9] = z[3]  # a three-way tie
    return z.float()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("top_k,top_p,min_p", TRUNCATIONS)
@pytest.mark.parametrize("eos", ["first", "inside", "last"])
@pytest.mark.parametrize("head", HEADS)
def test_draws_follow_the_float64_reference(head, eos, top_k, top_p, min_p, temperature):
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    V = 24
    eos_index = {"first": 0, "inside": 11, "last": V - 1}[eos]
    row = small_row(gen, V)
    t = int(torch.randint(1, 60, (1,), generator=gen))
    step = kernel_step(head, eos_index, V, top_k, top_p, temperature, min_p)
    out = draws_of(row, step, head, eos_index, t, 100_000, seed + 1)
    log_p = reference_log_probs(row, head, eos_index, t, temperature)
    reference = truncated_distribution(log_p[None], top_k, top_p, min_p)[0]
    assert g_test_p(out.tokens, reference) > G_TEST_MIN_P, f"seed={seed}"
    torch.testing.assert_close(out.log_probs, log_p[out.tokens], rtol=1e-6, atol=1e-6)
    if head == "st":
        want = st_state_before(row, eos_index, t + 1).expand(out.tokens.numel())
        torch.testing.assert_close(out.state, want, rtol=1e-12, atol=1e-12)


def long_row(gen: torch.Generator, V: int, shape: str) -> torch.Tensor:
    """A flat row (N(0, 3²)) or a peaked one (a Zipf prior over a shuffled vocabulary plus N(0, 1) noise)."""
    z = torch.randn(V, generator=gen) * (3.0 if shape == "flat" else 1.0)
    if shape == "peaked":
        ranks = torch.randperm(V, generator=gen).double() + 1
        z += (-1.1 * ranks.log() + 8).float()
    return z


LONG_CASES = [(V, shape, k, p, None) for V in (32000, 151936) for shape in ("flat", "peaked")
              for k, p in [(None, 0.9), (50, None), (40, 0.95), (None, None)]]
LONG_CASES += [(32000, "flat", 6000, 0.9, None)]  # a top-k list past the size sorted whole: its nucleus by histogram
# min-p alone, under top-p 0.95 (llama.cpp's defaults: min-p binds on flat rows, top-p on peaked ones), and under
# top-k 40 + top-p 0.95; 0.001 keeps thousands of a flat row's tokens
LONG_CASES += [(V, shape, k, p, m) for V in (32000, 151936) for shape in ("flat", "peaked")
               for k, p, m in [(None, None, 0.05), (None, 0.95, 0.05), (40, 0.95, 0.05), (None, 0.9, 0.001)]]


@pytest.mark.parametrize("draws", [pytest.param(40_000, marks=pytest.mark.slow), 4_000])
@pytest.mark.parametrize("V,shape,top_k,top_p,min_p", LONG_CASES)
def test_long_rows_follow_the_float64_reference(V, shape, top_k, top_p, min_p, draws):
    """At real vocabularies, eos inside: a draw outside the reference's support fails the G-test at once (the
    nucleus boundary exactly); flat rows put tens of thousands of tokens into top-p's candidate set."""
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    eos = V - 255
    row = long_row(gen, V, shape)
    row[eos] = -3.0
    step = kernel_step("nmst", eos, V, top_k, top_p, 0.8, min_p)
    out = draws_of(row, step, "nmst", eos, 40, draws, seed + 1)
    reference = truncated_distribution(reference_log_probs(row, "nmst", eos, 40, 0.8)[None], top_k, top_p,
                                       min_p)[0]
    assert g_test_p(out.tokens, reference) > G_TEST_MIN_P, f"seed={seed}"


@pytest.mark.parametrize("order", ["ties", "ascending", "descending"])
@pytest.mark.parametrize("top_k", [7, 50, 300])
def test_top_k_set_with_ties_across_blocks_and_sorted_rows(order, top_k):
    """Top-k reads only the vocabulary blocks whose max reaches the k-th largest block max, and collects the entries
    equal to it only while fewer than k are: rows whose k-th value is tied across many blocks (ties go to the lower
    column), and sorted rows (every large value in a few blocks, or in the last ones), draw from exactly the
    reference's top-k set."""
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    V, eos = 20000, 9000
    if order == "ties":
        row = (torch.randn(V, generator=gen) * 1.5).round()
    else:
        row = torch.linspace(-4.0, 4.0, V)
        row = row.flip(0) if order == "descending" else row
    row[eos] = -3.0
    step = kernel_step("nmst", eos, V, top_k)
    out = draws_of(row, step, "nmst", eos, 40, 20_000, seed + 1)
    reference = truncated_distribution(reference_log_probs(row, "nmst", eos, 40, 1.0)[None], top_k, None, None)[0]
    assert bool((reference[out.tokens] > 0).all()), f"seed={seed}"
    assert int((reference > 0).sum()) == top_k
    assert g_test_p(out.tokens, reference) > G_TEST_MIN_P, f"seed={seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V", [2, 17, 50257])
@pytest.mark.parametrize("head", ["nmst", "va"])
def test_greedy_is_the_float64_argmax(head, V, dtype):
    """Rows with ties (logits rounded), eos first, inside and last, t from context (0) to 10⁶, temperatures
    (ST: along a sequence, below)."""
    gen = torch.Generator().manual_seed(V)
    for eos in sorted({0, V // 2, V - 1}):
        for temperature in (1.0, 0.5):
            z = (torch.randn(64, V, generator=gen) * 2).round(decimals=1).to(dtype)
            z[:8, eos] = z[:8].float().amax(dim=1).to(dtype) + 3  # eos likeliest at small t
            steps = torch.cat([torch.tensor([0, 1, 2, 10**6]), torch.randint(0, 500, (60,), generator=gen)])
            out = kernel_step(head, eos, V, top_k=1, temperature=temperature)(z, steps=steps)
            for b in range(64):
                log_p = reference_log_probs(z[b].float(), head, eos, int(steps[b]), temperature)
                assert int(out.tokens[b]) == int(torch.argmax(log_p)), (eos, temperature, b)
                assert float(out.log_probs[b]) == pytest.approx(float(log_p.max()), rel=1e-6, abs=1e-6)


def test_st_greedy_and_state_along_a_sequence():
    """ST decoded step by step (state passed on) picks the float64 reference's argmax at each t."""
    gen = torch.Generator().manual_seed(3)
    V, eos, T = 300, 7, 40
    z = torch.randn(T, V, generator=gen) * 2
    z[:, eos] = torch.linspace(-6, 3, T)
    reference = nmst_fast.nmst_log_probs(z.double()[None], eos_index=eos, eps=EPS, head="st")[0]
    step = kernel_step("st", eos, V, top_k=1)
    state = None
    for t in range(1, T + 1):
        out = step(z[t - 1:t], steps=t, state=state)
        state = out.state
        assert int(out.tokens[0]) == int(reference[t - 1].argmax()), t
        assert float(out.log_probs[0]) == pytest.approx(float(reference[t - 1].max()), rel=1e-9, abs=1e-12)


def test_two_columns_and_certain_eos():
    """V = 2 (eos and one token); an eos logit of +inf makes eos certain for NMST past context, and -inf is a
    valid row (p(eos) = 1 − (1 − ε)^t)."""
    z = torch.tensor([[0.3, -1.0]]).expand(20_000, -1)
    out = kernel_step("nmst", 1, 2)(z, steps=5, generator=torch.Generator().manual_seed(0))
    p_eos = 1 - torch.sigmoid(torch.tensor(1.0, dtype=torch.float64)) * (1 - EPS) ** 5
    assert abs(float((out.tokens == 1).double().mean()) - float(p_eos)) < 5 * math.sqrt(0.25 / 20_000)
    certain = torch.tensor([[0.3, math.inf], [0.3, -math.inf]])
    out = kernel_step("nmst", 1, 2, top_k=1)(certain, steps=3)
    assert out.tokens.tolist() == [1, 0]


@pytest.mark.parametrize("top_k,top_p", [(1, None), (None, None), (4, None), (None, 0.8), (4, 0.8)])
def test_rows_without_a_distribution_are_refused_by_index(top_k, top_p):
    for bad in (math.nan, math.inf):
        z = torch.randn(5, 40)
        z[3, 17] = bad
        with pytest.raises(ValueError, match="logits row 3"):
            kernel_step("nmst", 0, 40, top_k, top_p)(z, steps=2)
    z = torch.randn(5, 40)
    z[2, 1:] = -math.inf  # no finite non-eos logit
    with pytest.raises(ValueError, match="logits row 2"):
        kernel_step("nmst", 0, 40, top_k, top_p)(z, steps=2)
    z = torch.randn(5, 40)
    z[4, 0] = math.nan  # a NaN eos logit
    with pytest.raises(ValueError, match="logits row 4"):
        kernel_step("nmst", 0, 40, top_k, top_p)(z, steps=2)


def test_seeded_draws_reproduce_and_strided_rows_are_read_in_place():
    gen = torch.Generator().manual_seed(11)
    wide = torch.randn(8, 2 * 5000, generator=gen)
    rows = wide[:, ::2]  # column stride 2: copied to float32 rows first
    for top_k, top_p in [(None, None), (20, 0.9), (None, 0.9)]:
        step = kernel_step("nmst", 3, 5000, top_k, top_p)
        first = step(rows, steps=4, generator=torch.Generator().manual_seed(5)).tokens
        again = step(rows.contiguous(), steps=4, generator=torch.Generator().manual_seed(5)).tokens
        assert torch.equal(first, again)


@pytest.mark.parametrize("head", HEADS)
def test_calls_after_the_first_check_their_arguments_as_the_first(head):
    """After its first call a step hands a loop's call (one int step; ST without a state) to the kernel, which checks
    the logits and the generator itself and declines what it does not serve: each bad argument still gets the
    checked path's error, and other dtypes, layouts and per-row steps the tokens of the same values."""
    V, eos = 300, 7
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(4, V, generator=gen) * 2
    step = kernel_step(head, eos, V, 20, 0.9)
    step(z, steps=3)
    assert step._cpu_rows is not None  # set up: the calls below go to the kernel first
    with pytest.raises(TypeError, match="logits must be a torch.Tensor"):
        step(z.tolist(), steps=3)
    with pytest.raises(TypeError, match="logits must be a floating tensor"):
        step(z.long(), steps=3)
    for shape in (z[:, :-1], z[0], z[None]):
        with pytest.raises(ValueError, match=r"logits must be \(B, V=300\)"):
            step(shape, steps=3)
    with pytest.raises(ValueError, match="logits are on meta"):
        step(z.to("meta"), steps=3)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        step(z, steps=3, generator=3)
    bad = z.clone()
    bad[2, 11] = math.nan
    with pytest.raises(ValueError, match="logits row 2"):
        step(bad, steps=3)
    if head != "va":  # VA has no step
        with pytest.raises(ValueError, match="steps must fit in int64"):
            step(z, steps=2**63)
        with pytest.raises(TypeError, match="steps must be an int"):
            step(z, steps=True)
    if head == "st":
        for bad_value in (math.nan, 0.5):
            with pytest.raises(ValueError, match="state row 1"):
                step(z, steps=3, state=torch.tensor([0.0, bad_value, 0.0, 0.0], dtype=torch.float64))
        with pytest.raises(ValueError, match=r"state must have shape \(4,\)"):
            step(z, steps=3, state=torch.zeros(3, dtype=torch.float64))
        state = (-torch.rand(4, dtype=torch.float64, generator=gen)).float().double()  # float32's values
        seeded = [step(z, steps=3, state=s, generator=torch.Generator().manual_seed(5))
                  for s in (state, state.float(), torch.stack([state, state], 1)[:, 0])]
        for other in seeded[1:]:  # float32 and strided states go the checked path: the same draws
            assert torch.equal(other.tokens, seeded[0].tokens)
            torch.testing.assert_close(other.state, seeded[0].state, rtol=0, atol=0)

    def drawn(logits, steps=3):
        return step(logits, steps=steps, generator=torch.Generator().manual_seed(5))

    want = drawn(z)
    assert torch.equal(drawn(z.bfloat16()).tokens, drawn(z.bfloat16().float()).tokens)
    assert torch.equal(drawn(torch.stack([z, z], 2).reshape(4, 2 * V)[:, ::2]).tokens, want.tokens)  # stride 2
    assert torch.equal(drawn(z, steps=torch.tensor([3, 3, 3, 3])).tokens, want.tokens)
    torch.testing.assert_close(drawn(z, steps=torch.tensor([3, 3, 3, 3])).log_probs, want.log_probs, rtol=0, atol=0)
    greedy = kernel_step(head, eos, V, top_k=1)
    greedy(z, steps=3)
    torch.testing.assert_close(greedy(z.double(), steps=3).tokens, greedy(z, steps=3).tokens)  # float64: torch path
