"""Benchmark cases shared by the pytest-benchmark suite and the report script.

Every case is one training step of the output layer: forward + backward of the
loss w.r.t. hidden states and weight, on the same inputs. The floor is the three
GEMMs no exact method can avoid: z = h·Wᵀ, dh = dz·W, dW = dzᵀ·h. On a GPU a second floor runs
them at V padded to a multiple of 64 (an odd V breaks the tensor cores' alignment of the (N, V)
logits), and the fused VA losses of Liger-Kernel and Cut Cross-Entropy run on the same inputs when
they are installed (``benchmarks/fetch_gpu_wheels.sh`` carries them to a GPU machine); on CPU, Cut
Cross-Entropy's torch.compile implementation. A case function with ``compiles = True`` compiles on its
first call at a shape, which the report runs untimed.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import nmst_fast


@dataclass(frozen=True)
class Shape:
    N: int
    H: int
    V: int
    dtype: torch.dtype
    device: str

    def label(self) -> str:
        return f"{self.N}x{self.H}x{self.V} {str(self.dtype).removeprefix('torch.')} {self.device}"


CPU_DEFAULT = Shape(4096, 768, 50257, torch.float32, "cpu")  # GPT-2 vocabulary, one 4k-token batch
CPU_SMALL = Shape(512, 256, 8192, torch.float32, "cpu")  # quick runs and CI smoke
# Gemma-2-2B's width and vocabulary (CCE's headline shape) at a quarter of its 8192 tokens: a step of the floor
# takes 20-60 s on 2 cores, so a report's rounds still fit in half an hour.
CPU_LARGE = Shape(2048, 2304, 256000, torch.float32, "cpu")
GPU_SHAPES = (
    Shape(8192, 2304, 256000, torch.bfloat16, "cuda"),  # Gemma-2-2B-like vocabulary (CCE's headline shape)
    Shape(16384, 768, 50257, torch.bfloat16, "cuda"),
)


@dataclass
class Inputs:
    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    steps: torch.Tensor
    eos_index: int
    cache: dict = field(default_factory=dict)  # tensors a case derives from these once (the padded weight)


PAD_MULTIPLE = 64  # the padded floor's vocabulary: V rounded up to this (GPT-2 trainers use 50304)


def padded_vocab(V: int) -> int:
    return -(-V // PAD_MULTIPLE) * PAD_MULTIPLE


def make_inputs(shape: Shape, seed: int = 0) -> Inputs:
    """Inputs built in place (no transient copies), so RSS right after is a fair memory baseline."""
    gen = torch.Generator(device=shape.device).manual_seed(seed)
    hidden = torch.empty(shape.N, shape.H, dtype=shape.dtype, device=shape.device)
    hidden.normal_(generator=gen)
    weight = torch.empty(shape.V, shape.H, dtype=shape.dtype, device=shape.device)
    weight.normal_(std=shape.H**-0.5, generator=gen)
    targets = torch.randint(0, shape.V, (shape.N,), device=shape.device, generator=gen)
    steps = torch.arange(1, shape.N + 1, device=shape.device) % 1000 + 1
    return Inputs(hidden.requires_grad_(), weight.requires_grad_(), targets, steps, eos_index=shape.V - 1)


def _clear(x: Inputs) -> None:
    x.hidden.grad = None
    x.weight.grad = None


def three_gemms(x: Inputs) -> None:
    h, w = x.hidden.detach(), x.weight.detach()
    z = h @ w.t()
    # Store the products as the leaves' gradients: they stay alive like a real backward's would.
    x.hidden.grad = z @ w
    x.weight.grad = z.t() @ h


def three_gemms_padded(x: Inputs) -> None:
    """The floor at V padded with zero rows of W to a multiple of PAD_MULTIPLE (built once per inputs,
    so its extra memory includes that padded copy of W: a trainer that pads holds it as its weight)."""
    V, H = x.weight.shape
    w = x.cache.get("padded_weight")
    if w is None:
        w = x.cache["padded_weight"] = x.weight.new_zeros(padded_vocab(V), H)
        w[:V] = x.weight.detach()
    h = x.hidden.detach()
    z = h @ w.t()
    x.hidden.grad = z @ w
    x.weight.grad = (z.t() @ h)[:V]


def fused(head: str, impl: str, dw_dtype: Optional[torch.dtype] = None,
          grad_filter: Optional[str] = None) -> Callable[[Inputs], None]:
    def step(x: Inputs) -> None:
        _clear(x)
        loss = nmst_fast.linear_nmst_loss(
            x.hidden, x.weight, x.targets, eos_index=x.eos_index, head=head,
            steps=None if head == "va" else x.steps, impl=impl, dw_dtype=dw_dtype, grad_filter=grad_filter,
        )
        loss.backward()

    return step


def fused_st(impl: str) -> Callable[[Inputs], None]:
    """ST needs the (B, T) layout: the same rows as 4 sequences."""

    def step(x: Inputs) -> None:
        _clear(x)
        B = 4
        loss = nmst_fast.linear_nmst_loss(
            x.hidden.view(B, -1, x.hidden.shape[-1]), x.weight, x.targets.view(B, -1),
            eos_index=x.eos_index, head="st", impl=impl,
        )
        loss.backward()

    return step


def naive_nmst(x: Inputs) -> None:
    """What a user writes today: materialize logits, NMST log-probs, gather, autograd."""
    _clear(x)
    loss = nmst_fast.linear_nmst_loss(x.hidden, x.weight, x.targets, eos_index=x.eos_index, head="nmst",
                                      steps=x.steps, impl="reference", validate=False)
    loss.backward()


def naive_ce(x: Inputs) -> None:
    _clear(x)
    F.cross_entropy(x.hidden @ x.weight.t(), x.targets).backward()


def torch_linear_ce(x: Inputs) -> None:
    """torch's own fused VA loss in its chunked mode (``options=None`` would materialize logits)."""
    _clear(x)
    F.linear_cross_entropy(x.hidden, x.weight, x.targets, options=torch.nn.LinearCrossEntropyOptions()).backward()


