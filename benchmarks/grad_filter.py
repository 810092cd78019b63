"""The fused loss's gradient filter (``grad_filter="auto"``) on CPU, per workload: the share of the vocabulary its
chunks keep, the step against the dense three-GEMM floor and against the unfiltered fused loss, and the filtered
and unfiltered bf16 gradients' error against float64, all in one run: ``python -m benchmarks.grad_filter``.

Workloads (the NMST head, eos the last token; a random softmax leaves the filter nothing to skip, so each is named):

* ``synthetic``: rows with a trained LM's statistics (:func:`peaked_rows`): a Zipf unigram prior (exponent 1.1,
  frequent tokens first) shared by every row, carried by a constant feature of the hidden states, and per row
  ``TOPICS`` tokens drawn from that prior, raised by ``gamma`` (2.5) times their own embedding; entropy about
  2.4 nats, targets drawn from each row's own softmax.
* ``random``: N(0, 1) hidden states, N(0, 1/H) weights, uniform targets (``benchmarks.cases.make_inputs``): the
  worst case, where every block is kept.
* ``trained`` (with ``--model-dir``): a causal LM trained here (``python -m train.hf ...``), its last hidden states
  on WikiText test lines (``--data-dir``) and its output embedding, targets the next tokens. At the goal's
  4096x768x50257: GPT-2's own tokenizer (``tools/gpt2_tokenizer.py`` rebuilds it from openai-whisper's sdist) and
  ``train.hf --config gpt2 --size base`` (H = 768).

Cases: the dense floor (three bf16 GEMMs), the fused step unfiltered, filtered (on the vocabulary sorted by mean
logit where :mod:`nmst_fast.vocab_order` takes the sort: "sorted"), and filtered in the vocabulary's id order.
Times: every round runs each case once, in a fresh order, and each case's ratio to that round's floor is taken;
the table reports medians over ``--rounds``. The errors (relative Frobenius norms of dh and dW against the float64
fused loss, which equals the reference to float64 rounding) are taken once, on the first ``--error-rows`` rows.

    python -m benchmarks.grad_filter                              # 4096x768x50257 bf16: synthetic, random
    python -m benchmarks.grad_filter --large                      # 2048x2304x256000 (Gemma-2's width, vocabulary)
    python -m benchmarks.grad_filter --model-dir OUT/model --data-dir ../shared/data/wikitext-2 --workloads trained
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

import nmst_fast
from nmst_fast import grad_filter, vocab_order

from .cases import CPU_DEFAULT, CPU_LARGE, Shape, make_inputs

ZIPF_EXPONENT = 1.1
TOPICS = 8
GAMMA = 2.5


@dataclass
class Workload:
    name: str
    hidden: torch.Tensor  # (N, H), requires grad
    weight: torch.Tensor  # (V, H), requires grad
    targets: torch.Tensor  # (N,)
    note: str
    eos: int = -1  # the head's eos (-1: the last token)


def peaked_rows(N: int, H: int, V: int, *, gamma: float = GAMMA, seed: int = 0, dtype: torch.dtype = torch.float64,
                rows_per_block: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden (N, H), weight (V, H)) in ``dtype`` whose logits h·Wᵀ are a Zipf prior shared by every row plus a few
    raised tokens per row (see the module's docstring): column 0 carries the prior (h = 1, W = log prior), the others
    E / sqrt(H - 1) with E ~ N(0, 1), and each row's hidden state is gamma times the sum of ``TOPICS`` tokens'
    embeddings, the tokens drawn from the prior. Built by blocks of rows, so no float32 copy of W is held."""
    gen = torch.Generator().manual_seed(seed)
    log_prior = -ZIPF_EXPONENT * torch.arange(1, V + 1, dtype=torch.float64).log()
    log_prior -= torch.logsumexp(log_prior, 0)
    weight = torch.empty(V, H, dtype=dtype)
    for v0 in range(0, V, 16384):
        v1 = min(V, v0 + 16384)
        block = torch.randn(v1 - v0, H - 1, generator=gen, dtype=torch.float32) / math.sqrt(H - 1)
        weight[v0:v1, 1:] = block.to(dtype)
        weight[v0:v1, 0] = log_prior[v0:v1].to(dtype)
    topics = torch.multinomial(log_prior.exp().float(), N * TOPICS, replacement=True, generator=gen).view(N, TOPICS)
    hidden = torch.empty(N, H, dtype=dtype)
    hidden[:, 0] = 1
    for r0 in range(0, N, rows_per_block):
        r1 = min(N, r0 + rows_per_block)
        hidden[r0:r1, 1:] = (gamma * weight[topics[r0:r1], 1:].float().sum(1)).to(dtype)
    return hidden, weight


