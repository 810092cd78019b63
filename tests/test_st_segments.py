"""ST's running sum restarts at every t = 1: a packed row (several sequences one after another, each
1, 2, …, n, context positions between them or not) gives the losses, gradients and log-probabilities
of its sequences laid out as separate rows, on every backend."""

import pytest
import torch

import nmst_fast
from nmst_fast import head_math
from nmst_fast.logmath import segmented_cumsum
from nmst_fast.reference import reference_log_survival

from helpers import DEVICE, FAST_IMPLS, Case, make_case, run

LENGTHS = (3, 5, 1, 4)
IMPLS = ("reference",) + FAST_IMPLS


def _loop_segmented_cumsum(x, starts, reverse=False):
    """The definition, one position at a time."""
    out = torch.empty_like(x)
    for r in range(x.shape[0]):
        T = x.shape[1]
        for j in range(T):
            if reverse:
                end = j + 1
                while end < T and not starts[r, end]:
                    end += 1
                out[r, j] = x[r, j:end].sum()
            else:
                begin = j
                while begin > 0 and not starts[r, begin]:
                    begin -= 1
                out[r, j] = x[r, begin:j + 1].sum()
    return out


def test_segmented_cumsum_matches_its_definition_and_is_its_own_adjoint():
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        B, T = (int(v) for v in torch.randint(1, 9, (2,), generator=gen))
        x = torch.randn(B, T, generator=gen, dtype=torch.float64, requires_grad=True)
        starts = torch.rand(B, T, generator=gen) < 0.3
        for reverse in (False, True):
            torch.testing.assert_close(segmented_cumsum(x, starts, reverse=reverse),
                                       _loop_segmented_cumsum(x.detach(), starts, reverse), rtol=1e-12, atol=1e-12)
        g = torch.randn(B, T, generator=gen, dtype=torch.float64)
        (dx,) = torch.autograd.grad(segmented_cumsum(x, starts), x, g)
        torch.testing.assert_close(dx, segmented_cumsum(g, starts, reverse=True), rtol=1e-12, atol=1e-12)
    # Without a restart after the first position it is plain cumsum, bit for bit.
    x = torch.randn(3, 40, generator=gen, dtype=torch.float64)
    starts = torch.zeros(3, 40, dtype=torch.bool)
    starts[1, 0] = True
    assert torch.equal(segmented_cumsum(x, starts), x.cumsum(-1))
    assert torch.equal(segmented_cumsum(x, starts, reverse=True), x.flip(-1).cumsum(-1).flip(-1))
    assert segmented_cumsum(torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.bool), reverse=True).shape == (2, 0)


def test_segmented_cumsum_keeps_non_finite_values_in_their_run():
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[1.0, -inf, 2.0, 3.0, nan, 1.0, inf, -inf, 5.0]], dtype=torch.float64)
    starts = torch.tensor([[1, 0, 0, 1, 0, 1, 0, 0, 1]], dtype=torch.bool)
    torch.testing.assert_close(segmented_cumsum(x, starts),
                               torch.tensor([[1.0, -inf, -inf, 3.0, nan, 1.0, inf, nan, 5.0]], dtype=torch.float64),
                               equal_nan=True)
    torch.testing.assert_close(segmented_cumsum(x, starts, reverse=True),
                               torch.tensor([[-inf, -inf, 2.0, nan, nan, nan, nan, -inf, 5.0]], dtype=torch.float64),
                               equal_nan=True)


def _packed_and_separate(gen, lengths, context, *, V, H, eps=0.05):
    """One packed row (1, T) of documents with ``lengths`` (each after ``context`` positions of
    t = 0, steps 1..n) and the same documents as separate rows (D, T_max), padded with ignored
    targets. Returns (packed Case, separate Case, [(packed position, row, column)])."""
    eos = int(torch.randint(0, V, (1,), generator=gen))
    T_max = context + max(lengths)
    T = sum(context + n for n in lengths)
    hidden = torch.randn(1, T, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64) / H**0.5
    bias = torch.randn(V, generator=gen, dtype=torch.float64) * 0.5
    targets = torch.randint(0, V, (1, T), generator=gen)
    steps = torch.zeros(1, T, dtype=torch.long)
    sep_hidden = torch.randn(len(lengths), T_max, H, generator=gen, dtype=torch.float64)
    sep_targets = torch.full((len(lengths), T_max), -100)
    sep_steps = torch.zeros(len(lengths), T_max, dtype=torch.long)
    where = []
    pos = 0
    for d, n in enumerate(lengths):
        doc_steps = torch.arange(1 - context, n + 1).clamp(min=0)
        doc_targets = targets[0, pos:pos + context + n]
        doc_targets[:context][doc_targets[:context] == eos] = (eos + 1) % V  # eos is impossible in context
        doc_targets[context:][torch.rand(n, generator=gen) < 0.25] = eos
        doc_targets[-1] = eos  # each document ends with eos
        if n > 1:
            doc_targets[context + int(torch.randint(0, n - 1, (1,), generator=gen))] = -100
        steps[0, pos:pos + context + n] = doc_steps
        sep_hidden[d, :context + n] = hidden[0, pos:pos + context + n]
        sep_targets[d, :context + n] = doc_targets
        sep_steps[d, :context + n] = doc_steps
        where += [(pos + j, d, j) for j in range(context + n)]
        pos += context + n
    packed = Case(hidden, weight, bias, targets.to(DEVICE), steps.to(DEVICE), eos, eps, "st")
    separate = Case(sep_hidden, weight, bias, sep_targets.to(DEVICE), sep_steps.to(DEVICE), eos, eps, "st")
    return packed, separate, where


