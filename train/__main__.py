"""Train VA / ST / NMST language models and compare them: ``python -m train``.

    python -m train                                   # built-in corpus, a few minutes on a CPU
    python -m train --data-dir ../shared/data/wikitext-2 --train-split valid --eval-split test
    python -m train --data-dir DIR --size paper --max-epochs 70 --device cuda   # the paper's scale

Writes to ``--out`` (default ``runs/<time>``): ``results.json`` (per head: test ``perplexity``
and ``r_nt`` per decoder as L → ratio, plus p(eos) vs t, lengths and examples),
``report.md``, ``r_nt.png``, ``p_eos.png``, ``lengths.png``, ``config.json``, and one
checkpoint per head (``<head>/checkpoint.pt``); rerunning with the same ``--out`` resumes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from nmst_fast.data.wikitext import Vocabulary, encode_lines, find_split_file, read_lines
from nmst_fast.validation import HEADS

from .config import SIZES, TrainConfig
from .corpus import builtin_splits
from .evaluate import evaluate
from .loop import train
from .report import write_report

# The built-in run: small enough for minutes on a laptop-class CPU, long enough to separate
# the heads (ε = 0.01: NMST's greedy bound t½ = 69 sits well inside L = 1000).
BUILTIN = dict(size="tiny", max_epochs=6, eps=1e-2, max_length=1000)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="output directory (default: runs/<date-time>)")
    p.add_argument("--data-dir", type=Path, help="WikiText directory (wiki.*.tokens or *.txt); default: built-in corpus")
    p.add_argument("--train-split", default="train")
    p.add_argument("--valid-split", default="valid",
                   help="early-stopping split; if it is the training split, 10%% of its lines are held out")
    p.add_argument("--eval-split", default="test")
    p.add_argument("--heads", nargs="+", default=list(HEADS), metavar="HEAD", help=f"from {list(HEADS)}")
    p.add_argument("--arch", default="lstm", help="lstm or rnn")
    p.add_argument("--size", default=None, help=f"model size, one of {list(SIZES)} (built-in: tiny, else small)")
    p.add_argument("--eps", type=float, default=None, help="ε of ST/NMST (default 0.01)")
    p.add_argument("--max-epochs", type=int, default=None, help="default: 6 on the built-in corpus, else 70")
    p.add_argument("--patience", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-length", type=int, default=None, help="largest L of r_nt(L) (default 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def _load_text(args) -> tuple[dict[str, list[str]], str]:
    """Lines of the train / valid / eval splits and a description of where they came from."""
    if args.data_dir is None:
        splits = builtin_splits(args.seed)
        return {"train": splits["train"], "valid": splits["valid"], "eval": splits["test"]}, "built-in prefix corpus"
    train_lines = read_lines(find_split_file(args.data_dir, args.train_split))
    eval_lines = read_lines(find_split_file(args.data_dir, args.eval_split))
    if args.valid_split == args.train_split:  # hold out every 10th line for early stopping
        valid_lines = train_lines[::10]
        train_lines = [line for i, line in enumerate(train_lines) if i % 10]
    else:
        valid_lines = read_lines(find_split_file(args.data_dir, args.valid_split))
    source = f"WikiText in {args.data_dir} (train: {args.train_split}, valid: {args.valid_split}, eval: {args.eval_split})"
    return {"train": train_lines, "valid": valid_lines, "eval": eval_lines}, source


def main(argv: list[str] | None = None) -> Path:
    parser = _parser()
    args = parser.parse_args(argv)
    builtin = args.data_dir is None
    base = TrainConfig(arch=args.arch, eps=args.eps if args.eps is not None else BUILTIN["eps"],
                       size=args.size or (BUILTIN["size"] if builtin else "small"),
                       max_epochs=args.max_epochs or (BUILTIN["max_epochs"] if builtin else 70),
                       patience=args.patience, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                       device=args.device)
    max_length = args.max_length or BUILTIN["max_length"]
    try:  # bad arguments and missing data end in one clear line, not a traceback
        configs = [replace(base, head=h).validate() for h in args.heads]
        if max_length < 1:
            raise ValueError(f"--max-length must be positive, got {max_length}")
        text, source = _load_text(args)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    vocab = Vocabulary.from_lines(text["train"])
    encoded = {split: encode_lines(lines, vocab) for split, lines in text.items()}
    out = args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dict(source=source, max_length=max_length, vocab_size=len(vocab),
                                                     runs=[c.to_dict() for c in configs]), indent=1))
    results = {}
    for config in configs:
        try:
            model, state = train(config, encoded["train"], encoded["valid"], vocab, out / config.head / "checkpoint.pt",
                                 progress=not args.quiet)
        except ValueError as err:  # e.g. a checkpoint in --out from another vocabulary
            parser.error(str(err))
        print(f"{config.head}: {state.epoch} epochs, best valid perplexity {state.best_perplexity:.3f}", flush=True)
        results[config.head] = dict(evaluate(model, vocab, valid=encoded["valid"], test=encoded["eval"],
                                             max_length=max_length, seed=config.seed, device=config.device),
                                    history=state.history, eps=config.eps, greedy_bound=config.greedy_bound)
    notes = [f"Data: {source}; vocabulary {len(vocab)} words. Model: {base.arch}, size {base.size}; "
             f"ε = {base.eps}; seed {base.seed}.",
             "Reproduce: `" + " ".join(["python -m train", *(sys.argv[1:] if argv is None else argv)]) + "`"]
    write_report(out, results, "VA vs ST vs NMST", notes)
    print(f"report: {out / 'report.md'}", flush=True)
    return out


if __name__ == "__main__":
    main()
