"""Opening an NMST GGUF file with the head against opening it plain: ``python -m benchmarks.llama_cpp_load`` (in the
llama_cpp environment: tools/environments.py install llama_cpp).

A Llama with the head (``--hidden``, ``--layers``, V = ``--vocab``: Qwen3's 151936 by default; random init) exported
f16 with :func:`nmst_fast.integrations.llama_cpp.export_gguf`, opened in interleaved rounds, in this process, as
plain ``Llama(path, kv_overrides={"general.architecture": "llama"})`` and as
:func:`nmst_fast.integrations.llama_cpp.load` (which reads the head from the file's header first). The CPU kernels
the head's sampler is part of are built (or loaded) before the rounds: the first ``load`` on a machine also builds
them, once, and says so. Prints the medians and the median of the rounds' ratios; the goal is ``load`` within
1.2 × plain + 0.1 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from .llama_cpp_step import export_model


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)

    from llama_cpp import Llama

    from nmst_fast.integrations.llama_cpp import load
    from nmst_fast.kernels.cpu import row_kernels

    row_kernels()
    with tempfile.TemporaryDirectory() as scratch:
        path = export_model(Path(scratch), args.vocab, args.hidden, args.layers, dtype="f16")
        opens = {"plain Llama": lambda: Llama(str(path), kv_overrides={"general.architecture": "llama"},
                                              verbose=False),
                 "load": lambda: load(path, verbose=False)}
        times: dict[str, list[float]] = {name: [] for name in opens}
        for r in range(args.rounds):
            for name in (opens if r % 2 == 0 else reversed(list(opens))):
                start = time.perf_counter()
                llm = opens[name]()
                times[name].append(time.perf_counter() - start)
                del llm
    plain, head = times["plain Llama"], times["load"]
    result = {"V": args.vocab, "H": args.hidden, "layers": args.layers, "rounds": args.rounds,
              "plain_s": statistics.median(plain), "load_s": statistics.median(head),
              "load_over_plain": statistics.median(h / p for h, p in zip(head, plain)),
              "load_minus_plain_s": statistics.median(h - p for h, p in zip(head, plain))}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
