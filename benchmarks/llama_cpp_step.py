"""A llama-cpp-python step with the head's processor against the same file without it:
``python -m benchmarks.llama_cpp_step`` (in the llama_cpp environment: tools/environments.py install llama_cpp).

A small Llama (``--hidden``, ``--layers``; random init, the head recorded with ε = 1e-5) over V ∈ ``--vocabs``,
exported f32 with :func:`nmst_fast.integrations.llama_cpp.export_gguf`, opened twice: plain (``Llama`` with the
architecture override, no processor) and with the head (:func:`nmst_fast.integrations.llama_cpp.load`). Each greedy
``generate`` takes ``--new-tokens`` tokens (eos does not stop ``generate``) from the same prompt, B = 1; the two
alternate over ``--rounds`` rounds and the table holds the medians of the time per token and of each round's ratio.
The processor's own time per step is split into the copy of the step's logits out of llama-cpp-python's candidate
array (a strided view: ``np.array(scores, float32)``) and the rest (the eos column, the NaN check, the returned
array), both timed on the processor's own calls. ``--threads`` llama.cpp threads (default 1).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def export_model(directory: Path, vocab: int, hidden: int, layers: int) -> Path:
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
    return export_gguf(directory, directory / "model.gguf", dtype="f32")


def per_token(llm, prompt: list[int], new_tokens: int) -> float:
    start = time.perf_counter()
    for i, _ in enumerate(llm.generate(prompt, temp=0.0, reset=True)):
        if i + 1 == new_tokens:
            break
    return (time.perf_counter() - start) / new_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from llama_cpp import Llama

    from nmst_fast.integrations.llama_cpp import decoding, load

    print("| V | plain ms/token | head ms/token | head / plain | logits copy µs/step | rest of the processor µs/step |")
    print("|---|---|---|---|---|---|")
    for vocab in args.vocabs:
        with tempfile.TemporaryDirectory() as scratch:
            path = export_model(Path(scratch), vocab, args.hidden, args.layers)
            options = dict(n_ctx=512, n_threads=args.threads, n_batch=64, verbose=False, seed=0)
            plain = Llama(str(path), kv_overrides={"general.architecture": "llama"}, **options)
            head = load(path, **options)
            prompt = list(range(1, 17))
            step = decoding.NMSTLogitsProcessor._step
            spent = []

            def timed(self, length, scores):
                start = time.perf_counter()
                out = step(self, length, scores)
                spent.append(time.perf_counter() - start)
                return out

            decoding.NMSTLogitsProcessor._step = timed
            per_token(plain, prompt, 4), per_token(head, prompt, 4)  # warm-up
            plains, heads, ratios = [], [], []
            for _ in range(args.rounds):
                a, b = per_token(plain, prompt, args.new_tokens), per_token(head, prompt, args.new_tokens)
                plains.append(a), heads.append(b), ratios.append(b / a)
            decoding.NMSTLogitsProcessor._step = step
            # The copy alone, on a strided view like llama-cpp-python's candidates (id, logit, p) records.
            records = np.zeros(vocab, dtype=[("id", np.intc), ("logit", np.single), ("p", np.single)])
            copies = []
            for _ in range(200):
                start = time.perf_counter()
                np.array(records["logit"], dtype=np.float32)
                copies.append(time.perf_counter() - start)
            copy_us = statistics.median(copies) * 1e6
            print(f"| {vocab} | {statistics.median(plains) * 1e3:.3f} | {statistics.median(heads) * 1e3:.3f} | "
                  f"{statistics.median(ratios):.3f} | {copy_us:.0f} | {statistics.median(spent) * 1e6 - copy_us:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
