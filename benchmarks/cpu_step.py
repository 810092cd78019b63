"""One decoding step on the CPU against its floor, the torch path and the few lines of plain torch a user would write.

    python -m benchmarks.cpu_step                 # B in {1, 8, 64}, V in {32000, 50257, 128256, 151936}, one thread
    python -m benchmarks.cpu_step --json out.json
    python -m benchmarks.cpu_step --repeats 3     # medians over three whole runs
    python -m benchmarks.cpu_step --eos-inside    # eos 255 columns before the end (Llama 3's 128001)
    python -m benchmarks.cpu_step --torch-path    # also the torch path (impl="torch", the kernel's fallback)
    python -m benchmarks.cpu_step --peer llama.cpp=.venv-llama-cpp/bin/python --peer vllm=.venv-vllm/bin/python
                                                  # also llama.cpp's sampler chain and vLLM's CPU sampler

Logits ``--shapes``: flat (N(0, 3²)) and peaked (a Zipf prior over a shuffled vocabulary, 8 − 1.1·ln rank, plus
N(0, 1): a trained LM's rows put most of their mass on a few hundred tokens). The floor (``exp``): one vectorized
pass of exp over the B×V float32 logits (``torch.exp(logits, out=buffer)``), which any exact step of these heads
needs at least; the goal is ours ≤ 3 × exp + 25 µs. The plain version (:func:`plain_step`): the NMST
log-probabilities over the vocabulary in the logits' dtype, then ``argmax``, ``topk`` + ``multinomial``, a sort +
cumulative sum + ``multinomial`` for top-p, or ``multinomial`` over the whole row. Ours: a
:class:`nmst_fast.decoding.DecodingStep` built once, called as a decoding loop calls it (exact ties, float64 head
math and the exact nucleus, which the plain version does not give): on CPU the C++ selection kernel. Times are
medians of interleaved calls (µs) on ``--threads`` threads (default 1: on a small shared VM two threads made both
sides' medians jump by up to 2× between runs); ``ratio`` is ours / plain (≤ 1: no slower), ``floor_ratio`` ours /
exp.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from nmst_fast.decoding import DecodingStep

from .decoding_cases import make_logits
from .report import cpu_description

EPS, STEP = 1e-5, 100
INSIDE = 255  # --eos-inside: eos this many columns before the last (Llama 3: 128001 of 128256)
# (top_k, top_p, min_p); llama.cpp's defaults are top-k 40, top-p 0.95, min-p 0.05
STRATEGIES = {"greedy": (1, None, None), "top-k 50": (50, None, None), "top-p 0.9": (None, 0.9, None),
              "top-k 40 + top-p 0.95": (40, 0.95, None), "min-p 0.05": (None, None, 0.05),
              "top-k 40 + top-p 0.95 + min-p 0.05": (40, 0.95, 0.05), "sampling": (None, None, None)}
SHAPES = ("flat", "peaked")


def shaped_logits(B: int, V: int, shape: str, seed: int = 0) -> torch.Tensor:
    """(B, V) float32 logits: "flat" N(0, 3²), or "peaked", a Zipf prior (8 − 1.1·ln rank over a shuffled
    vocabulary, shared by the rows) plus N(0, 1)."""
    if shape == "flat":
        return make_logits(B, V, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    prior = 8.0 - 1.1 * (torch.randperm(V, generator=gen).double() + 1).log()
    return (prior.float() + torch.randn(B, V, generator=gen)).contiguous()


def plain_step(top_k: Optional[int], top_p: Optional[float], min_p: Optional[float] = None,
               eos_inside: bool = False) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    """The NMST step as a user would write it in torch (t = STEP): eos last (the other columns are a
    slice) or inside the vocabulary (its column masked for the softmax, then overwritten)."""

    def step(logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        eos = logits.shape[1] - 1 - (INSIDE if eos_inside else 0)
        log_survival = torch.nn.functional.logsigmoid(-logits[:, eos]) + STEP * math.log1p(-EPS)
        if eos_inside:
            masked = logits.index_fill(1, torch.tensor([eos]), float("-inf"))
            log_p = torch.log_softmax(masked, dim=1) + log_survival[:, None]
            log_p[:, eos] = torch.log(-torch.expm1(log_survival))
        else:
            log_p = torch.log_softmax(logits[:, :eos], dim=1) + log_survival[:, None]
            log_p = torch.cat([log_p, torch.log(-torch.expm1(log_survival))[:, None]], dim=1)
        if top_k == 1:
            return torch.argmax(log_p, dim=1)
        if min_p is not None:  # the tokens below min_p times the row's most probable one out
            log_p = log_p.masked_fill(log_p < log_p.amax(dim=1, keepdim=True) + math.log(min_p), -math.inf)
        if top_k is not None:
            values, tokens = torch.topk(log_p, top_k, dim=1)
            return tokens.gather(1, torch.multinomial(torch.softmax(values, dim=1), 1, generator=gen)).squeeze(1)
        probs = log_p.exp()
        if top_p is None:
            return torch.multinomial(probs, 1, generator=gen).squeeze(1)
        ranked, order = torch.sort(probs, dim=1, descending=True)
        ranked[(torch.cumsum(ranked, dim=1) - ranked) >= top_p] = 0.0
        return order.gather(1, torch.multinomial(ranked, 1, generator=gen)).squeeze(1)

    return step


def our_step(top_k: Optional[int], top_p: Optional[float], V: int, eos_inside: bool = False, impl: str = "auto",
             min_p: Optional[float] = None) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    """A DecodingStep built once, called with its checks deferred, as ``generate`` calls it."""
    step = DecodingStep(head="nmst", eos_index=V - 1 - (INSIDE if eos_inside else 0), vocab_size=V, eps=EPS,
                        top_k=top_k, top_p=top_p, min_p=min_p, impl=impl)
    return lambda logits, gen: step(logits, steps=STEP, generator=gen, defer_checks=True).tokens


def median_us(steps: dict[str, Callable[[], object]], calls: int) -> dict[str, float]:
    """Median µs per call of each step, the steps' calls interleaved (so drift hits them alike)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(3):  # warm-up
        for fn in steps.values():
            fn()
    for _ in range(calls):
        for name, fn in steps.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e6 for name, values in times.items()}


