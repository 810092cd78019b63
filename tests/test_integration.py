"""torch.compile, the NMSTHead module, and the bounded-memory guarantee of the chunked path."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nmst_fast
from nmst_fast.fused import HeadConfig, fused_backward_from_lse, fused_forward
from nmst_fast.settings import HeadSettings

from helpers import DEVICE, LargestTensor


def test_torch_compile_traces_without_graph_breaks():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 6, 8, generator=gen, requires_grad=True)
    W = torch.randn(40, 8, generator=gen, requires_grad=True)
    y = torch.randint(0, 40, (2, 6), generator=gen)

    def step(h, W, y):
        return nmst_fast.linear_nmst_loss(torch.tanh(h), W, y, eos_index=3, head="st", impl="chunked") * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # fullgraph: a break is an error
    got = compiled(h, W, y)
    expected = step(h, W, y)
    torch.testing.assert_close(got, expected)
    for a, b in zip(torch.autograd.grad(got, (h, W)), torch.autograd.grad(expected, (h, W))):
        torch.testing.assert_close(a, b)


def test_torch_compile_reduction_none():
    h = torch.randn(3, 5, 8, requires_grad=True)
    W = torch.randn(20, 8, requires_grad=True)
    y = torch.randint(0, 20, (3, 5))

    def per_token(h, W, y):
        return nmst_fast.linear_nmst_loss(h, W, y, eos_index=0, reduction="none", impl="chunked").pow(2).sum()

    got = torch.compile(per_token, fullgraph=True, backend="aot_eager")(h, W, y)
    torch.testing.assert_close(got, per_token(h, W, y))


def test_nmst_head_module_tied_weight():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(30, 8)
    head = nmst_fast.NMSTHead(8, 30, eos_index=29, head="nmst", eps=1e-3, weight=emb.weight, impl="chunked")
    assert head.weight is emb.weight
    tokens = torch.randint(0, 30, (2, 7))
    h = torch.tanh(emb(tokens))
    loss = head.loss(h, tokens)
    ref = nmst_fast.linear_nmst_loss(h, emb.weight, tokens, eos_index=29, eps=1e-3, impl="reference")
    torch.testing.assert_close(loss, ref)
    loss.backward()
    assert emb.weight.grad is not None and emb.weight.grad.abs().sum() > 0
    logp = head.log_probs(h.detach())
    assert logp.shape == (2, 7, 30)
    torch.testing.assert_close(logp, nmst_fast.nmst_log_probs(head(h.detach()), eos_index=29, eps=1e-3))
    assert "eps=0.001" in repr(head)


def test_a_tied_bf16_weight_gets_a_bf16_bias_and_meta_heads_initialize():
    """The bias was fp32 on the CPU whatever the tied weight was: a bf16 embedding's head could not
    compute its loss. And a head built on the meta device had no reset_parameters for to_empty."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(7, 4, dtype=torch.bfloat16)
    head = nmst_fast.NMSTHead(4, 7, eos_index=2, weight=emb.weight, bias=True, impl="chunked")
    assert head.bias.dtype == torch.bfloat16 and head.bias.device == emb.weight.device
    h, y = torch.randn(2, 3, 4, dtype=torch.bfloat16), torch.randint(0, 7, (2, 3))
    assert head.loss(h, y).dtype == torch.bfloat16 and head(h).dtype == torch.bfloat16
    assert head.log_probs(h).shape == (2, 3, 7)
    before = emb.weight.detach().clone()
    head.reset_parameters()  # a tied weight belongs to its owner: left alone
    assert torch.equal(emb.weight, before) and not head.bias.any()
    with torch.device("meta"):
        lazy = nmst_fast.NMSTHead(16, 9, eos_index=0, bias=True)
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()
    assert torch.isfinite(lazy.weight).all() and 0.1 < float(lazy.weight.std()) < 0.5 and not lazy.bias.any()


def test_nmst_head_with_bias_and_flat_steps():
    head = nmst_fast.NMSTHead(6, 12, eos_index=0, head="va", bias=True, impl="chunked")
    h, y = torch.randn(9, 6), torch.randint(0, 12, (9,))
    torch.testing.assert_close(head.loss(h, y), torch.nn.functional.cross_entropy(head(h), y))


