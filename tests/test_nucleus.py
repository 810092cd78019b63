"""The nucleus cut (nmst_fast/kernels/nucleus.py: top-p alone for repeated rows and for rows the rejection
kernel leaves): the kept set against the float64 truncation, the draw as a distribution, one shared
cut for repeated rows, and the torch fallback."""

import pytest
import torch

import nmst_fast.kernels.nucleus as nucleus
from nmst_fast.decoding import effective_logits, sample, truncated_candidates
from nmst_fast.decoding.fused import fused_truncated
from nmst_fast.decoding.truncation import TOP_P_SLACK

from helpers import DEVICE
from test_decoding import check_sampling_distribution

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
        z = z.to(torch.bfloat16)  # the kernels read bf16; the reference gets the same values in fp32
    head = HEADS[int(torch.randint(0, 3, (1,), generator=gen))]
    return dict(z=z, head=head, eos=int(torch.randint(0, V, (1,), generator=gen)),
                top_p=float(torch.rand(1, generator=gen)) * 0.999 + 0.001,
                temperature=[1.0, 0.7, 1.5][int(torch.randint(0, 3, (1,), generator=gen))],
                eps=[1e-8, 1e-3, 0.5][int(torch.randint(0, 3, (1,), generator=gen))],
                t=(int(torch.randint(-1, 10**6, (1,), generator=gen))
                   // int(torch.randint(1, 10**4, (1,), generator=gen))),
                state=torch.rand(B, generator=gen, dtype=torch.float64) * -3 if head == "st" else None)


def _check_cut(case: dict) -> None:
    z, head, eos, top_p = case["z"], case["head"], case["eos"], case["top_p"]
    args = dict(head=head, eos_index=eos, eps=case["eps"], temperature=case["temperature"], steps=case["t"],
                state=case["state"])
    cut = nucleus.nucleus_cut(z.to(DEVICE), top_p_threshold=top_p - TOP_P_SLACK,
                              **{**args, "state": None if case["state"] is None else case["state"].to(DEVICE)})
    B = z.shape[0]
    assert cut.out.flags.tolist() == [B, B], case
    kept = nucleus.kept_probabilities(cut, z.to(DEVICE), eos_index=eos, temperature=case["temperature"],
                                      head=head).cpu()
    kept = kept / kept.sum(dim=1, keepdim=True)
    dist = effective_logits(z.float(), **args)
    tokens, probs = truncated_candidates(dist, None, top_p)
    expected = torch.zeros_like(kept).scatter_add(1, tokens, probs)
    for b in range(B):
        if torch.equal(kept[b] > 0, expected[b] > 0):
            torch.testing.assert_close(kept[b], expected[b], rtol=1e-5, atol=1e-9)
            continue
        # Only a cut whose float64 mass before some token lies within BOUNDARY of p may differ.
        log_p = dist.log_probs()[b]
        ranked = torch.exp(torch.sort(log_p, descending=True, stable=True).values)
        margin = float((torch.cumsum(ranked, 0) - ranked - top_p).abs().min())
        assert margin < BOUNDARY, (b, case)


@pytest.mark.parametrize("capacity", [nucleus.BRACKET_CAPACITY, 4])
def test_cut_keeps_the_float64_nucleus(capacity, monkeypatch):
    """Random rows (fresh seeds) against the float64 torch truncation; capacity 4 makes even short
    rows take bracket passes and resolve C-plus ties."""
    monkeypatch.setattr(nucleus, "BRACKET_CAPACITY", capacity)
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    for _ in range(12):
        case = _random_case(gen)
        case["seed"] = seed
        _check_cut(case)


@pytest.mark.parametrize("logits,top_p,kept", [
    ([0.0] * 200, 0.99, list(range(198))),  # one flat tie: the 198 lowest indices
    ([0.0] * 5 + [1.0] * 3, 0.7, [0, 1, 5, 6, 7]),  # e/(5 + 3e) each above, then two of the tie
    ([3.0] + [0.0] * 9, 0.9, list(range(8))),  # mass before the 8th: (e³ + 6) / (e³ + 9) = 0.897
])
def test_cut_on_ties(logits, top_p, kept, monkeypatch):
    """Ties at the cut go to the lowest indices, in the sorted list and in a C-plus tie alike."""
    monkeypatch.setattr(nucleus, "BRACKET_CAPACITY", 4)
    z = torch.tensor([logits])
    _check_cut(dict(z=z, head="va", eos=0, top_p=top_p, temperature=1.0, eps=0.1, t=1, state=None))
    cut = nucleus.nucleus_cut(z.to(DEVICE), head="va", eos_index=0, eps=0.1, temperature=1.0, steps=1, state=None,
                              top_p_threshold=top_p - TOP_P_SLACK)
    table = nucleus.kept_probabilities(cut, z.to(DEVICE), eos_index=0, temperature=1.0, head="va").cpu()[0]
    assert torch.nonzero(table).flatten().tolist() == kept


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("capacity", [nucleus.BRACKET_CAPACITY, 4])
def test_nucleus_draw_distribution(head, capacity, monkeypatch):
    """10⁶ draws G-tested; capacity 4 puts the draw in every region (eos, above the bracket, kept list,
    C-plus tie)."""
    monkeypatch.setattr(nucleus, "BRACKET_CAPACITY", capacity)
    check_sampling_distribution(head, 40, None, 0.8, impl="triton", device=DEVICE)


def test_nucleus_draw_from_a_wide_tie(monkeypatch):
    """A cut inside a tie of more than C tokens (drawn by rank among the tie) and tokens above it."""
    from test_decoding import DRAWS, _g_test

    monkeypatch.setattr(nucleus, "BRACKET_CAPACITY", 4)
    z = torch.zeros(40)
    z[[3, 17, 30]] = torch.tensor([2.0, 1.5, 1.0])
    z[35] = float("-inf")
    dist = effective_logits(z.double().unsqueeze(0), head="va", eos_index=0)
    tokens, probs = truncated_candidates(dist, None, 0.7)
    expected = torch.zeros(40, dtype=torch.float64).scatter_add(0, tokens[0], probs[0])
    assert 4 < int((expected == expected[0]).sum()) < 36  # the cut is inside the tie of zeros
    draws, _ = sample(z.to(DEVICE).expand(DRAWS, -1), head="va", eos_index=0, top_p=0.7, impl="triton",
                      generator=torch.Generator().manual_seed(2))
    assert _g_test(draws.cpu(), expected) > 1e-5


@pytest.mark.parametrize("head", HEADS)
def test_one_cut_serves_repeated_rows(head):
    """Rows repeated with stride 0 are cut once; the draws, log-probs and ST state equal those of the
    copied rows, each cut on its own."""
    gen = torch.Generator().manual_seed(4)
    z = (torch.randn(1, 300, generator=gen) * 2).to(DEVICE).expand(64, -1)
    state = torch.full((1,), -0.5, dtype=torch.float64, device=DEVICE).expand(64) if head == "st" else None
    args = dict(head=head, eos_index=7, eps=0.01, temperature=1.0, steps=9, top_p_threshold=0.9,
                seed=torch.tensor([1], device=DEVICE))
    assert nucleus.shares_one_cut(z, 9, state)
    shared = nucleus.nucleus_select(z, state=state, **args)
    copied = nucleus.nucleus_select(z.contiguous(), state=None if state is None else state.contiguous(), **args)
    assert torch.equal(shared.tokens, copied.tokens) and torch.equal(shared.log_probs, copied.log_probs)
    assert len(set(shared.tokens.tolist())) > 3
    if head == "st":
        assert torch.equal(shared.state, copied.state)


def test_log_probs_are_the_untruncated_step_log_probs():
    gen = torch.Generator().manual_seed(6)
    z = (torch.randn(5, 400, generator=gen) * 3).to(DEVICE)
    picked = fused_truncated(z, head="nmst", eos_index=3, eps=0.05, steps=torch.arange(5, device=DEVICE), top_p=0.8,
                             generator=torch.Generator().manual_seed(0))
    log_p = effective_logits(z.cpu(), head="nmst", eos_index=3, eps=0.05, steps=torch.arange(5)).log_probs()
    torch.testing.assert_close(picked.log_probs.cpu(), log_p.gather(1, picked.tokens.cpu()[:, None])[:, 0],
                               rtol=1e-6, atol=1e-6)


def test_unresolved_cut_falls_back_to_the_torch_path(monkeypatch):
    """No rejection round allowed sends the rows to the cut; with no bracket pass allowed either, a
    nucleus cut among more than C distinct values is unresolved: the step takes the torch path,
    starting from the whole row on CUDA."""
    import nmst_fast.decoding.selection as selection
    import nmst_fast.kernels.row_draw as row_draw

    z = torch.randn(3, 500, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    monkeypatch.setattr(row_draw, "MAX_ROUNDS", 0)  # every row goes to the cut (rounds exhausted)
    assert fused_truncated(z, head="nmst", eos_index=0, top_p=0.9) is not None  # ~400 tokens: served
    monkeypatch.setattr(nucleus, "MAX_PASSES", 0)
    assert fused_truncated(z, head="nmst", eos_index=0, top_p=0.9) is None
    sizes = []
    real = selection.ranked_candidates
    monkeypatch.setattr(selection, "ranked_candidates", lambda d, k: sizes.append(k) or real(d, k))
    tokens, _ = sample(z, head="nmst", eos_index=0, top_p=0.9, impl="triton",
                       generator=torch.Generator().manual_seed(0))
    assert tokens.shape == (3,) and bool(((tokens >= 0) & (tokens < 500)).all())
    assert sizes[0] == (500 if z.is_cuda else selection._FIRST_CANDIDATES)


def test_nan_rows_are_reported():
    z = torch.randn(4, 50, device=DEVICE)
    z[2, 7] = float("nan")
    with pytest.raises(ValueError, match="row 2"):
        sample(z, head="nmst", eos_index=0, top_p=0.5, impl="triton")
    z[2] = float("-inf")
    with pytest.raises(ValueError, match="row 2"):
        sample(z, head="va", eos_index=0, top_p=0.5, impl="triton")


def test_bracket_passes_stay_few():
    """Convergence, not time: peaked N(0, 9) logits need ≤ 4 bracket passes for p = 0.9 at V = 20000
    (each pass splits the bracket BRACKET_SPLITS = 8 ways, then narrows it to its members); a flat VA
    row (one tie) and a row of at most C tokens need none."""
    z = torch.randn(4, 20000, generator=torch.Generator().manual_seed(3)).to(DEVICE) * 3
    args = dict(head="nmst", eos_index=0, eps=1e-5, temperature=1.0, steps=100, state=None)
    cut = nucleus.nucleus_cut(z, top_p_threshold=0.9, **args)
    assert cut.out.flags.tolist() == [4, 4] and 1 <= int(cut.parts["passes"].max()) <= 4
    flat = nucleus.nucleus_cut(torch.zeros(2, 3000, device=DEVICE), top_p_threshold=0.9, **{**args, "head": "va"})
    short = nucleus.nucleus_cut(z[:, : nucleus.BRACKET_CAPACITY], top_p_threshold=0.9, **args)  # 63 + eos
    assert int(flat.parts["passes"].max()) == 0 and int(short.parts["passes"].max()) == 0
