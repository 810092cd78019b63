"""Train or fine-tune any Hugging Face causal LM with a VA / ST / NMST head on WikiText lines.

    python -m train.hf --data-dir DIR                                  # a tiny random-init Llama
    python -m train.hf --data-dir DIR --config qwen3 --size small      # another family, random init
    python -m train.hf --data-dir DIR --model-dir MODEL_DIR [--tokenizer-dir TOKENIZER_DIR]

The model is ``from_pretrained(--model-dir)`` (local files, no hub access) or a random-init
``--config FAMILY`` (any transformers ``model_type``) of ``--size`` tiny, small, base or large. The tokenizer is
``--tokenizer-dir`` (else the model directory's), or a byte-level BPE trained on the training lines
with the ``tokenizers`` library. Each line becomes " " + line + eos; the first ``--context-length``
tokens are context (t <= 0, p(eos) = 0), t = 1 at the next. The loss is the fused one
(:func:`nmst_fast.integrations.hf.apply_nmst`), so the (B, T, V) logits are never formed. Recipe
(the paper's GPT-2 one): AdamW, lr decaying linearly to 0, gradient clipping 1.0, length-bucketed
batches of at most ``--max-tokens`` tokens; the best model by validation perplexity is saved
(atomically) to ``--out/model`` with its head settings in the config and the tokenizer beside it:
one directory that ``from_pretrained`` (model and tokenizer), ``vllm serve`` and lm-eval take as it
is. After every epoch the latest weights (``--out/last``, laid out alike) and the optimizer /
schedule / RNG state are saved too, and rerunning with the same ``--out`` resumes (``run.json``
binds the directory to this command, its data and model shape: another run there is refused; a
non-finite loss, gradient or validation perplexity stops with an error). Evaluation and report as
``python -m train``: perplexity after the context, r_nt(L) for every decoder, teacher-forced p(eos)
vs t, continuation lengths and greedy examples, in ``results.json`` and ``report.md``, with
``r_nt.png``, ``p_eos.png`` and ``lengths.png``.

Under ``torchrun`` (:mod:`train.distributed`) every rank takes its share of each global batch and
the model is replicated with DDP, or sharded with FSDP2 (``--fsdp``); the update and the evaluation
are one process's, rank 0 writes the files (whole state dicts: a run resumes under any number of
processes), and ``run.json`` / ``results.json`` record the world size:

    torchrun --standalone --nproc_per_node 8 -m train.hf --data-dir DIR --model-dir MODEL_DIR --device cuda --fsdp
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from nmst_fast.data.bpe import bucket_batches, encode_bpe_lines, load_tokenizer, train_byte_level_bpe
from nmst_fast.data.wikitext import find_split_file, read_lines
from nmst_fast.integrations.hf import HFDecoder, apply_nmst
from nmst_fast.integrations.hf.structure import base_model_type
from nmst_fast.validation import HEADS

from .checkpoint import (
    Diverged,
    add_tokenizer,
    claim_directory,
    data_fingerprint,
    holds_tokenizer,
    recover_model_dir,
    refuse_another_run,
)
from .distributed import World, full_state_options, launch, on_main, shard
from .evaluate import greedy_examples, non_termination, token_eos_probability_by_step
from .loop import token_perplexity, train_epochs
from .report import write_report
from .runner import add_distributed_arguments, check_device, check_dist_timeout

# Random-init model sizes (--config FAMILY --size): generic config keys, which every family maps.
SIZES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024),
    # GPT-2 small's width (the fused-loss benchmarks' H = 768) at two layers: the gradient filter's trained workload.
    "base": dict(hidden_size=768, num_hidden_layers=2, num_attention_heads=12, intermediate_size=3072),
    # Gemma 2 2B's width (the large benchmarks' H = 2304) at two layers: with a 256000-token vocabulary
    # (tools/gguf_tokenizer.py rebuilds Command-R's) the gradient filter's trained workload at its large shape.
    "large": dict(hidden_size=2304, num_hidden_layers=2, num_attention_heads=18, intermediate_size=9216),
}
MAX_POSITIONS = 1024  # position table of a random-init model: context + the largest r_nt L


def parser(prog: str = "python -m train.hf", doc: str = __doc__, *, preset: bool = False) -> argparse.ArgumentParser:
    """The command's flags; ``preset`` (GPT-2's): a model and tokenizer directory are required."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=preset,
                   help="a from_pretrained directory (weights + config, and the tokenizer unless --tokenizer-dir), "
                        "e.g. a run's OUT/model")
    p.add_argument("--tokenizer-dir", type=Path, required=preset,
                   help="tokenizer files (tokenizer.json, or vocab.json + merges.txt); default: the model "
                        "directory's, or a byte-level BPE trained on the training lines")
    if not preset:
        p.add_argument("--config", default="llama", help="model_type of a random-init model (without --model-dir)")
        p.add_argument("--size", default="tiny", choices=list(SIZES))
        p.add_argument("--vocab-size", type=int, default=2048, help="of the BPE trained without --tokenizer-dir")
    p.add_argument("--data-dir", type=Path, required=True, help="WikiText directory (wiki.*.tokens or *.txt)")
    p.add_argument("--train-split", default="train")
    p.add_argument("--valid-split", default="valid")
    p.add_argument("--eval-split", default="test")
    p.add_argument("--head", default="nmst", choices=list(HEADS))
    p.add_argument("--eps", type=float, default=1e-5)
    p.add_argument("--context-length", type=int, default=10)
    p.add_argument("--lr", type=float, default=5e-5 if preset else None,
                   help="default: 5e-5 to fine-tune (--model-dir), 1e-3 from random init")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens (rows × longest row) per batch")
    p.add_argument("--max-length", type=int, default=1000, help="largest L of r_nt(L)")
    p.add_argument("--eval-contexts", type=int, default=None, help="decode only the first N contexts (default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true",
                   help="train under torch.autocast in bfloat16 (the weights and the optimizer stay float32)")
    p.add_argument("--grad-filter", type=_grad_filter, default=None,
                   help='the fused loss\'s gradient filter: "auto" (2^-12 in bf16; off in float32) or a threshold '
                        "(nmst_fast.linear_nmst_loss's grad_filter); default off")
    p.add_argument("--out", type=Path)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard the model with FSDP2 (fully_shard per decoder block, on the output "
                        "layer and the root) instead of replicating it with DDP")
    add_distributed_arguments(p)
    p.add_argument("--stop-after", type=int, help=argparse.SUPPRESS)  # tests: interrupt after N epochs
    return p


