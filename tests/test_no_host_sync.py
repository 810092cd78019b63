"""The kernel path decodes without host synchronization: a deferred ``DecodingStep`` call reads
nothing back from the device (its flags stay there until :meth:`DecodingStep.check`), and
``generate`` reads back as much for 12 steps as for 6.

A read is counted where the library needs a tensor's values on the host: the aten ops that return
them (``item``, ``bool``, ``nonzero``, …) on a tensor off the host's memory (every tensor on a CPU
machine, where host and device are one), and ``Tensor.tolist`` / ``Tensor.numpy`` called from
``nmst_fast``. On a GPU, torch's sync debug mode counts every synchronization as well.

A deferred call captured after an eager one replays correctly: it draws afresh each time and its
replays' flags add up (a real CUDA graph on a GPU; on the CPU the call's kernel launches issued again
with the same arguments, which is what a replay does)."""

from __future__ import annotations

import contextlib
import sys
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nmst_fast.generation as generation
from nmst_fast.decoding import DecodingStep
from nmst_fast.generation import generate

from helpers import DEVICE
from test_generation import TinyRNN, _contexts

# aten ops whose result depends on a tensor's values on the host: a device-to-host sync on a GPU.
_READ_OPS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "_unique2", "unique_dim",
             "unique_consecutive"}


class _ValueReads(TorchDispatchMode):
    def __init__(self, reads: list[str]):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _READ_OPS and any(isinstance(a, torch.Tensor) and (a.device.type != "cpu" or DEVICE == "cpu")
                                     for a in tree_leaves((args, kwargs))):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_reads():
    """The reads (op names) made inside the block; on a GPU also every synchronization (as "sync")."""
    reads: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def recording(name):
        def method(self, *args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("nmst_fast"):
                reads.append(name)
            return originals[name](self, *args, **kwargs)
        return method

    with contextlib.ExitStack() as stack:
        for name in originals:
            setattr(torch.Tensor, name, recording(name))
            stack.callback(setattr, torch.Tensor, name, originals[name])
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            caught = stack.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            stack.callback(torch.cuda.set_sync_debug_mode, "default")
        stack.enter_context(_ValueReads(reads))
        yield reads
    if DEVICE == "cuda":
        reads.extend("sync" for w in caught if "synchroniz" in str(w.message))


@pytest.mark.parametrize("head,top_k,top_p", [
    ("st", 1, None), ("nmst", None, None), ("st", 5, None), ("nmst", 5, 0.8), ("st", None, 0.9), ("va", 3, None)])
def test_a_deferred_step_reads_nothing_back(head, top_k, top_p):
    """Three chained steps (ST's state, per-row steps) with the flags deferred: no read. Then the
    check reads the logged flags once, and a step that reads its flags at once reads once: the count
    sees a read where there is one."""
    V, B = 300, 3
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    z = torch.randn(3, B, V, generator=gen, device=DEVICE) * 2
    step = DecodingStep(head=head, eos_index=7, vocab_size=V, device=DEVICE, eps=0.05, top_k=top_k, top_p=top_p,
                        impl="triton")
    with host_reads() as reads:
        state = None
        for t in range(3):
            steps = t + 1 if t % 2 else torch.full((B,), t + 1, device=DEVICE)
            state = step(z[t], steps=steps, state=state, generator=gen, defer_checks=True).state
    assert reads == []
    with host_reads() as reads:
        step.check()
    assert reads[:1] == ["tolist"] and set(reads) <= {"tolist", "sync"}
    with host_reads() as reads:
        step(z[0], steps=1, generator=gen)
    assert reads[:1] == ["tolist"] and set(reads) <= {"tolist", "sync"}


@pytest.mark.parametrize("strategy,kwargs", [("greedy", {}), ("top_k", dict(top_k=4)), ("nucleus", dict(top_p=0.9))])
def test_generate_reads_back_as_much_for_any_length(monkeypatch, strategy, kwargs):
    """The kernel path's loop reads nothing per step: 12 steps read as much as 6 (the end's flags and
    lengths). Here the host never learns of finished rows (as a GPU's host may not, for a while), so
    no row leaves the batch early on the CPU either."""
    model = TinyRNN(head="nmst", eps=1e-4, seed=4, eos_bias=-20.0).to(DEVICE)  # p(eos) ~ 1e-9: no row ends
    contexts = _contexts(B=4, seed=5).to(DEVICE)
    monkeypatch.setattr(generation, "HOST_LAG", 10**9)
    counts = []
    for length in (6, 12):
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        with host_reads() as reads:
            out = generate(model, contexts, strategy=strategy, max_length=length, generator=gen, impl="triton",
                           **kwargs)
        assert int(out.lengths.min()) == length
        counts.append(sorted(reads))
    assert counts[0] == counts[1], counts
    # The end's reads: the kernels' flags (DecodingStep.check) and the longest length (the output's
    # width); on a GPU each also counts its synchronization.
    assert {"tolist", "_local_scalar_dense"} <= set(counts[0]), counts
    if DEVICE == "cpu":
        assert counts[0] == ["_local_scalar_dense", "tolist"]


def _captured(monkeypatch, step, z, **kwargs):
    """One deferred call of ``step`` on the static input ``z``, captured: (its output, a replay). On a
    GPU a CUDA graph; on the CPU its kernel launches recorded and issued again with the same
    arguments, which is what a graph's replay does."""
    if DEVICE == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(z, defer_checks=True, **kwargs)
        return out, graph.replay
    from nmst_fast.kernels import row_draw, scan_select

    launches = []

    class Recording:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **meta):
                launches.append((self.kernel, grid, args, meta))
                self.kernel[grid](*args, **meta)
            return launch

    for module, name in ((scan_select, "_scan_select_kernel"), (row_draw, "_row_draw_kernel")):
        monkeypatch.setattr(module, name, Recording(getattr(module, name)))
    out = step(z, defer_checks=True, **kwargs)
    monkeypatch.undo()
    assert len(launches) == 1

    def replay():
        for kernel, grid, args, meta in launches:
            kernel[grid](*args, **meta)
    return out, replay


