"""A llama-cpp-python step with the head against the same file without it:
``python -m benchmarks.llama_cpp_step`` (in the llama_cpp environment: tools/environments.py install llama_cpp).

A small Llama (``--hidden``, ``--layers``; random init, the head recorded with ε = 1e-5) over V ∈ ``--vocabs``,
exported f32 with :func:`nmst_fast.integrations.llama_cpp.export_gguf`, opened four ways: plain (``Llama`` with the
architecture override, no processor: the floor), with the head (:func:`nmst_fast.integrations.llama_cpp.load`: the
head's C sampler first in llama.cpp's chain), plain with an ``NMSTLogitsProcessor`` in the call (a ``Llama`` of
one's own: the same C sampler), and the processor in llama-cpp-python's callback (how a call runs it after another
processor; the callback copies the step's logits out of its candidate records and back). Each greedy
``generate`` takes ``--new-tokens`` tokens (eos does not stop ``generate``) from the same prompt, B = 1; the four
alternate over ``--rounds`` rounds and the table holds the medians of the time per token and of each round's ratio
to the plain run. A second table: sampled ``generate`` calls (:data:`CHAINS`: llama.cpp's default cuts, and none),
plain against ``load``. Where the chain is greedy or llama.cpp's cuts and draw alone, ``load``'s C sampler draws
the token itself from the context's logits row (llama.cpp's own samplers draw the plain run's). Timed alone, warm:
that draw of a greedy step (the chain's ``sample``, one ctypes call, on the last step's logits), and the copy of a
step's logits out of the candidate records (a strided view), which the processor path makes in Python.
``--threads`` llama.cpp threads (default 1).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from .cpu_step import median_us


def export_model(directory: Path, vocab: int, hidden: int, layers: int, dtype: str = "f32") -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from nmst_fast.data.bpe import train_byte_level_bpe
    from nmst_fast.integrations.hf import apply_nmst
    from nmst_fast.integrations.llama_cpp import export_gguf

    tokenizer = train_byte_level_bpe(["a small corpus for the benchmark's tokenizer"] * 8, vocab_size=300)
    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096,
                         bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    apply_nmst(model, head="nmst", eps=1e-5)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return export_gguf(directory, directory / "model.gguf", dtype=dtype)


# Sampled chains (llama-cpp-python's generate arguments): llama.cpp's defaults, and the draw without cuts.
CHAINS = {"top-k 40, top-p 0.95, min-p 0.05, T 0.8": dict(temp=0.8, top_k=40, top_p=0.95, min_p=0.05),
          "no cuts, T 1": dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)}


def per_token(llm, prompt: list[int], new_tokens: int, **kwargs) -> float:
    kwargs.setdefault("temp", 0.0)
    start = time.perf_counter()
    for i, _ in enumerate(llm.generate(prompt, reset=True, **kwargs)):
        if i + 1 == new_tokens:
            break
    return (time.perf_counter() - start) / new_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from llama_cpp import Llama, LogitsProcessorList

    from nmst_fast.integrations.llama_cpp import NMSTLogitsProcessor, decoding, load

    print("| V | plain ms / token | `load` ms / token | `load` / plain | processor of one's own ms / token | its ratio "
          "| in the callback ms / token | its ratio | sampler step alone µs | logits copy µs |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    sampled_rows = []
    for vocab in args.vocabs:
        with tempfile.TemporaryDirectory() as scratch:
            path = export_model(Path(scratch), vocab, args.hidden, args.layers)
            options = dict(n_ctx=512, n_threads=args.threads, n_batch=64, verbose=False, seed=0)
            plain = Llama(str(path), kv_overrides={"general.architecture": "llama"}, **options)
            head = load(path, **options)
            own = Llama(str(path), kv_overrides={"general.architecture": "llama"}, **options)
            processors = LogitsProcessorList([NMSTLogitsProcessor(own)])
            callback = Llama(str(path), kv_overrides={"general.architecture": "llama"}, **options)
            with mock.patch.object(decoding, "native_sampler_available", return_value=False):
                in_callback = LogitsProcessorList([NMSTLogitsProcessor(callback)])
            prompt = list(range(1, 17))
            runs = {"plain": lambda: per_token(plain, prompt, args.new_tokens),
                    "head": lambda: per_token(head, prompt, args.new_tokens),
                    "own": lambda: per_token(own, prompt, args.new_tokens, logits_processor=processors),
                    "callback": lambda: per_token(callback, prompt, args.new_tokens, logits_processor=in_callback)}
            for run in runs.values():  # warm-up
                run()
            times = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, run in runs.items():
                    times[name].append(run())
            records = np.zeros(vocab, dtype=[("id", np.intc), ("logit", np.single), ("p", np.single)])
            records["id"] = np.arange(vocab)
            records["logit"] = np.random.default_rng(0).standard_normal(vocab)
            buffer = np.empty(vocab, dtype=np.float32)
            per_token(head, prompt, 8)  # greedy: the chain the head draws alone, kept after generate
            alone = median_us({"step": lambda: head._sampler.sample(head._ctx, -1),
                               "copy": lambda: np.copyto(buffer, records["logit"])}, 200)
            ratio = {name: statistics.median(t / p for t, p in zip(times[name], times["plain"])) for name in times}
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            print(f"| {vocab} | {ms['plain']:.3f} | {ms['head']:.3f} | {ratio['head']:.3f} | {ms['own']:.3f} | "
                  f"{ratio['own']:.3f} | {ms['callback']:.3f} | {ratio['callback']:.3f} | {alone['step']:.0f} | "
                  f"{alone['copy']:.0f} |", flush=True)
            for chain, sampling in CHAINS.items():  # sampled: the head's sampler draws the token itself
                runs = {name: (lambda llm=llm: per_token(llm, prompt, args.new_tokens, **sampling))
                        for name, llm in (("plain", plain), ("head", head))}
                for run in runs.values():
                    run()
                times = {name: [] for name in runs}
                for _ in range(args.rounds):
                    for name, run in runs.items():
                        times[name].append(run())
                ratio = statistics.median(h / p for h, p in zip(times["head"], times["plain"]))
                sampled_rows.append(f"| {vocab} | {chain} | {statistics.median(times['plain']) * 1e3:.3f} | "
                                    f"{statistics.median(times['head']) * 1e3:.3f} | {ratio:.3f} |")
    print("\n| V | sampled chain | plain ms / token | `load` ms / token | `load` / plain |")
    print("|---:|---|---:|---:|---:|")
    print("\n".join(sampled_rows), flush=True)



if __name__ == "__main__":
    main()
