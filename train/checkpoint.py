"""Checkpoints: written atomically, and self-describing (head, ε, vocabulary, recipe).

A checkpoint carries everything needed to rebuild the model exactly as trained, so
evaluation can never score an NMST model as vanilla, and a run resumed from it
continues the same trajectory (optimizer, LR schedule state, RNG state).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from nmst_fast.data.wikitext import Vocabulary
from nmst_fast.models.recurrent import RecurrentLM

from .config import TrainConfig

FORMAT = 1


def save_atomic(obj: Any, path: str | Path) -> None:
    """torch.save to a temporary file in the same directory, then rename over ``path``.

    A crash mid-write leaves the previous checkpoint intact (rename is atomic on POSIX).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # same directory: the rename cannot cross filesystems
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --- directories swapped in whole (Hugging Face models: config, weights, tokenizer) ---------------------

def recover_model_dir(path: Path) -> None:
    """Undo a swap :func:`save_model_atomic` did not finish: a crash between its two renames leaves
    ``path.old`` (the previous model, complete) and no ``path``."""
    old = path.with_name(path.name + ".old")
    if not path.exists() and old.exists():
        os.replace(old, path)


def holds_tokenizer(path: Path) -> bool:
    """Whether the directory ``path`` has the files :func:`load_tokenizer` reads (tokenizer.json or
    tokenizer_config.json, or GPT-2's vocab.json + merges.txt)."""
    return any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")) or all(
        (path / name).is_file() for name in ("vocab.json", "merges.txt"))


def fsync_path(path: Path) -> None:
    """Flush the file or directory ``path`` to disk (directories: POSIX only, where a rename is made durable so)."""
    if path.is_dir() and os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_directory(path: Path, write: Callable[[Path], None]) -> None:
    """Fill a fresh directory with ``write(tmp)``, flush it to disk, then swap it in for ``path``: a
    crash or an error never leaves half a directory at ``path`` (at worst the previous one as
    ``path.old``, which :func:`recover_model_dir` puts back), and a failed ``write`` leaves nothing."""
    recover_model_dir(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        for file in sorted(tmp.rglob("*")):
            fsync_path(file)
        fsync_path(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_path(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def save_model_atomic(model, path: Path, state_dict: Optional[dict] = None, *, tokenizer) -> None:
    """save_pretrained of the model (of ``state_dict``, default the model's own) and of ``tokenizer`` into
    one directory, swapped in whole at ``path`` (:func:`publish_directory`): config.json (with its "nmst" head
    settings), weights and tokenizer files, which ``from_pretrained``, ``vllm serve`` and lm-eval read
    from that one path."""
    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, state_dict=None if state_dict is None else dict(state_dict))  # it pops entries
        tokenizer.save_pretrained(tmp)

    publish_directory(path, write)


def add_tokenizer(path: Path, tokenizer) -> None:
    """Put ``tokenizer``'s files beside a saved model that lacks them (a run directory written when the
    tokenizer had a directory of its own), swapped in whole as :func:`save_model_atomic` does: the
    model's files are hard-linked (copied where links fail) into the new directory, not rewritten."""
    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    def write(tmp: Path) -> None:
        shutil.copytree(path, tmp, copy_function=link_or_copy)
        tokenizer.save_pretrained(tmp)

    publish_directory(path, write)


class Diverged(RuntimeError):
    """Training produced a non-finite loss, gradient or validation perplexity: the run cannot go on
    (a lower learning rate usually helps). The checkpoint keeps the last epoch that finished finite."""


def require_finite(value: float, what: str) -> float:
    """``value`` if finite, else :class:`Diverged` naming ``what`` (e.g. "the training loss at epoch 2, batch 5")."""
    if not math.isfinite(value):
        raise Diverged(f"{what} is {value}: training diverged (try a lower --lr); the checkpoint, if any, "
                       "keeps the last epoch that finished")
    return value


def data_fingerprint(*splits: Sequence[Sequence[int]]) -> str:
    """A short hash of encoded splits (token ids and sequence lengths, in order): a resumed run must
    see the data it was trained on, and a changed corpus, split or tokenizer changes this."""
    digest = hashlib.sha256()
    for sequences in splits:
        lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        tokens = np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64, count=int(lengths.sum()))
        digest.update(lengths.tobytes())
        digest.update(tokens.tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:16]


def claim_directory(out: Path, identity: Mapping[str, Any], record: Mapping[str, Any] = {}) -> None:
    """Make ``out`` the home of the run ``identity`` describes (its entry point and data), or refuse.

    A new or empty directory is claimed (``run.json``, written atomically); one that already holds
    this run is resumed; one holding another kind of run, or a run on other data, raises ValueError
    before anything is written, so its results are never overwritten. A path that cannot be a
    directory raises ValueError naming it. ``record`` (e.g. the world size) is written beside the
    identity but does not bind the directory: a run may resume under other values."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out {str(out)!r} cannot be made a directory: {err.strerror or err}") from None
    marker = out / "run.json"
    if marker.exists():
        try:
            saved = json.loads(marker.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{marker} is unreadable ({err}): write the run to another --out") from None
        refuse_another_run(marker, saved, identity)
    elif any(out.iterdir()):
        raise ValueError(f"--out {str(out)!r} already holds files but no run.json: it is not a run this "
                         "command wrote; write the run to another --out")
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dict(identity) | dict(record), indent=1))
    os.replace(tmp, marker)


def refuse_another_run(path: str | Path, saved: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """Raise ValueError when the run saved at ``path`` (its run-defining settings ``saved``) is not the
    one asked for (``now``, the same keys): resuming it would continue another run's trajectory,
    or report its weights under the new settings. A missing setting (an older file) differs too."""
    differ = [f"{name}={saved.get(name, '(unrecorded)')!r} (now {value!r})" for name, value in now.items()
              if name not in saved or saved[name] != value]
    if differ:
        raise ValueError(f"{path} holds a run with {', '.join(differ)}: resume it with its own settings, "
                         "or write the new run to another --out")


def build_model(config: TrainConfig, vocab: Vocabulary) -> RecurrentLM:
    return RecurrentLM(len(vocab), eos_index=vocab.eos, arch=config.arch, head=config.head, eps=config.eps,
                       pad_index=vocab.pad, **config.model_kwargs()).to(config.device)


def load_checkpoint(path: str | Path, vocab: Optional[Vocabulary] = None, *, lazy: bool = False) -> dict:
    """The checkpoint's contents; ``vocab``, if given, must equal the one it was trained with.
    ``lazy``: tensors are memory-mapped, not read (checks of its settings; keep the result short-lived)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=lazy)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"{path} is not an nmst-fast training checkpoint (format {FORMAT})")
    trained_vocab = Vocabulary.from_json(ckpt["vocab"])
    if vocab is not None and trained_vocab != vocab:
        raise ValueError(f"checkpoint {path} was trained with a different vocabulary "
                         f"({len(trained_vocab)} words vs {len(vocab)} here); refusing to mix them")
    ckpt["vocab"] = trained_vocab
    ckpt["config"] = TrainConfig.from_dict(ckpt["config"])
    return ckpt


def load_model(path: str | Path, vocab: Optional[Vocabulary] = None, *,
               best: bool = True) -> tuple[RecurrentLM, Vocabulary, TrainConfig]:
    """Rebuild a trained model with the head and ε it was trained with (best weights by default)."""
    ckpt = load_checkpoint(path, vocab)
    model = build_model(ckpt["config"], ckpt["vocab"])
    model.load_state_dict(ckpt["best_model" if best else "model"])
    return model, ckpt["vocab"], ckpt["config"]