def _sampled_targets(hidden: torch.Tensor, weight: torch.Tensor, seed: int, rows: int = 256) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for r0 in range(0, hidden.shape[0], rows):
        probs = (hidden[r0:r0 + rows] @ weight.t()).float().softmax(1)
        out.append(torch.multinomial(probs, 1, generator=gen).squeeze(1))
    return torch.cat(out)


def synthetic(shape: Shape, seed: int = 0) -> Workload:
    hidden, weight = peaked_rows(shape.N, shape.H, shape.V, seed=seed, dtype=shape.dtype)
    targets = _sampled_targets(hidden, weight, seed)
    return Workload("synthetic", hidden.requires_grad_(), weight.requires_grad_(), targets,
                    f"Zipf {ZIPF_EXPONENT} prior, {TOPICS} raised tokens per row, gamma {GAMMA}")


def uniform(shape: Shape, seed: int = 0) -> Workload:
    x = make_inputs(shape, seed)
    return Workload("random", x.hidden, x.weight, x.targets, "N(0, 1) hidden, N(0, 1/H) weights, uniform targets")


def trained(model_dir: Path, data_dir: Path, rows: int, dtype: torch.dtype) -> Workload:
    """A saved causal LM's last hidden states on WikiText test lines and its output embedding."""
    import transformers

    from nmst_fast.data.wikitext import find_split_file, read_lines

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids: list[int] = []
    for line in read_lines(find_split_file(data_dir, "test")):
        ids += tok(" " + line)["input_ids"] + [model.config.eos_token_id]
        if len(ids) > rows + 1:
            break
    ids_t = torch.tensor(ids[: rows + 1])
    window = 256
    states = []
    with torch.no_grad():
        for r0 in range(0, rows, window):
            out = model(ids_t[r0:r0 + window].unsqueeze(0), output_hidden_states=True)
            states.append(out.hidden_states[-1][0])
    hidden = torch.cat(states)[:rows].to(dtype)
    weight = model.get_output_embeddings().weight.detach().to(dtype).contiguous()
    targets = ids_t[1: rows + 1].clone()
    return Workload("trained", hidden.requires_grad_(), weight.requires_grad_(), targets,
                    f"{getattr(model.config, 'base_model_type', model.config.model_type)} from {model_dir}",
                    eos=model.config.eos_token_id)


def softmax_profile(w: Workload, rows: int = 512) -> tuple[float, float]:
    """(mean entropy in nats, share of softmax entries >= 2^-12) over the first ``rows`` rows (plain softmax)."""
    logp = (w.hidden[:rows].detach().float() @ w.weight.detach().float().t()).log_softmax(1)
    entropy = -(logp.exp() * logp).sum(1).mean().item()
    return entropy, (logp >= -12 * math.log(2)).float().mean().item()


def _step(w: Workload, grad_filter_value, id_order: bool = False) -> Callable[[], None]:
    """One fused step; ``id_order``: the filter on the vocabulary's own order (nmst_fast.vocab_order's sort off)."""
    steps = torch.arange(1, w.hidden.shape[0] + 1) % 1000 + 1

    def step() -> None:
        w.hidden.grad = w.weight.grad = None
        with vocab_order.ids_kept() if id_order else contextlib.nullcontext():
            loss = nmst_fast.linear_nmst_loss(w.hidden, w.weight, w.targets, eos_index=w.eos % w.weight.shape[0],
                                              steps=steps, grad_filter=grad_filter_value)
            loss.backward()

    return step


def _floor(w: Workload) -> Callable[[], None]:
    def step() -> None:
        h, W = w.hidden.detach(), w.weight.detach()
        z = h @ W.t()
        w.hidden.grad = z @ W
        w.weight.grad = z.t() @ h

    return step


def kept_share(w: Workload, id_order: bool = False) -> float:
    """The mean share of the vocabulary the filter's chunks keep in one filtered step."""
    with grad_filter.recorded_kept_shares() as shares:
        _step(w, "auto", id_order)()
    return statistics.fmean(shares)


def gradient_errors(w: Workload, rows: int) -> dict[str, list[float]]:
    """{"unfiltered" | "filtered": [dh, dW relative errors]} of bf16 steps on the first ``rows`` rows against the
    float64 fused loss."""
    sub = Workload(w.name, w.hidden[:rows].detach(), w.weight.detach(), w.targets[:rows], w.note, w.eos)

    def grads(dtype, g):
        h = sub.hidden.to(dtype, copy=True).requires_grad_()
        W = sub.weight.to(dtype, copy=True).requires_grad_()
        x = Workload(w.name, h, W, sub.targets, w.note, w.eos)
        _step(x, g)()
        return h.grad.double(), W.grad.double()

    exact = grads(torch.float64, None)
    out = {}
    for label, g in (("unfiltered", None), ("filtered", "auto")):
        got = grads(sub.hidden.dtype, g)
        out[label] = [((a - e).norm() / e.norm()).item() for a, e in zip(got, exact)]
    return out


