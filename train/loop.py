"""The training loop: the paper's recipe, readable top to bottom, resumable after a crash.

Each epoch: shuffle (an order derived from the seed and the epoch, so a resumed run
sees the same batches), one pass of AdamW steps with gradient clipping, then the
validation perplexity. No improvement → halve the LR; `patience` epochs without
improvement → stop. A checkpoint is written atomically after every epoch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from nmst_fast import metrics
from nmst_fast.data.wikitext import CONTEXT_LENGTH, Vocabulary, collate

from .checkpoint import FORMAT, build_model, load_checkpoint, refuse_another_run, require_finite, save_atomic
from .config import TrainConfig


@dataclass
class TrainState:
    epoch: int = 0  # epochs completed
    lr: float = 0.0
    best_perplexity: float = math.inf
    epochs_without_improvement: int = 0
    history: list = field(default_factory=list)  # per epoch: train loss, valid perplexity, lr


def batches(sequences: list[list[int]], vocab: Vocabulary, batch_size: int, order: Optional[torch.Tensor] = None):
    """Padded :class:`~nmst_fast.data.wikitext.Batch` es in ``order`` (default: as given).

    Targets that are context padding (``<cpad>``) are ignored: they carry no text to learn.
    """
    index = order.tolist() if order is not None else list(range(len(sequences)))
    cpad = vocab.ids["<cpad>"]
    for start in range(0, len(index), batch_size):
        batch = collate([sequences[i] for i in index[start:start + batch_size]], pad_id=vocab.pad)
        batch.targets[batch.targets == cpad] = -100
        yield batch


@torch.no_grad()
def perplexity(model, sequences: list[list[int]], vocab: Vocabulary, batch_size: int = 64,
               device: str = "cpu") -> float:
    """exp(mean NLL) over the tokens after the context (t >= 1, eos included); context excluded."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in batches(sequences, vocab, batch_size):
        targets = torch.where(batch.steps >= 1, batch.targets, -100)
        total += float(model.loss(batch.inputs.to(device), targets.to(device), steps=batch.steps.to(device),
                                  reduction="sum"))
        count += int((targets != -100).sum())
    model.train(was_training)
    if count == 0:
        raise ValueError("no tokens after the context to score: every sequence is context only (or none)")
    return metrics.perplexity(total, count)


# What a checkpoint's run is: resuming it under other values would continue another run's
# trajectory (or, when it had finished, evaluate its weights under the new labels). max_epochs,
# patience and device may change (train longer, elsewhere).
RUN_DEFINING = ("arch", "head", "eps", "size", "seed", "batch_size", "lr", "betas", "weight_decay", "clip")


def check_resume(config: TrainConfig, vocab: Vocabulary, checkpoint: str | Path, data_id: Optional[str],
                 *, lazy: bool = False) -> Optional[dict]:
    """The checkpoint at ``checkpoint`` (None if there is none) after checking it holds this run: the
    same vocabulary, run-defining settings and, when ``data_id`` is given, the same data
    (:func:`~train.checkpoint.data_fingerprint`); else ValueError. Entry points call it for every run
    before writing anything, so a refused resume changes no file; they pass ``lazy`` (tensors
    memory-mapped, not read: :func:`train` loads the one it resumes)."""
    checkpoint = Path(checkpoint)
    if not checkpoint.exists():
        return None
    ckpt = load_checkpoint(checkpoint, vocab, lazy=lazy)
    saved = {k: getattr(ckpt["config"], k) for k in RUN_DEFINING}
    now = {k: getattr(config, k) for k in RUN_DEFINING}
    if data_id is not None:
        saved["data"], now["data"] = ckpt.get("data"), data_id
    refuse_another_run(checkpoint, saved, now)
    return ckpt


def _epoch_order(config: TrainConfig, epoch: int, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(config.seed * 1_000_003 + epoch))


