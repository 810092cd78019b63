"""What the processor's tests compare against: an engine config without an engine, one request's
expected eos column step by step from the library's effective logits, and a watch for values read back."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Iterator, Optional

import torch

from nmst_fast.decoding import effective_logits

V, EOS = 40, 7


def engine_config(recorded=None, speculative=None, runner_v2: bool = False, logprobs_mode: str = "raw_logprobs"):
    """The parts of vLLM's ``VllmConfig`` the processor reads."""
    hf_config = SimpleNamespace(nmst=recorded, eos_token_id=EOS)
    model_config = SimpleNamespace(hf_config=hf_config, get_vocab_size=lambda: V, logprobs_mode=logprobs_mode)
    return SimpleNamespace(model_config=model_config, speculative_config=speculative, use_v2_model_runner=runner_v2)


class Reference:
    """One request's expected eos column, step by step, from the library's effective logits."""

    def __init__(self, params, head: str, eps: float):
        self.params, self.head, self.eps, self.output, self.state = params, head, eps, [], None

    def expected(self, row: torch.Tensor, t: Optional[int] = None) -> tuple[float, object]:
        """(T·ζ_eos, ST's state after the step) for ``row`` (V,) at step ``t`` (None: after the output)."""
        t = len(self.output) + 1 if t is None else t
        T = self.params.temperature if self.params.temperature >= 1e-5 else 1.0
        dist = effective_logits(row[None].double(), head=self.head, eos_index=EOS, eps=self.eps, steps=t,
                                state=self.state, temperature=T)
        non_eos = torch.cat([row[:EOS], row[EOS + 1:]]).double() / T
        zeta = min(float(dist.eos_zeta[0]), float(torch.logsumexp(non_eos, 0)) + 200.0)  # the processor's cap
        return T * zeta, dist.state


class HeadEosColumn:
    """An HF logits processor standing for the vLLM processor on greedy rows, for an HF model without a head:
    each row's eos entry becomes the head's effective eos logit ζ_eos of the scores it is handed (the library's
    float64 effective logits, held at L + 200 as the processor holds it), at t = 1 at the first generated
    token; a row whose eos another control set to −inf keeps it. Put after the processors standing for vLLM's
    controls that run before the head."""

    def __init__(self, prompt_length: int, *, eos: int, eps: float, head: str = "nmst"):
        self.prompt_length, self.eos, self.eps, self.head = prompt_length, eos, eps, head

    def __call__(self, input_ids, scores):
        t = input_ids.shape[1] - self.prompt_length + 1
        row = scores.double()
        dist = effective_logits(row, head=self.head, eos_index=self.eos, eps=self.eps, steps=t)
        non_eos = torch.cat([row[:, :self.eos], row[:, self.eos + 1:]], dim=1)
        column = torch.minimum(dist.eos_zeta, torch.logsumexp(non_eos, dim=1) + 200.0)
        row[:, self.eos] = torch.where(row[:, self.eos] == float("-inf"), row[:, self.eos], column)
        return row.float()  # vLLM's processor writes float32 logits


# Ops that read a tensor's values on the host: a device-to-host sync on a GPU.
READ_OPS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "_unique2", "unique_dim",
            "unique_consecutive"}


@contextlib.contextmanager
def no_values_read() -> Iterator[list]:
    """Within: ``Tensor.tolist`` / ``numpy`` raise, and every op of READ_OPS is recorded in the list
    yielded (a test asserts it stays empty)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads: list[str] = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in READ_OPS:
                reads.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def refused(*args, **kwargs):
        raise AssertionError("a tensor's values were read back")

    tolist, numpy = torch.Tensor.tolist, torch.Tensor.numpy
    torch.Tensor.tolist, torch.Tensor.numpy = refused, refused
    try:
        with Reads():
            yield reads
    finally:
        torch.Tensor.tolist, torch.Tensor.numpy = tolist, numpy


def row_path(kernel: bool, monkeypatch) -> list:
    """Send the processor's CPU work through the CPU row kernels (``kernel``; they must have built) or
    through torch ops and Python floats (the kernels off). The list returned records each kernel op
    called, by name."""
    from nmst_fast.decoding import eos_column

    calls: list[str] = []
    if not kernel:
        monkeypatch.setattr(eos_column, "row_kernels", lambda: None)
        return calls
    kernels = eos_column.row_kernels()
    assert kernels is not None, "the CPU row kernels did not build (see the warning logged)"

    class Recorded:
        def __getattr__(self, name):
            op = getattr(kernels, name)

            def call(*args):
                calls.append(name)
                return op(*args)
            return call

    monkeypatch.setattr(eos_column, "row_kernels", lambda: Recorded())
    return calls