def _grad_filter(text: str):
    """--grad-filter's value: "auto" or a float."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'must be "auto" or a float, got {text!r}') from None


# The flags that define a run: resuming its state under other values would continue another run.
RUN_DEFINING = ("head", "eps", "context_length", "lr", "epochs", "max_tokens", "seed", "bf16", "grad_filter")


def _check_arguments(args) -> None:
    """Numeric flags and the device, before any data is read or model loaded."""
    if getattr(args, "vocab_size", 2) < 2:
        raise ValueError(f"--vocab-size must be at least 2, got {args.vocab_size}")
    for name in ("epochs", "context_length", "max_length", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive int, got {getattr(args, name)}")
    if args.eval_contexts is not None and args.eval_contexts < 1:
        raise ValueError(f"--eval-contexts must be a positive int, got {args.eval_contexts}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    if args.max_tokens <= args.context_length:
        raise ValueError(f"--max-tokens ({args.max_tokens}) must exceed --context-length ({args.context_length}): "
                         "a sequence is a context plus at least one token")
    check_device(args.device)
    check_dist_timeout(args.dist_timeout)


# The model settings a run directory is bound to (a resumed state must fit the model it came from).
MODEL_DEFINING = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _tokenizer(args, lines: list[str]):
    """--tokenizer-dir, else the model directory's, else a byte-level BPE trained on ``lines``."""
    if args.tokenizer_dir is not None:
        return load_tokenizer(args.tokenizer_dir)
    if args.model_dir is not None:
        return load_tokenizer(model_dirs_tokenizer(args.model_dir))
    return train_byte_level_bpe(lines, vocab_size=args.vocab_size)


def model_dirs_tokenizer(model_dir: Path) -> Path:
    """Where the tokenizer of ``--model-dir`` is: the directory itself, or, for a run's ``model`` /
    ``last`` written when the tokenizer was kept apart, the run's ``tokenizer`` directory beside it
    (a run directory: one holding ``run.json``). FileNotFoundError naming --tokenizer-dir otherwise."""
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    if holds_tokenizer(model_dir):
        return model_dir
    beside = model_dir.parent / "tokenizer"
    if (model_dir.parent / "run.json").is_file() and holds_tokenizer(beside):
        return beside
    raise FileNotFoundError(f"--model-dir {str(model_dir)!r} holds no tokenizer (tokenizer.json, "
                            "tokenizer_config.json, or vocab.json + merges.txt): pass --tokenizer-dir")