def train(
    config: TrainConfig,
    train_sequences: list[list[int]],
    valid_sequences: list[list[int]],
    vocab: Vocabulary,
    checkpoint: str | Path,
    *,
    progress: bool = True,
    stop_after: Optional[int] = None,
    data_id: Optional[str] = None,
):
    """Train (or resume, if ``checkpoint`` exists) and return (model with its best weights, state).

    Args:
        config: the run; checked with :meth:`TrainConfig.validate`.
        train_sequences / valid_sequences: encoded lines (see ``nmst_fast.data.wikitext``).
        checkpoint: file written after every epoch; an existing one is resumed (it must
            hold the same vocabulary).
        stop_after: return after this many epochs in this call (tests use it to interrupt).
        data_id: the data's fingerprint (:func:`~train.checkpoint.data_fingerprint`), saved in the
            checkpoint; a resume on other data is refused (None: not checked, not saved).
    Raises:
        Diverged: a non-finite training loss, gradient norm or validation perplexity; the
            checkpoint keeps the last finished epoch (nothing non-finite is saved).
    """
    config.validate()
    torch.manual_seed(config.seed)
    model = build_model(config, vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas,
                                  weight_decay=config.weight_decay)
    state = TrainState(lr=config.lr)
    best_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    checkpoint = Path(checkpoint)
    ckpt = check_resume(config, vocab, checkpoint, data_id)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        state = TrainState(**ckpt["state"])
        best_weights = ckpt["best_model"]
        torch.set_rng_state(ckpt["rng"])  # dropout continues exactly where it stopped
        if ckpt.get("cuda_rng") is not None and torch.device(config.device).type == "cuda":
            torch.cuda.set_rng_state_all(ckpt["cuda_rng"])  # dropout on a GPU draws from its own generator
    epochs_run = 0
    while state.epoch < config.max_epochs and state.epochs_without_improvement < config.patience:
        if stop_after is not None and epochs_run >= stop_after:
            break
        for group in optimizer.param_groups:
            group["lr"] = state.lr
        model.train()
        order = _epoch_order(config, state.epoch, len(train_sequences))
        total, count = 0.0, 0
        bar = tqdm(batches(train_sequences, vocab, config.batch_size, order), disable=not progress,
                   total=math.ceil(len(train_sequences) / config.batch_size),
                   desc=f"{config.head} epoch {state.epoch + 1}", leave=False)
        for batch_no, batch in enumerate(bar, start=1):
            where = f"{config.head}: epoch {state.epoch + 1}, batch {batch_no}"
            loss = model.loss(batch.inputs.to(config.device), batch.targets.to(config.device),
                              steps=batch.steps.to(config.device))
            # Checked before the step: a NaN would reach every weight through AdamW.
            value = require_finite(loss.item(), f"the training loss ({where})")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)
            require_finite(float(norm), f"the gradient norm ({where})")
            optimizer.step()
            total, count = total + value, count + 1
            bar.set_postfix(loss=f"{total / count:.3f}")
        valid_ppl = require_finite(perplexity(model, valid_sequences, vocab, device=config.device),
                                   f"the validation perplexity ({config.head}: epoch {state.epoch + 1})")
        state.history.append(dict(epoch=state.epoch + 1, train_loss=total / max(count, 1),
                                  valid_perplexity=valid_ppl, lr=state.lr))
        if valid_ppl < state.best_perplexity:
            state.best_perplexity, state.epochs_without_improvement = valid_ppl, 0
            best_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            state.epochs_without_improvement += 1
            state.lr /= 2
        state.epoch += 1
        epochs_run += 1
        save_atomic(dict(format=FORMAT, config=config.to_dict(), vocab=vocab.to_json(), context_length=CONTEXT_LENGTH,
                         data=data_id,
                         model=model.state_dict(), best_model=best_weights, optimizer=optimizer.state_dict(),
                         state=asdict(state), rng=torch.get_rng_state(),
                         cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None), checkpoint)
    model.load_state_dict(best_weights)
    return model, state