def test_chunked_driver_never_allocates_n_by_v():
    N, H, V, chunk = 600, 16, 500, 64
    h, W, b = torch.randn(N, H), torch.randn(V, H), torch.randn(V)
    y, steps = torch.randint(0, V, (N,)), torch.randint(1, 50, (N,))
    for head in ("nmst", "st", "va"):
        cfg = HeadConfig(HeadSettings(head, 1e-3, 7), -100, seq_len=N // 10)
        with LargestTensor() as mode:
            _, lse, *_ = fused_forward(h, W, b, y, steps, cfg, reduction="mean", backend="chunked",
                                       chunk_rows=chunk, need=(True, True, True))
            fused_backward_from_lse(torch.ones(N), h, W, b, y, steps, lse, cfg, backend="chunked",
                                    chunk_rows=chunk, need=(True, True, True))
        assert mode.largest <= max(chunk * V, V * H), f"{head}: a tensor of {mode.largest} elements"


def test_public_call_peak_memory_is_bounded():
    """End to end in a fresh process: N×V logits would be 1 GB; the fused step stays far below."""
    script = textwrap.dedent("""
        import json, torch, nmst_fast
        from benchmarks import memory
        N, H, V = 8192, 32, 32768
        small = torch.randn(64, H, requires_grad=True)
        nmst_fast.linear_nmst_loss(small, torch.randn(V, H), torch.zeros(64, dtype=torch.long),
                                   eos_index=1, steps=torch.ones(64, dtype=torch.long), impl="chunked").backward()
        h = torch.randn(N, H, requires_grad=True); W = torch.randn(V, H, requires_grad=True)
        y = torch.randint(0, V, (N,)); steps = torch.arange(N) + 1
        base = memory.rss_bytes()
        memory.reset_peak()
        loss = nmst_fast.linear_nmst_loss(h, W, y, eos_index=5, steps=steps, impl="chunked", chunk_size=256)
        loss.backward()
        print(json.dumps({"extra": memory.peak_bytes() - base, "nv": N * V * 4}))
    """)
    repo = str(pathlib.Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=repo)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # Budget: one 256-row chunk (32 MiB) + grads (~5 MiB) + O(N) vectors + allocator slack.
    assert result["extra"] < 0.1 * result["nv"], result


def test_huge_finite_inputs_are_not_mistaken_for_inf():
    """The NaN/inf screen is a sum, which can overflow on finite values: those inputs still pass."""
    h, W, y = torch.randn(2, 4, 8), torch.randn(11, 8), torch.randint(0, 11, (2, 4))
    loss = nmst_fast.linear_nmst_loss(h, W, y, eos_index=10, bias=torch.full((11,), 3e38), impl="chunked")
    assert loss.shape == ()  # no ValueError (the loss itself may be inf or NaN: that is the data)


def test_profile_validation_cost_runs():
    """The GPU profile's validation-cost part (run on CPU here at a tiny shape, chunked backend)."""
    import torch

    from benchmarks.cases import Shape, make_inputs
    from benchmarks.profile_loss import validation_cost

    times = validation_cost(make_inputs(Shape(64, 32, 300, torch.float32, "cpu")), rounds=1)
    assert set(times) == {"three GEMMs", "nmst, validate=True (default)", "nmst, validate=False"}
    assert all(ms > 0 for ms in times.values())


def test_torch_compile_triton_backend_bf16():
    """The Triton backend under torch.compile, bf16: backward's one-pass scale + cast of the fp32
    dW accumulator is an op too, so the whole step traces without a break."""
    gen = torch.Generator().manual_seed(1)
    # On a GPU machine the kernels are compiled, not interpreted: they need CUDA tensors.
    h = torch.randn(2, 5, 8, generator=gen).bfloat16().to(DEVICE).requires_grad_()
    W = torch.randn(37, 8, generator=gen).bfloat16().to(DEVICE).requires_grad_()
    b = torch.randn(37, generator=gen).bfloat16().to(DEVICE).requires_grad_()
    y = torch.randint(0, 37, (2, 5), generator=gen).to(DEVICE)

    def step(h, W, b, y):
        return nmst_fast.linear_nmst_loss(h, W, y, bias=b, eos_index=3, head="nmst", impl="triton") * 3

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(h, W, b, y)
    expected = step(h, W, b, y)
    torch.testing.assert_close(got, expected)
    for a, e in zip(torch.autograd.grad(got, (h, W, b)), torch.autograd.grad(expected, (h, W, b))):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, e)


class _OpLog(TorchDispatchMode):
    """Records the name of every aten op, in issue order."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_first_chunk_gemm_is_issued_before_the_head_math():
    """The forward issues the first chunk's logits GEMM before the O(N) head math (the eos GEMV
    and the scalar kernels), so on a GPU those small kernels queue behind the big one instead of
    delaying it after the validation sync."""
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(18, 8, generator=gen)
    W = torch.randn(50, 8, generator=gen)
    y = torch.randint(0, 50, (18,), generator=gen)
    steps = torch.arange(1, 10).repeat(2)
    log = _OpLog()  # the public op is opaque to dispatch modes: log the driver it runs
    with log:
        fused_forward(h, W, None, y, steps, HeadConfig(HeadSettings("st", 1e-3, 7), -100, 9), reduction="mean",
                      backend="chunked", chunk_rows=5, need=(True, True, False))
    first_gemm = next(i for i, op in enumerate(log.ops) if op.startswith(("mm", "addmm")))
    assert "mv.default" in log.ops and first_gemm < log.ops.index("mv.default"), log.ops[:first_gemm + 3]


def test_loss_report_varies_its_case_order():
    """benchmarks.report times each case once per round, in an order drawn per round (repeatably),
    so over the GPU report's 10 rounds no case always follows the same one, and keeps every case's
    times in round order."""
    from benchmarks.cases import Shape
    from benchmarks.report import measure_times, round_order

    names = ["floor", "nmst", "st", "va", "chunked", "naive", "ce"]
    orders = [round_order(names, r) for r in range(10)]
    assert orders == [round_order(names, r) for r in range(10)]
    assert all(sorted(order) == sorted(names) for order in orders)
    for name in names:
        before = {order[order.index(name) - 1] for order in orders if order[0] != name}
        assert len(before) >= 3, (name, before)
    assert len({order[0] for order in orders}) >= 4
    # Cut Cross-Entropy's torch.compile case is left out: its two compilations took about 40 s of this test, and
    # the benchmark suite (benchmarks/test_bench_loss.py) runs it
    times = measure_times(Shape(64, 32, 300, torch.float32, "cpu"), rounds=2, skip=("torch_compile",))
    assert "Cut Cross-Entropy (va, torch_compile)" not in times
    assert all(len(ts) == 2 and all(t > 0 for t in ts) for ts in times.values())


def test_host_overhead_stub_leaves_an_unset_interpreter_flag_unset(monkeypatch):
    """On a CUDA machine TRITON_INTERPRET is unset and must stay so after the stubbed timing (the
    first H100 run of benchmarks.host_overhead raised KeyError restoring it)."""
    from benchmarks.host_overhead import kernels_stubbed

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with kernels_stubbed():
        assert "TRITON_INTERPRET" not in os.environ
    assert "TRITON_INTERPRET" not in os.environ
