"""The training loop: the paper's recipe, readable top to bottom, resumable after a crash.

Each epoch: shuffle into batches of lines of similar length (an order derived from the
seed and the epoch, so a resumed run sees the same batches), one pass of AdamW steps with
gradient clipping, then the validation perplexity. No improvement → halve the LR; `patience` epochs without
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
from nmst_fast.data.bpe import bucket_batches, collate_bpe
from nmst_fast.data.wikitext import CONTEXT_LENGTH, Vocabulary, collate
from nmst_fast.integrations.hf import class_labels

from .checkpoint import (
    FORMAT,
    build_model,
    load_checkpoint,
    refuse_another_run,
    require_finite,
    save_atomic,
    save_model_atomic,
)
from .config import TrainConfig
from .distributed import World, all_sum, barrier, full_state, replicate, share


@dataclass
class TrainState:
    epoch: int = 0  # epochs completed
    lr: float = 0.0
    best_perplexity: float = math.inf
    epochs_without_improvement: int = 0
    history: list = field(default_factory=list)  # per epoch: train loss, valid perplexity, lr


def batches(sequences: list[list[int]], vocab: Vocabulary, batch_size: int, order: Optional[torch.Tensor] = None,
            world: World = World()):
    """Padded :class:`~nmst_fast.data.wikitext.Batch` es of ``batch_size`` sequences in ``order``
    (default: as given); with several ranks, this rank's share of each such global batch.

    Targets that are context padding (``<cpad>``) are ignored: they carry no text to learn. A rank
    whose share of a global batch is empty gets its first sequence with every target ignored, so
    every rank takes every step (DDP's gradient all-reduce needs them all) and adds nothing to it.
    """
    index = order.tolist() if order is not None else list(range(len(sequences)))
    cpad = vocab.ids["<cpad>"]
    for start in range(0, len(index), batch_size):
        step = index[start:start + batch_size]
        mine = share(step, world)
        batch = collate([sequences[i] for i in (mine or step[:1])], pad_id=vocab.pad)
        batch.targets[batch.targets == cpad] = -100
        if not mine:
            batch.targets.fill_(-100)
        yield batch


@torch.no_grad()
def perplexity(model, sequences: list[list[int]], vocab: Vocabulary, batch_size: int = 64,
               device: str = "cpu", world: World = World()) -> float:
    """exp(mean NLL) over the tokens after the context (t >= 1, eos included); context excluded.
    With several ranks each scores its share of ``sequences`` and the sums are reduced."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in batches(share(sequences, world), vocab, batch_size):
        targets = torch.where(batch.steps >= 1, batch.targets, -100)
        total += float(model.loss(batch.inputs.to(device), targets.to(device), steps=batch.steps.to(device),
                                  reduction="sum"))
        count += int((targets != -100).sum())
    model.train(was_training)
    total, count = all_sum([total, count], world).tolist()
    if count == 0:
        raise ValueError("no tokens after the context to score: every sequence is context only (or none)")
    return metrics.perplexity(total, count)


class SummedLoss(torch.nn.Module):
    """A model's summed loss as its ``forward``: the module DDP wraps (it arms its gradient
    all-reduce in ``forward``, and :meth:`RecurrentLM.loss` is not ``forward``)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        return self.model.loss(inputs, targets, steps=steps, reduction="sum")


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


def _epoch_seed(config: TrainConfig, epoch: int) -> int:
    return config.seed * 1_000_003 + epoch


# Batches are cut from pools of this many batches' worth of randomly drawn lines, each pool sorted
# by length: a batch holds lines of similar length, so little of it is padding (WikiText lines run
# from 0 to ~700 words: a random batch of 32 was ~85% padding, which the LSTM and the loss process
# like text), while every epoch forms new batches.
POOL_BATCHES = 50


def epoch_order(config: TrainConfig, epoch: int, lengths: list[int]) -> torch.Tensor:
    """(n,) int64 order of the training sequences for ``epoch``: consecutive runs of
    ``config.batch_size`` are the epoch's batches (the one short batch, if any, last)."""
    gen = torch.Generator().manual_seed(_epoch_seed(config, epoch))
    drawn = torch.randperm(len(lengths), generator=gen).tolist()
    size, pool = config.batch_size, POOL_BATCHES * config.batch_size
    groups = []
    for start in range(0, len(drawn), pool):
        by_length = sorted(drawn[start:start + pool], key=lambda i: lengths[i])
        groups += [by_length[i:i + size] for i in range(0, len(by_length), size)]
    short = [groups.pop()] if groups and len(groups[-1]) < size else []
    shuffled = [groups[g] for g in torch.randperm(len(groups), generator=gen).tolist()] + short
    return torch.tensor([i for group in shuffled for i in group], dtype=torch.long)


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
    world: World = World(),
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
        world: this process's rank (:func:`train.distributed.init`). With several ranks the model is
            wrapped in DDP, each rank takes its share of every global batch of ``config.batch_size``
            sequences, and the loss is divided by the global count of supervised tokens, so the
            update is one process's on the whole batch (dropout masks aside); rank 0 alone writes
            ``checkpoint``, and every rank reads it to resume.
    Raises:
        Diverged: a non-finite training loss, gradient norm or validation perplexity; the
            checkpoint keeps the last finished epoch (nothing non-finite is saved).
    """
    config.validate()
    torch.manual_seed(config.seed)  # the same initial weights on every rank
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
    step_loss = replicate(SummedLoss(model), world)
    lengths = [len(seq) for seq in train_sequences]
    epochs_run = 0
    while state.epoch < config.max_epochs and state.epochs_without_improvement < config.patience:
        if stop_after is not None and epochs_run >= stop_after:
            break
        for group in optimizer.param_groups:
            group["lr"] = state.lr
        # Dropout draws from a generator seeded per (epoch, rank): a resumed run continues exactly,
        # and ranks draw independent masks.
        torch.manual_seed(_epoch_seed(config, state.epoch) * 4099 + world.rank)
        model.train()
        order = epoch_order(config, state.epoch, lengths)
        total, count = 0.0, 0
        bar = tqdm(batches(train_sequences, vocab, config.batch_size, order, world),
                   disable=not (progress and world.is_main),
                   total=math.ceil(len(train_sequences) / config.batch_size),
                   desc=f"{config.head} epoch {state.epoch + 1}", leave=False)
        for batch_no, batch in enumerate(bar, start=1):
            where = f"{config.head}: epoch {state.epoch + 1}, batch {batch_no}"
            targets = batch.targets.to(config.device)
            summed = step_loss(batch.inputs.to(config.device), targets, batch.steps.to(config.device))
            # One all-reduce: the global loss (every rank judges the same value) and its token count.
            global_sum, tokens = all_sum([summed.item(), int((targets != -100).sum())], world).tolist()
            tokens = tokens or 1.0  # a batch with nothing to score adds nothing (and divides by nothing)
            # Checked before the step: a NaN would reach every weight through AdamW.
            value = require_finite(global_sum / tokens, f"the training loss ({where})")
            optimizer.zero_grad(set_to_none=True)
            # DDP averages the ranks' gradients: × world size makes that the global sum / tokens.
            (summed * (world.size / tokens)).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)
            require_finite(float(norm), f"the gradient norm ({where})")
            optimizer.step()
            total, count = total + value, count + 1
            bar.set_postfix(loss=f"{total / count:.3f}")
        valid_ppl = require_finite(perplexity(model, valid_sequences, vocab, device=config.device, world=world),
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
        if world.is_main:
            save_atomic(dict(format=FORMAT, config=config.to_dict(), vocab=vocab.to_json(),
                             context_length=CONTEXT_LENGTH, data=data_id, model=model.state_dict(),
                             best_model=best_weights, optimizer=optimizer.state_dict(), state=asdict(state)),
                        checkpoint)
        barrier(world)  # no rank leaves (and resumes) before the checkpoint it would read is written
    model.load_state_dict(best_weights)
    return model, state


# --- Hugging Face models (python -m train.hf): token batches, the global-batch step, the epochs -------------

def token_batches(seqs: list[list[int]], max_tokens: int, seed: int, pad_id: int, shuffle: bool = True,
             world: World = World()):
    """(this rank's share of each length-bucketed global batch, the global batch's count of predicted
    tokens). A rank whose share is empty gets the batch's first row with every label ignored, so every
    rank runs every step (DDP's and FSDP's collectives need them all) and adds nothing to it."""
    for index in bucket_batches([len(s) for s in seqs], max_tokens=max_tokens, seed=seed, shuffle=shuffle):
        mine = share(index, world)
        batch = collate_bpe([seqs[i] for i in (mine or index[:1])], pad_id)
        if not mine:
            batch.labels.fill_(-100)
        yield batch, sum(len(seqs[i]) - 1 for i in index)  # HF shifts labels: the first token is not predicted


@torch.no_grad()
def token_perplexity(model, seqs: list[list[int]], context_length: int, max_tokens: int, pad_id: int, device: str,
               world: World = World()) -> float:
    """exp(mean NLL) of the tokens after the context (eos included); with several ranks each scores its
    share of every batch (in step, as a sharded model needs) and the sums are reduced."""
    model.eval()
    total, count = 0.0, 0
    no_logits = torch.empty(0, dtype=torch.long)  # logits_to_keep: no position's logits, the loss alone
    for batch, _ in token_batches(seqs, max_tokens, 0, pad_id, shuffle=False, world=world):
        labels = batch.labels.clone()
        labels[:, :context_length] = -100  # the context is given, not predicted
        with torch.no_grad():  # no gradient formed, and no (B, T, V) logits: the fused loss's forward alone
            out = model(batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                        labels=class_labels(model, labels).to(device), num_items_in_batch=1,  # = the summed NLL
                        logits_to_keep=no_logits)
        total += float(out.loss)
        count += int((labels[:, 1:] != -100).sum())
    total, count = all_sum([total, count], world).tolist()
    return metrics.perplexity(total, count)  # inf, not OverflowError, past a mean NLL of ~709.8


def backward(step, batch, tokens: int, world: World, device: str, where: str = "", bf16: bool = False) -> float:
    """Forward and backward of this rank's share ``batch`` of a global batch with ``tokens`` predicted
    tokens, through ``step`` (:func:`~train.distributed.shard`). The rank's summed loss is divided by ``tokens``, so the
    ranks' losses add up to the global mean; DDP and FSDP average the ranks' gradients, so it is
    multiplied by the world size before backward: the gradient is one process's on the global batch.
    Returns the global mean loss (the same on every rank); Diverged, before backward, if it is not finite.
    ``bf16``: the forward under ``torch.autocast`` in bfloat16."""
    labels = class_labels(getattr(step, "module", step), batch.labels)  # DDP wraps the model as .module
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
        loss = step(batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                    labels=labels.to(device), num_items_in_batch=tokens).loss
    value = require_finite(float(all_sum([loss.item()], world)), f"the training loss ({where})")
    (loss * world.size).backward()
    return value


def train_epochs(args, model, step, optimizer, schedule, seqs, pad, steps_per_epoch, out, settings, best, history,
                  start_epoch, world: World, tokenizer):
    """The epochs from ``start_epoch``: AdamW steps through ``step`` (``model`` itself, or DDP over it),
    then the validation perplexity, the best model and the resumable state, each saved atomically by
    rank 0 (the models with ``tokenizer`` beside them). Returns (best valid perplexity, history, whether
    every epoch ran: False when ``--stop-after`` interrupted). Raises Diverged on a non-finite loss,
    gradient norm or validation perplexity (on every rank alike), before anything non-finite is saved."""
    for epoch in range(start_epoch, args.epochs):
        if args.stop_after is not None and epoch - start_epoch >= args.stop_after:
            return best, history, False
        model.train()
        # Dropout draws from a generator seeded per (epoch, rank): a resumed run continues exactly,
        # and ranks draw independent masks.
        torch.manual_seed((args.seed * 1_000_003 + epoch) * 4099 + world.rank)
        bar = tqdm(token_batches(seqs["train"], args.max_tokens, args.seed * 1_000_003 + epoch, pad, world=world),
                   total=steps_per_epoch, disable=args.quiet or not world.is_main,
                   desc=f"{args.head} epoch {epoch + 1}")
        for batch_no, (batch, tokens) in enumerate(bar, start=1):
            where = f"epoch {epoch + 1}, batch {batch_no}"
            optimizer.zero_grad(set_to_none=True)
            value = backward(step, batch, tokens, world, args.device, where, getattr(args, "bf16", False))
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            require_finite(grad_norm, f"the gradient norm ({where})")
            optimizer.step()
            schedule.step()
            bar.set_postfix(loss=f"{value:.3f}")
        valid = token_perplexity(model, seqs["valid"], args.context_length, args.max_tokens, pad, args.device, world)
        require_finite(valid, f"the validation perplexity (epoch {epoch + 1})")
        history.append(dict(epoch=epoch + 1, valid_perplexity=valid))
        weights, optimizer_state = full_state(model, optimizer)
        if world.is_main:
            if valid < best:
                save_model_atomic(model, out / "model", weights, tokenizer=tokenizer)
            save_atomic(dict(epoch=epoch + 1, best=min(best, valid), history=history, settings=settings,
                             model=weights, optimizer=optimizer_state, schedule=schedule.state_dict()),
                        out / "train_state.pt")
            save_model_atomic(model, out / "last", weights, tokenizer=tokenizer)  # the latest, as model/ is
        best = min(best, valid)
        barrier(world)  # no rank reads the files (to resume or evaluate) before they are written
    return best, history, True
