"""Train VA / ST / NMST language models and compare them: ``python -m train``.

    python -m train                                   # built-in corpus, about a minute on a CPU
    python -m train --data-dir ../shared/data/wikitext-2 --train-split valid --eval-split test
    python -m train --data-dir DIR --size paper --eps 1e-5 --device cuda   # the paper's scale
    python -m train.sweep --eps 1e-2 1e-3 --seeds 0 1 2                   # paper-style tables
    torchrun --standalone --nproc_per_node 2 -m train                     # data-parallel, 2 processes

Writes to ``--out`` (default ``runs/<time>``): ``results.json`` (per head: test ``perplexity``
and ``r_nt`` per decoder as L → ratio, plus p(eos) vs t, lengths and examples),
``report.md``, ``r_nt.png``, ``p_eos.png``, ``lengths.png``, ``config.json``, ``run.json`` (the
command and a fingerprint of its data), and one checkpoint per head (``<head>/checkpoint.pt``);
rerunning with the same ``--out`` resumes. A ``--out`` holding another run — other settings, other
data, another command's files — is refused before anything is written. A run whose loss, gradient
or validation perplexity turns non-finite stops with an error naming the epoch and batch (exit
status 1); its checkpoint keeps the last finished epoch.

Under ``torchrun`` (:mod:`train.distributed`) every rank trains on its share of each global batch of
``--batch-size`` sequences (DDP), evaluation is split over the ranks, and rank 0 writes the files;
the numbers are one process's (dropout masks aside), and ``run.json`` / ``results.json`` record the
world size. A run may resume under another number of processes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from nmst_fast.validation import HEADS

from .checkpoint import Diverged, claim_directory
from .distributed import World, launch, on_main
from .report import write_report
from .runner import (
    add_arguments,
    base_config,
    check_arguments,
    check_resumes,
    greedy_length,
    load_data,
    max_length,
    run_one,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--heads", nargs="+", default=list(HEADS), metavar="HEAD", help=f"from {list(HEADS)}")
    p.add_argument("--arch", default="lstm", help="lstm or rnn")
    p.add_argument("--eps", type=float, default=None, help="ε of ST/NMST (default 0.01)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> Path:
    parser = _parser()
    args = parser.parse_args(argv)
    return launch(parser, args, check_arguments, lambda world: _run(parser, args, argv, world))


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None, world: World) -> Path:
    try:  # bad arguments, missing data and a --out holding another run end in one clear line, not a traceback
        base = base_config(args, arch=args.arch, eps=args.eps, seed=args.seed)
        configs = [replace(base, head=h).validate() for h in args.heads]
        L = max_length(args)
        data = load_data(args, args.seed)

        def claim() -> Path:
            out = args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
            claim_directory(out, dict(entry="train", source=data.source, data=data.fingerprint),
                            record=dict(world_size=world.size))
            return out

        out = on_main(claim, world)  # rank 0 names and claims the directory; every rank learns the outcome
        check_resumes([(config, out / config.head) for config in configs], data)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        parser.error(str(err))
    if world.is_main:
        (out / "config.json").write_text(json.dumps(dict(source=data.source, max_length=L, vocab_size=len(data.vocab),
                                                         world_size=world.size, runs=[c.to_dict() for c in configs]),
                                                    indent=1))
    results = {}
    for config in configs:
        try:
            results[config.head] = run_one(config, data, out / config.head, L, progress=not args.quiet,
                                           eval_contexts=args.eval_contexts, world=world,
                                           greedy_L=greedy_length(args, config))
        except Diverged as err:  # not a usage error: the run itself failed (on every rank alike)
            sys.exit(f"python -m train: {err}")
    if world.is_main:
        notes = [f"Data: {data.source}; vocabulary {len(data.vocab)} words. Model: {base.arch}, size {base.size}; "
                 f"ε = {base.eps}; seed {base.seed}; {world.size} process(es).",
                 "Reproduce: `" + " ".join(["python -m train", *(sys.argv[1:] if argv is None else argv)]) + "`"]
        write_report(out, results, "VA vs ST vs NMST", notes)
        print(f"report: {out / 'report.md'}", flush=True)
    return out


if __name__ == "__main__":
    main()