def _random_model(family: str, size: str, tokenizer):
    """A random-init causal LM of ``family`` whose vocabulary is the tokenizer's, eos its eos."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dims = dict(SIZES[size])
    default = AutoConfig.for_model(family)
    # Keys some families size apart from hidden_size (GQA heads, head_dim, OPT's ffn_dim): tie them to it.
    for key, value in (("num_key_value_heads", dims["num_attention_heads"]),
                       ("head_dim", dims["hidden_size"] // dims["num_attention_heads"]),
                       ("ffn_dim", dims["intermediate_size"]), ("n_inner", dims["intermediate_size"]),
                       ("word_embed_proj_dim", dims["hidden_size"])):
        if hasattr(default, key):
            dims[key] = value
    eos = tokenizer.eos_token_id
    config = AutoConfig.for_model(family, vocab_size=len(tokenizer), max_position_embeddings=MAX_POSITIONS,
                                  bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, **dims)
    return AutoModelForCausalLM.from_config(config)


def load_model(args, tokenizer):
    """The model to train, patched with the fused loss (eos: the tokenizer's, which ends every line)."""
    from transformers import AutoModelForCausalLM

    if args.model_dir is not None:
        if not args.model_dir.is_dir():
            raise FileNotFoundError(f"model directory {str(args.model_dir)!r} does not exist")
        model = AutoModelForCausalLM.from_pretrained(args.model_dir)
    else:
        model = _random_model(args.config, args.size, tokenizer)
    return apply_nmst(model, head=args.head, eps=args.eps, context_length=args.context_length,
                      eos_token_id=tokenizer.eos_token_id, grad_filter=args.grad_filter)


def _size(model) -> str:
    count = sum(p.numel() for p in model.parameters())
    return f"{count / 1e6:.2f}M" if count >= 1e5 else str(count)


def main(argv: list[str] | None = None, *, command: Optional[argparse.ArgumentParser] = None,
         entry: str = "train.hf") -> Path:
    """Run the command (``command``/``entry``: a preset's parser and name, as ``train.gpt2``'s)."""
    command = command or parser()
    args = command.parse_args(argv)
    if args.lr is None:
        args.lr = 5e-5 if args.model_dir is not None else 1e-3
    return launch(command, args, _check_arguments, lambda world: _run(command, args, entry, world))


def _run(command: argparse.ArgumentParser, args: argparse.Namespace, entry: str, world: World) -> Path:
    try:
        text = {k: read_lines(find_split_file(args.data_dir, split)) for k, split in
                (("train", args.train_split), ("valid", args.valid_split), ("eval", args.eval_split))}
        # Rank 0 trains the BPE (when there is none to load) and hands it to the others: one vocabulary.
        tokenizer = on_main(lambda: _tokenizer(args, text["train"]), world)
        torch.manual_seed(args.seed)  # the same random-init weights on every rank
        model = load_model(args, tokenizer).to(args.device)
        positions = HFDecoder(model).max_positions
        if positions is not None and args.context_length + args.max_length - 1 > positions:  # the last token is not fed
            raise ValueError(f"--context-length + --max-length - 1 = {args.context_length + args.max_length - 1} "
                             f"exceeds the model's {positions} positions")
    except (ValueError, FileNotFoundError, OSError) as err:
        command.error(str(err))
    # A line longer than the position table cannot be trained on (nor one over a batch's budget).
    longest = min(args.max_tokens, positions or args.max_tokens)
    seqs = {k: encode_bpe_lines(lines, tokenizer, min_tokens=args.context_length + 1, max_tokens=longest)
            for k, lines in text.items()}
    empty = [k for k, v in seqs.items() if not v]
    if empty:
        command.error(f"no sequence of {args.context_length + 1} to {longest} tokens in the "
                      f"{', '.join(empty)} split(s)")
    pad = tokenizer.eos_token_id
    data_id = data_fingerprint(seqs["train"], seqs["valid"])  # the corpus, splits and tokenizer

    def claim() -> Path:
        out = args.out or Path("runs") / (entry.split(".")[-1] + "-" + time.strftime("%Y%m%d-%H%M%S"))
        shape = {k: getattr(model.config, k) for k in MODEL_DEFINING} | dict(model_type=base_model_type(model.config))
        claim_directory(out, dict(entry=entry, data=data_id, model=shape),
                        record=dict(world_size=world.size, fsdp=args.fsdp))
        for saved in (out / "model", out / "last"):
            recover_model_dir(saved)
            # A run resumed from the layout that kept its tokenizer apart (in out/tokenizer, or not at
            # all with --model-dir): its models get this run's tokenizer, which encodes its data as
            # run.json records (claim_directory checked), so each is servable as it is.
            if saved.is_dir() and not holds_tokenizer(saved):
                add_tokenizer(saved, tokenizer)
        return out

    try:
        out = on_main(claim, world)
    except (ValueError, OSError) as err:
        command.error(str(err))
    state_path = out / "train_state.pt"
    settings = {name: getattr(args, name) for name in RUN_DEFINING} | dict(data=data_id)
    state = torch.load(state_path, weights_only=False) if state_path.exists() else None
    if state is not None:  # an interrupted run: continue from its last finished epoch
        try:
            refuse_another_run(state_path, state.get("settings", {}), settings)
        except ValueError as err:
            command.error(str(err))
        # The weights come from the state file itself, written in one piece with the optimizer and
        # epoch (``last/`` is a copy for users): a crash can never pair one epoch's weights with
        # another's optimizer.
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        # The form full_state saved (ties once).
        set_model_state_dict(model, state["model"], options=full_state_options())
    step = shard(model, world, args.fsdp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    steps_per_epoch = len(bucket_batches([len(s) for s in seqs["train"]], max_tokens=args.max_tokens))
    total_steps = max(1, args.epochs * steps_per_epoch)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / total_steps))
    best, history, start_epoch = math.inf, [], 0
    if state is not None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=full_state_options())
        schedule.load_state_dict(state["schedule"])
        best, history, start_epoch = state["best"], state["history"], state["epoch"]
    try:
        best, history, finished = train_epochs(args, model, step, optimizer, schedule, seqs, pad, steps_per_epoch,
                                                out, settings, best, history, start_epoch, world, tokenizer)
    except Diverged as err:  # not a usage error: the run itself failed (on every rank alike)
        sys.exit(f"{command.prog}: {err}")
    if not finished:  # --stop-after (tests)
        return out
    from transformers import AutoModelForCausalLM

    # Evaluated unsharded on every rank (inference needs no optimizer state): the best model, its recorded head.
    model = apply_nmst(AutoModelForCausalLM.from_pretrained(out / "model")).to(args.device).eval()
    decoded = seqs["eval"][: args.eval_contexts]
    contexts = torch.tensor([s[: args.context_length] for s in decoded], dtype=torch.long)
    decoding = non_termination(HFDecoder(model), contexts, args.max_length, seed=args.seed, device=args.device,
                               world=world)
    evaluation = dict(
        perplexity=token_perplexity(model, seqs["eval"], args.context_length, args.max_tokens, pad, args.device, world),
        valid_perplexity=best, r_nt={name: d["r_nt"] for name, d in decoding.items()}, history=history,
        eps=args.eps, generated_lengths={name: d["lengths"] for name, d in decoding.items()},
        data_lengths=[len(s) - args.context_length for s in decoded], world_size=world.size,
        p_eos=token_eos_probability_by_step(model, seqs["eval"], args.context_length, args.max_tokens, pad, args.device,
                                      world=world))
    if world.is_main:
        evaluation["examples"] = greedy_examples(model, tokenizer, seqs["eval"], args.context_length, args.device)
        notes = [f"`{command.prog}`: {base_model_type(model.config)} ({_size(model)} parameters), head {args.head}, "
                 f"ε = {args.eps}, {args.context_length}-token context, r_nt over {len(decoded)} contexts; "
                 f"{world.size} process(es){' (FSDP2)' if args.fsdp and world.size > 1 else ''}."]
        write_report(out, {args.head: evaluation}, f"{args.head.upper()} on {args.data_dir.name}", notes)
        print(f"results: {out / 'results.json'}", flush=True)
    return out


if __name__ == "__main__":
    main()
