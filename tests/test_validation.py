"""Bad input gets a clear error naming the argument: structural errors before any kernel runs; bad values (targets
out of range, negative NMST steps, NaN / inf in hidden, weight or bias) from the fused loss's own pass, one verdict
taken after it and before anything it computed is returned (no separate scan of the weight), in every backend."""

import pytest
import torch

import nmst_fast
import nmst_fast.ops


@pytest.fixture
def no_kernel_may_run(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel ran before the input was rejected")

    monkeypatch.setattr(nmst_fast.ops, "fused_forward", forbidden)


@pytest.fixture(params=["cpu_kernels", "torch_ops", "triton"])
def impl(request, monkeypatch):
    """The fused backends: the C++ row kernels, torch's row ops (where those cannot build), Triton's (interpreter)."""
    if request.param == "torch_ops":
        monkeypatch.setattr("nmst_fast.fused.row_kernels", lambda: None)
    return "triton" if request.param == "triton" else "chunked"


def _args(**over):
    B, T, H, V = 2, 4, 8, 11
    args = dict(hidden=torch.randn(B, T, H), weight=torch.randn(V, H), targets=torch.randint(0, V, (B, T)),
                eos_index=V - 1)
    args.update(over)
    return args


def _call(**over):
    kw = _args(**over)
    return nmst_fast.linear_nmst_loss(kw.pop("hidden"), kw.pop("weight"), kw.pop("targets"), impl="chunked", **kw)


@pytest.mark.parametrize(
    "over,exc,name",
    [
        (dict(eps=0.0), ValueError, "eps"),
        (dict(eps=1.0), ValueError, "eps"),
        (dict(eps=-0.1), ValueError, "eps"),
        (dict(eps="0.1"), TypeError, "eps"),
        (dict(eos_index=11), ValueError, "eos_index"),
        (dict(eos_index=-1), ValueError, "eos_index"),
        (dict(eos_index=1.0), TypeError, "eos_index"),
        (dict(head="nmts"), ValueError, "head"),
        (dict(reduction="avg"), ValueError, "reduction"),
        (dict(hidden=torch.randn(2, 5, 8)), ValueError, "targets"),
        (dict(weight=torch.randn(11, 7)), ValueError, "weight"),
        (dict(weight=torch.randn(11, 8, dtype=torch.float64)), TypeError, "weight"),
        (dict(bias=torch.randn(12)), ValueError, "bias"),
        (dict(bias=torch.randn(11, dtype=torch.float64)), TypeError, "bias"),
        (dict(targets=torch.rand(2, 4)), TypeError, "targets"),
        (dict(hidden=torch.randint(0, 3, (2, 4, 8))), TypeError, "hidden"),
        (dict(steps=torch.rand(2, 4)), TypeError, "steps"),
        (dict(steps=torch.ones(3, 4, dtype=torch.long)), ValueError, "steps"),
        (dict(weight=torch.randn(1, 8), eos_index=0, targets=torch.zeros(2, 4, dtype=torch.long)), ValueError, "V"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
    ],
)
def test_structural_errors(no_kernel_may_run, over, exc, name):
    with pytest.raises(exc, match=name):
        _call(**over)


def test_unknown_impl(no_kernel_may_run):
    with pytest.raises(ValueError, match="impl"):
        kw = _args()
        nmst_fast.linear_nmst_loss(kw.pop("hidden"), kw.pop("weight"), kw.pop("targets"), impl="cuda", **kw)


def test_st_needs_sequences_and_flat_nmst_needs_steps(no_kernel_may_run):
    h, W, y = torch.randn(6, 8), torch.randn(11, 8), torch.randint(0, 11, (6,))
    with pytest.raises(ValueError, match="st"):
        nmst_fast.linear_nmst_loss(h, W, y, eos_index=0, head="st")
    with pytest.raises(ValueError, match="steps"):
        nmst_fast.linear_nmst_loss(h, W, y, eos_index=0, head="nmst")


def _value_call(impl, reduction="mean", **over):
    """The loss with gradients wanted, through ``impl``: the error must come before any of them reaches a tensor."""
    kw = _args(**over)
    hidden, weight = kw.pop("hidden").requires_grad_(), kw.pop("weight").requires_grad_()
    try:
        nmst_fast.linear_nmst_loss(hidden, weight, kw.pop("targets"), impl=impl, reduction=reduction,
                                   **kw).sum().backward()
    finally:
        assert hidden.grad is None and weight.grad is None


@pytest.mark.parametrize("bad", [11, -5, 100])
def test_target_out_of_range(impl, bad):
    y = torch.randint(0, 11, (2, 4))
    y[1, 2] = bad
    with pytest.raises(ValueError, match="targets"):
        _value_call(impl, targets=y)


def test_negative_steps_for_nmst(impl):
    steps = torch.tensor([[1, 2, 3, 4], [0, -1, 1, 2]])
    with pytest.raises(ValueError, match="steps"):
        _value_call(impl, steps=steps, reduction="none")


# the Triton interpreter computes in numpy, which warns on x − x of an infinite x: the pass's own flag
NON_FINITE_WARNINGS = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@NON_FINITE_WARNINGS
@pytest.mark.parametrize("which", ["hidden", "weight", "bias"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["a non-eos entry", "eos's row", "an ignored position"])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_non_finite_inputs(impl, which, value, where, softcap):
    """Found by the row pass whichever entry holds it, under a softcap too (c·tanh(inf / c) = c is finite: the pass
    looks at the logits before the cap), then named by a scan of the three inputs."""
    kw = _args(bias=torch.randn(11), softcap=softcap)
    kw[which] = kw[which].clone()
    if where == "eos's row" and which != "hidden":
        kw[which].view(11, -1)[10, 0] = value  # eos_index is V - 1 = 10
    elif where == "an ignored position":
        kw["targets"][1, 3] = -100
        if which == "hidden":
            kw[which][1, 3, 2] = value
        else:
            kw[which].view(11, -1)[3, 0] = value
    else:
        kw[which].view(-1)[3] = value
    with pytest.raises(ValueError, match=f"{which} contains NaN or inf"):
        _value_call(impl, **kw)


@NON_FINITE_WARNINGS
def test_inf_among_huge_finite_values_is_found(impl):
    kw = _args(bias=torch.full((11,), 3e38))  # logits overflow on these alone
    kw["bias"][4] = -float("inf")
    with pytest.raises(ValueError, match="bias"):
        _value_call(impl, **kw)


@NON_FINITE_WARNINGS
def test_logits_that_overflow_from_finite_inputs_are_refused(impl):
    """Finite inputs whose logits overflow their dtype would give an inf or NaN loss."""
    kw = _args(hidden=torch.full((2, 4, 8), 1e20), weight=torch.full((11, 8), 1e20))
    with pytest.raises(ValueError, match="overflow"):
        _value_call(impl, **kw)


def test_device_mismatch(no_kernel_may_run):
    with pytest.raises(ValueError, match="weight"):
        _call(weight=torch.randn(11, 8, device="meta"))


def test_triton_on_cpu_needs_interpreter(no_kernel_may_run, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CPU tensors: only the interpreter can run them
    kw = _args()
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        nmst_fast.linear_nmst_loss(kw.pop("hidden"), kw.pop("weight"), kw.pop("targets"), impl="triton", **kw)


def test_log_probs_validates():
    with pytest.raises(ValueError, match="eos_index"):
        nmst_fast.nmst_log_probs(torch.randn(3, 5), eos_index=5, head="va")
    with pytest.raises(ValueError, match="eps"):
        nmst_fast.nmst_log_probs(torch.randn(2, 3, 5), eos_index=0, eps=2.0)
    with pytest.raises(ValueError, match="head"):
        nmst_fast.nmst_log_probs(torch.randn(2, 3, 5), eos_index=0, head="x")


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(hidden_size=0), ValueError, "hidden_size"), (dict(hidden_size=-1), ValueError, "hidden_size"),
    (dict(hidden_size=4.0), TypeError, "hidden_size"), (dict(vocab_size=1), ValueError, "vocab_size"),
    (dict(vocab_size=True), TypeError, "vocab_size"),
    (dict(weight=torch.randn(10, 4)), TypeError, "weight"),  # a plain tensor: never trained nor saved
])
def test_head_constructor_checks_its_arguments(kwargs, exc, name):
    args = dict(hidden_size=4, vocab_size=10) | kwargs
    with pytest.raises(exc, match=name):
        nmst_fast.NMSTHead(args.pop("hidden_size"), args.pop("vocab_size"), eos_index=0, **args)