def measure(w: Workload, rounds: int, error_rows: int) -> dict:
    cases = {"floor": _floor(w), "unfiltered": _step(w, None), "filtered": _step(w, "auto"),
             "filtered_id_order": _step(w, "auto", id_order=True)}
    for fn in cases.values():
        fn()  # warm-up: the first call builds kernels and allocator state
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):
        for name in random.Random(r).sample(list(cases), len(cases)):
            t0 = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - t0)
            print(f"  {w.name} round {r + 1}/{rounds}: {name} {times[name][-1]:.3f}s", file=sys.stderr, flush=True)
    ratio = {name: statistics.median(t / f for t, f in zip(times[name], times["floor"])) for name in cases}
    entropy, above = softmax_profile(w)
    N, H = w.hidden.shape
    return dict(
        workload=w.name, note=w.note, shape=[N, H, w.weight.shape[0]], dtype=str(w.hidden.dtype).removeprefix("torch."),
        entropy_nats=entropy, share_above_2_12=above, kept_share=kept_share(w),
        kept_share_id_order=kept_share(w, id_order=True), sorted=vocab_order.vocabulary_order(
            w.hidden.detach(), w.weight.detach(), None) is not None,
        floor_s=statistics.median(times["floor"]), unfiltered_s=statistics.median(times["unfiltered"]),
        filtered_s=statistics.median(times["filtered"]), unfiltered_x_floor=ratio["unfiltered"],
        filtered_x_floor=ratio["filtered"], filtered_id_order_x_floor=ratio["filtered_id_order"],
        filtered_x_unfiltered=statistics.median(f / u for f, u in zip(times["filtered"], times["unfiltered"])),
        errors=gradient_errors(w, error_rows) if error_rows else None,
    )


def format_table(rows: list[dict]) -> str:
    lines = ["| workload | N×H×V | entropy (nats) | entries ≥ 2⁻¹² | sorted | kept | kept in id order | floor (s) | "
             "unfiltered × floor | filtered × floor | in id order × floor | filtered × unfiltered | "
             "dh error unfiltered / filtered | dW error unfiltered / filtered |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        e = r["errors"]
        errs = ("—", "—") if e is None else tuple(f"{e['unfiltered'][i]:.2e} / {e['filtered'][i]:.2e}" for i in (0, 1))
        lines.append(f"| {r['workload']} | {'×'.join(map(str, r['shape']))} | {r['entropy_nats']:.2f} | "
                     f"{r['share_above_2_12']:.4f} | {'yes' if r['sorted'] else 'no'} | {r['kept_share']:.3f} | "
                     f"{r['kept_share_id_order']:.3f} | {r['floor_s']:.3f} | "
                     f"{r['unfiltered_x_floor']:.3f} | {r['filtered_x_floor']:.3f} | "
                     f"{r['filtered_id_order_x_floor']:.3f} | "
                     f"{r['filtered_x_unfiltered']:.3f} | "
                     f"{errs[0]} | {errs[1]} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grad_filter", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--large", action="store_true", help="2048x2304x256000 instead of 4096x768x50257")
    p.add_argument("--shape", type=int, nargs=3, metavar=("N", "H", "V"), help="another shape")
    p.add_argument("--workloads", nargs="+", default=["synthetic", "random"],
                   choices=["synthetic", "random", "trained"])
    p.add_argument("--model-dir", type=Path, help="the trained workload's model (a from_pretrained directory)")
    p.add_argument("--data-dir", type=Path, help="the trained workload's WikiText directory")
    p.add_argument("--rows", type=int, help="the trained workload's rows (default: the shape's N)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--error-rows", type=int, default=1024, help="rows of the float64 error check (0: none)")
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args(argv)
    base = CPU_LARGE if args.large else CPU_DEFAULT
    shape = Shape(*args.shape, torch.bfloat16, "cpu") if args.shape else Shape(base.N, base.H, base.V,
                                                                              torch.bfloat16, "cpu")
    rows = []
    for name in args.workloads:
        if name == "trained":
            if args.model_dir is None or args.data_dir is None:
                p.error("the trained workload needs --model-dir and --data-dir")
            w = trained(args.model_dir, args.data_dir, args.rows or shape.N, torch.bfloat16)
        else:
            w = (synthetic if name == "synthetic" else uniform)(shape)
        rows.append(measure(w, args.rounds, args.error_rows))
        del w
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16, grad_filter='auto' (2^-12)")
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