def _split(where, packed_rows, separate_rows):
    """The (packed, separate) values at every real position of the documents."""
    p, r, c = (torch.tensor(v) for v in zip(*where))
    return packed_rows.cpu()[0, p], separate_rows.cpu()[r, c]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("context", [0, 2])
def test_packed_row_equals_separate_rows(impl, context):
    gen = torch.Generator().manual_seed(7 + context)
    V, H = (13, 6) if impl == "triton" else (37, 9)
    dtype = torch.float32 if impl == "triton" else torch.float64  # Triton computes in fp32
    tol = {"rtol": 2e-5, "atol": 2e-5} if impl == "triton" else {"rtol": 1e-10, "atol": 1e-10}
    packed, separate, where = _packed_and_separate(gen, LENGTHS, context, V=V, H=H)
    chunk = 5 if impl != "reference" else None
    for reduction in ("none", "sum"):
        loss_p, dh_p, dw_p, db_p = run(packed, impl, dtype, reduction=reduction, chunk_size=chunk)
        loss_s, dh_s, dw_s, db_s = run(separate, impl, dtype, reduction=reduction, chunk_size=chunk)
        assert torch.isfinite(loss_p).all()
        if reduction == "none":
            torch.testing.assert_close(*_split(where, loss_p, loss_s), **tol)
        else:
            torch.testing.assert_close(loss_p, loss_s, **tol)
        torch.testing.assert_close(*_split(where, dh_p, dh_s), **tol)
        torch.testing.assert_close(dw_p, dw_s, **tol)
        torch.testing.assert_close(db_p, db_s, **tol)


@pytest.mark.parametrize("context", [0, 1])
def test_nmst_log_probs_of_a_packed_row(context):
    gen = torch.Generator().manual_seed(3)
    V = 11
    packed, separate, where = _packed_and_separate(gen, LENGTHS, context, V=V, H=4)
    logits_p = torch.randn(1, packed.steps.shape[1], V, generator=gen, dtype=torch.float64) * 3
    logits_s = torch.randn(len(LENGTHS), separate.steps.shape[1], V, generator=gen, dtype=torch.float64)
    p, r, c = (torch.tensor(v) for v in zip(*where))
    logits_s[r, c] = logits_p[0, p]
    # eos certain from the first document's second step on: p(eos) = 1 there, and only there.
    logits_p[0, context + 1, packed.eos_index] = float("-inf")
    logits_s[0, context + 1, packed.eos_index] = float("-inf")
    kw = {"eos_index": packed.eos_index, "eps": packed.eps, "head": "st"}
    log_p = nmst_fast.nmst_log_probs(logits_p, steps=packed.steps.cpu(), **kw)
    log_s = nmst_fast.nmst_log_probs(logits_s, steps=separate.steps.cpu(), **kw)
    torch.testing.assert_close(log_p[0, p], log_s[r, c], rtol=1e-12, atol=1e-12)
    assert not log_p.isnan().any()
    assert (log_p[0, p[r > 0], packed.eos_index] < 0).all()  # the later documents are back at p(eos) < 1


def _random_steps(gen, B, T):
    """Runs of 1, 2, … restarting at random, context runs (t = 0 or −1), and rows starting mid-run."""
    steps = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        t = int(torch.randint(-1, 6, (1,), generator=gen))  # a row may start mid-sequence, or in context
        for j in range(T):
            u = float(torch.rand(1, generator=gen))
            context = -int(u < 0.25)
            t = 1 if u < 0.2 else context if u < 0.3 else (t + 1 if t >= 1 else context if u < 0.5 else 1)
            steps[b, j] = t
    return steps