def cases(shapes: tuple[str, ...], vocabs: tuple[int, ...], batches: tuple[int, ...],
          strategies: tuple[str, ...] = tuple(STRATEGIES)):
    """Every case of a run, in its order: (logits shape, V, B, the (B, V) logits, strategy name, (top_k, top_p,
    min_p)); one logits tensor per (shape, V, B), shared by its strategies."""
    for shape in shapes:
        for V in vocabs:
            for B in batches:
                logits = shaped_logits(B, V, shape)
                for name in strategies:
                    yield shape, V, B, logits, name, STRATEGIES[name]


def run(batches: tuple[int, ...] = (1, 8, 64), vocabs: tuple[int, ...] = (32000, 50257, 128256, 151936),
        calls: int = 20, eos_inside: bool = False, shapes: tuple[str, ...] = SHAPES,
        torch_path: bool = False, strategies: tuple[str, ...] = tuple(STRATEGIES)) -> list[dict]:
    """One row per (logits shape, B, V, strategy): µs of ours, of the exp pass, of the plain version (and of the
    torch path with ``torch_path``), and the ratios."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for shape, V, B, logits, name, (k, p, m) in cases(shapes, vocabs, batches, strategies):
        buffer = torch.empty_like(logits)
        steps = {"ours": our_step(k, p, V, eos_inside, min_p=m), "plain": plain_step(k, p, m, eos_inside),
                 "exp": lambda _logits, _gen, buffer=buffer: torch.exp(_logits, out=buffer)}
        if torch_path:
            steps["torch_path"] = our_step(k, p, V, eos_inside, impl="torch", min_p=m)
        timed = median_us({key: functools.partial(fn, logits, gen) for key, fn in steps.items()}, calls)
        row = dict(shape=shape, batch=B, vocab=V, strategy=name, ours_us=timed["ours"], plain_us=timed["plain"],
                   exp_us=timed["exp"], ratio=timed["ours"] / timed["plain"], floor_ratio=timed["ours"] / timed["exp"],
                   meets_goal=timed["ours"] <= 3 * timed["exp"] + 25)
        if torch_path:
            row["torch_path_us"] = timed["torch_path"]
        rows.append(row)
    return rows


def combine(runs: list[list[dict]]) -> list[dict]:
    """One row per case from several runs of :func:`run`: the median µs of each side over the runs,
    their ratio, and the lowest and highest ratio of a single run."""
    rows = []
    for case in zip(*runs):
        times = {key: statistics.median(r[key] for r in case) for key in case[0] if key.endswith("_us")}
        ratios = [r["ratio"] for r in case]
        rows.append(dict(case[0], **times, ratio=times["ours_us"] / times["plain_us"],
                         floor_ratio=times["ours_us"] / times["exp_us"],
                         meets_goal=times["ours_us"] <= 3 * times["exp_us"] + 25, ratio_min=min(ratios),
                         ratio_max=max(ratios), repeats=len(case)))
    return rows


def _peer_argument(value: str) -> tuple[str, str]:
    name, sep, python = value.partition("=")
    if not sep or name not in ("llama.cpp", "vllm") or not python:
        raise SystemExit(f"cpu_step: --peer takes llama.cpp=PYTHON or vllm=PYTHON, got {value!r}")
    return name, python


def peer_rows(name: str, python: str, args: argparse.Namespace) -> list[dict]:
    """The rows of ``benchmarks.sampler_peers`` for peer ``name`` run by ``python`` (its environment's interpreter)
    with this run's cases."""
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "peer.json"
        command = [python, "-m", "benchmarks.sampler_peers", name, "--batches", *map(str, args.batches),
                   "--vocabs", *map(str, args.vocabs), "--shapes", *args.shapes, "--calls", str(args.calls),
                   "--threads", str(args.threads), "--json", str(out)]
        subprocess.run(command, check=True, cwd=Path(__file__).resolve().parent.parent)
        return json.loads(out.read_text())


def add_peer(rows: list[dict], name: str, timed: list[dict]) -> None:
    """Put a peer's µs and ours / peer (both timed in its process) into the matching rows."""
    by_case = {(r["shape"], r["batch"], r["vocab"], r["strategy"]): r for r in timed if "peer_us" in r}
    for row in rows:
        peer = by_case.get((row["shape"], row["batch"], row["vocab"], row["strategy"]))
        if peer is not None:
            row[f"{name}_us"], row[f"ours_over_{name}"] = peer["peer_us"], peer["ratio"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 50257, 128256, 151936])
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES),
                        help="the strategies to time (default: all; peers time all of theirs)")
    parser.add_argument("--calls", type=int, default=20, help="interleaved calls per case (median)")
    parser.add_argument("--torch-path", action="store_true", help="also time the torch path (impl='torch')")
    parser.add_argument("--repeats", type=int, default=1,
                        help="whole runs; a row's times are the medians over them, with the ratio's range")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for both sides")
    parser.add_argument("--eos-inside", action="store_true",
                        help=f"eos {INSIDE} columns before the last (default: the last column)")
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=PYTHON",
                        help="also time a peer (llama.cpp or vllm: benchmarks.sampler_peers) against ours in one "
                             "process of the Python interpreter of its environment, e.g. "
                             "llama.cpp=.venv-llama-cpp/bin/python (repeatable)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    peers = dict(_peer_argument(value) for value in args.peer)
    peer_timings = {name: peer_rows(name, python, args) for name, python in peers.items()}  # first: a failing peer
    threads = torch.get_num_threads()  # environment fails the run before the long part
    torch.set_num_threads(args.threads)
    try:
        rows = combine([run(tuple(args.batches), tuple(args.vocabs), args.calls, args.eos_inside, tuple(args.shapes),
                            args.torch_path, tuple(args.strategies)) for _ in range(args.repeats)])
    finally:
        torch.set_num_threads(threads)
    for name, timed in peer_timings.items():
        add_peer(rows, name, timed)
    print(f"one NMST decoding step on the CPU ({cpu_description()}), torch {torch.__version__}, "
          f"{args.threads} thread(s); µs, medians of interleaved calls")
    path = " torch path |" if args.torch_path else ""
    peer_head = "".join(f" {name} | ours / {name} (same process) |" for name in peers)
    print(f"| logits | B | V | strategy | ours | exp pass | ours / exp | ≤ 3·exp + 25 µs |{path} plain torch | "
          f"ours / plain | range over repeats |{peer_head}\n|---|---:|---:|---|---:|---:|---:|---|"
          f"{'---:|' * bool(path)}---:|---:|---|{'---:|---:|' * len(peers)}")
    for row in rows:
        torch_path = f" {row['torch_path_us']:.0f} |" if args.torch_path else ""
        peer_cells = "".join(f" {row[f'{name}_us']:.0f} | {row[f'ours_over_{name}']:.2f} |"
                             if f"{name}_us" in row else " — | — |" for name in peers)
        print(f"| {row['shape']} | {row['batch']} | {row['vocab']} | {row['strategy']} | {row['ours_us']:.0f} | "
              f"{row['exp_us']:.0f} | {row['floor_ratio']:.2f} | {'yes' if row['meets_goal'] else 'no'} |{torch_path} "
              f"{row['plain_us']:.0f} | {row['ratio']:.2f} | {row['ratio_min']:.2f}–{row['ratio_max']:.2f} |"
              f"{peer_cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
