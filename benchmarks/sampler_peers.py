"""The peers of :mod:`benchmarks.cpu_step`, each timed against our step on the same logits, in one process of its own
environment: llama.cpp's sampler chain (llama-cpp-python's low-level API; the llama_cpp environment) and vLLM's CPU
sampler (``vllm.v1.sample.ops.topk_topp_sampler``; the vllm environment).

    .venv-llama-cpp/bin/python -m benchmarks.sampler_peers llama.cpp --json out.json
    .venv-vllm/bin/python -m benchmarks.sampler_peers vllm --json out.json

``python -m benchmarks.cpu_step --peer llama.cpp=.venv-llama-cpp/bin/python --peer vllm=.venv-vllm/bin/python`` runs
these in its own run and puts their columns beside its table.

llama.cpp: per row, the row's candidate records (id, logit, p), filled once, are copied into the chain's working
array with one memmove (about what llama.cpp's own fill from its logits costs), then ``llama_sampler_apply`` of the
chain llama.cpp builds for the strategy: top-k, top-p, min-p (each only when set, in llama.cpp's order), then
``dist`` (``greedy`` for greedy). vLLM: ``TopKTopPSampler`` as its CPU engine builds it (``forward_cpu``: top-k /
top-p masks by a sort of the row, then a Gumbel-max draw), greedy as its ``Sampler.greedy_sample`` (``argmax``); it
overwrites its logits with its masks, so it works on a copy of the logits of its own, made once (every call then
does the same work: the masked entries are −inf already). It has no min-p (vLLM applies min-p as a logits processor
of its own), so its min-p cases stay empty. Both peers sample the logits' softmax (the VA head); ours the NMST head
(t = 100), as in :mod:`benchmarks.cpu_step`.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
from typing import Callable, Optional

import numpy as np
import torch

from .cpu_step import SHAPES, cases, median_us, our_step

PEERS = ("llama.cpp", "vllm")


def llama_cpp_step(logits: torch.Tensor, top_k: Optional[int], top_p: Optional[float],
                   min_p: Optional[float]) -> Callable[[], list[int]]:
    """One llama.cpp sampler-chain step over the rows of ``logits`` (B, V) float32."""
    import llama_cpp

    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    if top_k == 1:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    else:
        if top_k is not None:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_k(top_k))
        if top_p is not None:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(top_p, 1))
        if min_p is not None:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_min_p(min_p, 1))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(1234))
    B, V = logits.shape
    record = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)])
    filled = np.zeros((B, V), dtype=record)
    filled["id"] = np.arange(V)
    filled["logit"] = logits.numpy()
    work = np.zeros(V, dtype=record)
    candidates = llama_cpp.llama_token_data_array(
        data=work.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), size=V, selected=-1, sorted=False)
    pointer, nbytes, ids = ctypes.byref(candidates), work.nbytes, work["id"]
    sources = [filled[b].ctypes.data for b in range(B)]
    target = work.ctypes.data

    def step() -> list[int]:
        tokens = []
        for source in sources:
            ctypes.memmove(target, source, nbytes)
            candidates.size, candidates.selected, candidates.sorted = V, -1, False
            llama_cpp.llama_sampler_apply(chain, pointer)
            tokens.append(int(ids[candidates.selected]))
        return tokens

    step.keep = (chain, filled, work)  # what the raw pointers point into lives as long as the step
    return step


def vllm_step(logits: torch.Tensor, top_k: Optional[int], top_p: Optional[float],
              min_p: Optional[float]) -> Optional[Callable[[], torch.Tensor]]:
    """One step of vLLM's CPU sampler over ``logits`` (B, V) float32 (None: a strategy it has no function for)."""
    if min_p is not None:
        return None
    own = logits.clone()
    if top_k == 1:
        return lambda: own.argmax(dim=-1)
    import vllm._C  # noqa: F401  (registers torch.ops._C.*, the CPU sampler's fused_gumbel_argmax among them)
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    sampler = TopKTopPSampler()
    B = logits.shape[0]
    k = None if top_k is None else torch.full((B,), top_k, dtype=torch.int32)
    p = None if top_p is None else torch.full((B,), top_p, dtype=torch.float32)
    return lambda: sampler(own, {}, k, p)[0]


MAKERS = {"llama.cpp": llama_cpp_step, "vllm": vllm_step}


def run(peer: str, batches: tuple[int, ...], vocabs: tuple[int, ...], calls: int,
        shapes: tuple[str, ...] = SHAPES) -> list[dict]:
    """One row per (logits shape, B, V, strategy): µs of ours and of the peer, interleaved, and ours / peer."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for shape, V, B, logits, name, (k, p, m) in cases(shapes, vocabs, batches):
        theirs = MAKERS[peer](logits, k, p, m)
        row = dict(shape=shape, batch=B, vocab=V, strategy=name, peer=peer)
        if theirs is not None:
            timed = median_us({"ours": functools.partial(our_step(k, p, V, min_p=m), logits, gen), "peer": theirs},
                              calls)
            row.update(ours_us=timed["ours"], peer_us=timed["peer"], ratio=timed["ours"] / timed["peer"])
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("peer", choices=PEERS)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 50257, 128256, 151936])
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--calls", type=int, default=20, help="interleaved calls per case (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (llama.cpp's samplers: one)")
    parser.add_argument("--json", help="write the rows to this JSON file (default: print them)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.peer, tuple(args.batches), tuple(args.vocabs), args.calls, tuple(args.shapes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    else:
        for row in rows:
            print(row)


if __name__ == "__main__":
    main()
