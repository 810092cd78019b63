"""Pieces shared by ``python -m train`` and ``python -m train.sweep``: arguments, data, one run."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from nmst_fast import termination_bound
from nmst_fast.data.wikitext import Vocabulary, encode_lines, find_split_file, hub_lines, read_lines

from .checkpoint import data_fingerprint
from .config import SIZES, TrainConfig
from .corpus import builtin_splits
from .distributed import DEFAULT_TIMEOUT_MINUTES, World
from .evaluate import evaluate
from .loop import check_resume, train

# The built-in run: small enough for about a minute on 2 CPU cores, long enough to separate
# the heads (ε = 0.01: NMST's greedy bound t½ = 69 sits well inside L = 1000).
BUILTIN = dict(size="tiny", max_epochs=6, eps=1e-2, max_length=1000)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Data, model and recipe arguments (not heads / ε / seeds / arch, which differ by command)."""
    p.add_argument("--out", type=Path, help="output directory (default: runs/<date-time>)")
    p.add_argument("--data-dir", type=Path,
                   help="WikiText directory (wiki.*.tokens or *.txt); default: built-in corpus")
    p.add_argument("--dataset", choices=["wikitext-2", "wikitext-103"],
                   help="read WikiText through the `datasets` library (needs it installed and online) instead")
    p.add_argument("--train-split", default="train")
    p.add_argument("--valid-split", default="valid",
                   help="early-stopping split; if it is the training split, every 10th line is held out")
    p.add_argument("--eval-split", default="test")
    p.add_argument("--builtin-lines", type=int, default=3000,
                   help="training lines of the built-in corpus (valid and test get a tenth each)")
    p.add_argument("--size", default=None, help=f"model size, one of {list(SIZES)} (built-in: tiny, else small)")
    p.add_argument("--max-epochs", type=int, default=None, help="default: 6 on the built-in corpus, else 70")
    p.add_argument("--patience", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-length", type=int, default=None, help="largest L of r_nt(L) (default 1000)")
    p.add_argument("--greedy-length", type=int, default=None,
                   help="largest L of greedy r_nt(L) (default: --max-length, or for ST and NMST the greedy "
                        "bound t½ of the run's ε if that is larger: the step by which greedy NMST must stop)")
    p.add_argument("--eval-contexts", type=int, default=None,
                   help="decode only the first N evaluation contexts for r_nt (default: all, as the paper)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_distributed_arguments(p)


def add_distributed_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dist-timeout", type=float, default=DEFAULT_TIMEOUT_MINUTES, metavar="MINUTES",
                   help="under torchrun: how long a collective waits for the other ranks before the run "
                        "ends with an error")


def is_builtin(args) -> bool:
    return args.data_dir is None and args.dataset is None


def base_config(args, *, arch: str, eps: float | None, seed: int) -> TrainConfig:
    builtin = is_builtin(args)
    # `is None`, not `or`: a 0 the user gave must reach validation, not turn into the default.
    return TrainConfig(arch=arch, eps=eps if eps is not None else BUILTIN["eps"],
                       size=args.size if args.size is not None else (BUILTIN["size"] if builtin else "small"),
                       max_epochs=args.max_epochs if args.max_epochs is not None else
                       (BUILTIN["max_epochs"] if builtin else 70),
                       patience=args.patience, batch_size=args.batch_size, lr=args.lr, seed=seed, device=args.device)


def max_length(args) -> int:
    L = args.max_length if args.max_length is not None else BUILTIN["max_length"]
    if L < 1:
        raise ValueError(f"--max-length must be positive, got {L}")
    return L


def greedy_length(args, config: TrainConfig) -> int:
    """Largest L of a run's greedy r_nt(L): ``--greedy-length``, else ``max_length(args)`` or, for ST
    and NMST, t½ of the run's ε if that is larger, so a greedy NMST curve reaches the step by which
    every continuation must have stopped."""
    if args.greedy_length is not None:
        return args.greedy_length
    L = max_length(args)
    return L if config.head == "va" else max(L, termination_bound(config.eps))


def canonical_split(name: str) -> str:
    """WikiText's validation split goes by two names (``find_split_file`` reads either)."""
    return "valid" if name == "validation" else name


SPLIT_DEFAULTS = dict(train_split="train", valid_split="valid", eval_split="test")


def check_arguments(args) -> None:
    """What the flags must satisfy together, checked before any data is read or model trained."""
    if args.dataset is not None and args.data_dir is not None:
        raise ValueError("give --data-dir or --dataset, not both")
    if is_builtin(args) and any(getattr(args, k) != v for k, v in SPLIT_DEFAULTS.items()):
        raise ValueError("--train-split / --valid-split / --eval-split choose WikiText splits: they need --data-dir "
                         "or --dataset (the built-in corpus has its own three splits)")
    if canonical_split(args.eval_split) == canonical_split(args.train_split):
        raise ValueError(f"--eval-split {args.eval_split!r} is the training split: evaluation needs held-out text")
    L = max_length(args)
    if args.greedy_length is not None and args.greedy_length < L:
        raise ValueError(f"--greedy-length must be at least --max-length ({L}), got {args.greedy_length}")
    if args.eval_contexts is not None and args.eval_contexts < 1:
        raise ValueError(f"--eval-contexts must be a positive int, got {args.eval_contexts}")
    check_device(args.device)
    check_dist_timeout(args.dist_timeout)


def check_dist_timeout(minutes: float) -> None:
    if not minutes > 0:
        raise ValueError(f"--dist-timeout must be a positive number of minutes, got {minutes}")


def check_device(device: str) -> None:
    try:
        kind = torch.device(device).type
    except RuntimeError as err:
        raise ValueError(f"--device {device!r} is not a torch device: {err}") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r}: this torch has no CUDA device")