@pytest.mark.parametrize("seed", range(4))
def test_chunked_matches_reference_with_restarts(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    B, T = [(3, 11), (1, 1), (5, 7), (2, 13)][seed]
    steps = _random_steps(gen, B, T)
    case = make_case(gen, head="st", shape=(B, T), H=[5, 7, 3, 9][seed], V=[29, 2, 17, 41][seed], bias=seed % 2 == 0,
                     eps=[1e-3, 0.05, 0.5, 1e-6][seed], steps=steps.to(DEVICE), logit_scale=2.0)
    case.targets[(steps.to(DEVICE) <= 0) & (case.targets == case.eos_index)] = -100  # no eos in context
    tol = {"rtol": 1e-10, "atol": 1e-10}
    for reduction in ("none", "sum", "mean"):
        grad_out = torch.rand(B, T, generator=gen, dtype=torch.float64).to(DEVICE) if reduction == "none" else None
        fast = run(case, "chunked", torch.float64, reduction=reduction, chunk_size=int(3 + seed), grad_out=grad_out)
        truth = run(case, "reference", torch.float64, reduction=reduction, grad_out=grad_out)
        for f, t in zip(fast, truth):
            torch.testing.assert_close(f, t, **tol)


def test_gradcheck_with_restarts():
    gen = torch.Generator().manual_seed(5)
    steps = torch.tensor([[1, 2, 0, 1, 2, 3, 1], [4, 5, 1, 0, 0, 1, 2]])
    case = make_case(gen, head="st", shape=(2, 7), H=3, V=5, bias=True, eps=0.2, steps=steps)
    case.targets[(steps <= 0) & (case.targets.cpu() == case.eos_index)] = -100
    h, W, b = (t.clone().requires_grad_() for t in (case.hidden, case.weight, case.bias))
    for impl in ("reference", "chunked"):
        def f(h, W, b, impl=impl):
            return nmst_fast.linear_nmst_loss(h, W, case.targets.cpu(), eos_index=case.eos_index, eps=0.2, head="st",
                                              steps=steps, bias=b, impl=impl,
                                              chunk_size=None if impl == "reference" else 4)
        assert torch.autograd.gradcheck(f, (h, W, b))


def test_a_row_without_t_equal_1_sums_from_its_start():
    gen = torch.Generator().manual_seed(9)
    s = torch.randn(2, 6, generator=gen, dtype=torch.float64)
    eps = 0.01
    term = torch.nn.functional.logsigmoid(s) + torch.log1p(torch.tensor(-eps, dtype=torch.float64))
    from_five = torch.arange(5, 11).expand(2, 6)
    want = term.cumsum(-1)
    assert torch.equal(reference_log_survival(s, from_five, eps=eps, head="st"), want)
    assert torch.equal(head_math.log_survival("st", s.reshape(-1), from_five.reshape(-1), eps, 6).view(2, 6), want)
    # Context, then a sequence starting at t = 3: context adds nothing, the sum starts at t = 3.
    steps = torch.tensor([[0, 0, 3, 4, 5, 6]]).expand(2, 6)
    want = torch.where(steps >= 1, torch.where(steps >= 1, term, 0.0).cumsum(-1), 0.0)
    assert torch.equal(reference_log_survival(s, steps, eps=eps, head="st"), want)
    # A row that starts at t = 5 and restarts at 1 later on: the restart alone begins a new sum.
    steps = torch.tensor([[5, 6, 7, 1, 2, 3]]).expand(2, 6)
    want = torch.cat([term[:, :3].cumsum(-1), term[:, 3:].cumsum(-1)], dim=-1)
    torch.testing.assert_close(reference_log_survival(s, steps, eps=eps, head="st"), want, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("impl", IMPLS)
def test_st_loss_does_not_depend_on_where_a_row_without_restarts_starts(impl):
    """ST reads t only for context (t <= 0) and restarts (t = 1): steps 5, 6, … give the loss of 1, 2, …"""
    gen = torch.Generator().manual_seed(13)
    case = make_case(gen, head="st", shape=(2, 5), H=4, V=9, bias=False)
    dtype = torch.float32 if impl == "triton" else torch.float64
    default = run(case, impl, dtype, reduction="none", chunk_size=None if impl == "reference" else 3)
    case.steps = torch.arange(5, 10).expand(2, 5).to(DEVICE)
    shifted = run(case, impl, dtype, reduction="none", chunk_size=None if impl == "reference" else 3)
    for a, b in zip(default, shifted):
        torch.testing.assert_close(a, b, rtol=1e-6 if impl == "triton" else 1e-12,
                                   atol=1e-6 if impl == "triton" else 1e-12)