def liger_linear_ce(accum_dtype: Optional[torch.dtype] = None) -> Callable[[Inputs], None]:
    """Liger-Kernel's fused linear cross-entropy (VA) through its functional API: by default dW summed
    in the weight's dtype (bf16 here, as our ``dw_dtype=torch.bfloat16``); ``accum_dtype=torch.float32``
    as our default."""

    def step(x: Inputs) -> None:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        _clear(x)
        liger_fused_linear_cross_entropy(x.hidden, x.weight, x.targets, accum_dtype=accum_dtype).backward()

    return step


def cut_linear_ce(filter_eps: Optional[str] = "high", impl: str = "cce") -> Callable[[Inputs], None]:
    """Cut Cross-Entropy's ``linear_cross_entropy`` (VA): by default as its users get it, with the
    gradient filter (entries below bf16's resolution skipped); ``filter_eps=None``: exact.
    ``impl="torch_compile"``: its torch fallback (the CPU tests' stand-in for the Triton kernels)."""

    def step(x: Inputs) -> None:
        from cut_cross_entropy import linear_cross_entropy

        _clear(x)
        linear_cross_entropy(x.hidden, x.weight, x.targets, filter_eps=filter_eps, impl=impl).backward()

    return step


def cut_linear_ce_compiled(x: Inputs) -> None:
    """Cut Cross-Entropy's torch.compile implementation (VA): the one that runs on CPU (its first call compiles,
    about 20 s; the report leaves that call out)."""
    cut_linear_ce(None, impl="torch_compile")(x)


cut_linear_ce_compiled.compiles = True


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def cases_for(device: str) -> dict[str, Callable[[Inputs], None]]:
    """The report's cases, the floor first; on a GPU also the padded floor, bf16 dW, and Liger's and
    Cut Cross-Entropy's losses when installed; on CPU Cut Cross-Entropy's torch.compile implementation when
    installed."""
    impl = "triton" if device == "cuda" else "chunked"
    gpu = device == "cuda"
    return {
        "three GEMMs (floor)": three_gemms,
        **({f"three GEMMs, V padded to {PAD_MULTIPLE}": three_gemms_padded} if gpu else {}),
        f"nmst {impl}": fused("nmst", impl),
        f"st {impl}": fused_st(impl),
        f"va {impl}": fused("va", impl),
        **({f"nmst {impl}, bf16 dW": fused("nmst", impl, dw_dtype=torch.bfloat16)} if gpu else {}),
        **({f"nmst {impl}, grad_filter auto": fused("nmst", impl, grad_filter="auto")} if gpu else {}),
        **({"nmst chunked (torch row ops)": fused("nmst", "chunked")} if gpu else {}),
        "naive nmst (torch)": naive_nmst,
        "F.cross_entropy (logits)": naive_ce,
        **({"F.linear_cross_entropy (chunked)": torch_linear_ce} if hasattr(F, "linear_cross_entropy") else {}),
        **({"Liger fused linear CE (va, dW in the weight's dtype)": liger_linear_ce(),
            "Liger fused linear CE (va, fp32 dW)": liger_linear_ce(torch.float32)}
           if gpu and installed("liger_kernel") else {}),
        **({"Cut Cross-Entropy (va, default filter)": cut_linear_ce("high"),
            "Cut Cross-Entropy (va, exact)": cut_linear_ce(None)} if gpu and installed("cut_cross_entropy") else {}),
        **({"Cut Cross-Entropy (va, torch_compile)": cut_linear_ce_compiled}
           if not gpu and installed("cut_cross_entropy") else {}),
    }