@dataclass
class Data:
    vocab: Vocabulary
    train: list[list[int]]
    valid: list[list[int]]
    eval: list[list[int]]
    source: str

    @cached_property
    def fingerprint(self) -> str:
        """What a checkpoint records of the data it was trained and early-stopped on (train and
        valid as encoded, so the vocabulary too): a resume on other data is refused."""
        return data_fingerprint(self.train, self.valid)


def load_data(args, seed: int = 0) -> Data:
    """Encoded train / valid / eval sequences; the vocabulary comes from the training lines."""
    held_out = canonical_split(args.valid_split) == canonical_split(args.train_split)
    if args.dataset is not None:
        splits = [("train", args.train_split), ("eval", args.eval_split)]
        text = {key: hub_lines(args.dataset, split) for key, split in
                splits + ([] if held_out else [("valid", args.valid_split)])}
        if held_out:
            text["train"], text["valid"] = _hold_out(text["train"])
        source = f"{args.dataset} from the Hugging Face hub"
    elif args.data_dir is None:
        n = args.builtin_lines
        if n < 10:
            raise ValueError(f"--builtin-lines must be at least 10, got {n}")
        splits = builtin_splits(seed, sizes=(n, n // 10, n // 10))
        text = {"train": splits["train"], "valid": splits["valid"], "eval": splits["test"]}
        source = "built-in prefix corpus"
    else:
        train_lines = read_lines(find_split_file(args.data_dir, args.train_split))
        eval_lines = read_lines(find_split_file(args.data_dir, args.eval_split))
        if held_out:
            train_lines, valid_lines = _hold_out(train_lines)
        else:
            valid_lines = read_lines(find_split_file(args.data_dir, args.valid_split))
        text = {"train": train_lines, "valid": valid_lines, "eval": eval_lines}
        source = (f"WikiText in {args.data_dir} (train: {args.train_split}, valid: {args.valid_split}, "
                  f"eval: {args.eval_split})")
    if held_out and not is_builtin(args):
        source += "; every 10th training line held out for early stopping"
    empty = [k for k, lines in text.items() if not lines]
    if empty:
        raise ValueError(f"no lines in the {' and '.join(empty)} split(s) of {source}")
    vocab = Vocabulary.from_lines(text["train"])
    return Data(vocab, *(encode_lines(text[k], vocab) for k in ("train", "valid", "eval")), source)


def _hold_out(lines: list[str]) -> tuple[list[str], list[str]]:
    """(training lines, every 10th line held out for early stopping): when the early-stopping split
    is the training split."""
    return [line for i, line in enumerate(lines) if i % 10], lines[::10]


def check_resumes(runs: list[tuple[TrainConfig, Path]], data: Data) -> None:
    """ValueError if some run directory holds a checkpoint of another run (settings, vocabulary or
    data): checked for every run before anything is written, reading each checkpoint's settings,
    not its weights (those are read once, by the run that resumes it)."""
    for config, run_dir in runs:
        check_resume(config, data.vocab, run_dir / "checkpoint.pt", data.fingerprint, lazy=True)


def run_one(config: TrainConfig, data: Data, run_dir: Path, L: int, *, progress: bool,
            eval_contexts: int | None = None, world: World = World(), greedy_L: int | None = None) -> dict:
    """Train (resuming from ``run_dir/checkpoint.pt`` if present) and evaluate one model (data-parallel
    over ``world``'s ranks; every rank returns the results): r_nt(L) up to ``L``, greedy's up to
    ``greedy_L`` (default ``L``)."""
    model, state = train(config, data.train, data.valid, data.vocab, run_dir / "checkpoint.pt", progress=progress,
                         data_id=data.fingerprint, world=world)
    if world.is_main:
        print(f"{config.arch}/{config.head}/eps={config.eps}/seed={config.seed}: {state.epoch} epochs, "
              f"best valid perplexity {state.best_perplexity:.3f}", flush=True)
    return dict(evaluate(model, data.vocab, valid=data.valid, test=data.eval, max_length=L, seed=config.seed,
                         greedy_length=greedy_L, device=config.device, contexts=eval_contexts, world=world),
                history=state.history, eps=config.eps, greedy_bound=config.greedy_bound, world_size=world.size)