@pytest.mark.parametrize("top_k,top_p", [(1, None), (None, None), (3, None), (None, 0.5)])
def test_a_captured_step_draws_afresh_and_collects_its_flags(monkeypatch, top_k, top_p):
    """A deferred call captured after an eager one (as CUDA graphs ask): each replay draws anew (the
    launches advance the RNG state on the device), and a replay's bad row stays flagged through the
    clean replays after it, until the check raises for it and clears the flags."""
    B, V = 48, 40
    z = torch.zeros(B, V, device=DEVICE)  # flat rows, eos (column 0) unlikely: each draw is one of many tokens
    z[:, 0] = -30.0
    step = DecodingStep(head="nmst", eos_index=0, vocab_size=V, device=DEVICE, eps=0.01, top_k=top_k, top_p=top_p,
                        impl="triton")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    step(z, steps=3, generator=gen, defer_checks=True)  # the eager call: the RNG state and the flags exist
    out, replay = _captured(monkeypatch, step, z, steps=3, generator=gen)
    draws = []
    for _ in range(6):
        replay()
        draws.append(out.tokens.clone())
    if top_k == 1:
        assert all(torch.equal(d, draws[0]) for d in draws)
    else:
        assert len({tuple(d.tolist()) for d in draws}) == len(draws)  # 48 rows drawn alike twice: ~1e-60
        assert step._rng[1:].tolist() == [len(draws) + 2, 0]  # calls: eager + captured + replays; count at rest
    step.check()  # clean so far
    z[5, 7] = float("nan")
    replay()
    z[5, 7] = 0.0
    replay()
    with pytest.raises(ValueError, match="row 5 "):
        step.check()
    step.check()  # cleared
