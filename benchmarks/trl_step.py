"""One TRL training step (``SFTTrainer``, or ``GRPOTrainer`` with ``--trainer grpo``) with the head against the same
trainer on the plain model: ``python -m benchmarks.trl_step``.

The model: a random-init float32 Qwen3 of Qwen3-0.6B's width and vocabulary (V = 151936, H = 1024, tied embeddings)
with ``--layers`` decoder layers; the head's copy patched by :func:`nmst_fast.integrations.hf.apply_nmst`. The data:
prompt-completion pairs of ``--seq`` random words of a word-level tokenizer over the whole vocabulary (half prompt,
half completion), ``--batch`` per step. Each trainer is what a user builds: ``SFTTrainer(model=…, args=SFTConfig(…),
train_dataset=…, processing_class=…)`` with TRL's defaults (its logged entropy and token accuracy included: the
plain model's from TRL's own fused head, the head's from the fused loss's pass). Over ``--rounds`` rounds the two
alternate, each round a ``train()`` of two steps whose second is timed (the first allocates the optimizer's state);
the table holds each one's median step and the median of the rounds' ratios head / plain. ``--json PATH`` writes it.

GRPO: the prompts alone, ``--num-generations`` completions of ``--completion`` tokens each sampled by HF ``generate``
(the head's sampling on the patched model), a length reward, TRL's defaults otherwise (no reference model); a step
is the generation, the scoring and the update.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=4096)


def _tokenizer(vocab: int):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<pad>": 0, **{f"w{i}": i for i in range(1, vocab - 1)}, "<eos>": vocab - 1}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _model(vocab: int, hidden: int, layers: int, eos: int):
    import transformers

    torch.manual_seed(0)
    shape = dict(QWEN3_06B, vocab_size=vocab)
    if hidden != QWEN3_06B["hidden_size"]:
        shape.update(hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=max(1, hidden // 64),
                     num_key_value_heads=max(1, hidden // 128), head_dim=64)
    config = transformers.Qwen3Config(**shape, num_hidden_layers=layers, eos_token_id=eos, bos_token_id=eos,
                                      pad_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _dataset(vocab: int, seq: int, rows: int, prompts_only: bool = False):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab - 1, (rows, seq), generator=gen).tolist()
    half = seq // 2
    columns = {"prompt": [" ".join(f"w{i}" for i in row[:half]) for row in ids]}
    if not prompts_only:
        columns["completion"] = [" ".join(f"w{i}" for i in row[half:]) for row in ids]
    return Dataset.from_dict(columns)


def _length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _trainer(args: argparse.Namespace, model, tokenizer, out: str, timer):
    common = dict(output_dir=out, max_steps=2, per_device_train_batch_size=args.batch, report_to="none",
                  logging_steps=1, save_strategy="no", use_cpu=True, dataloader_num_workers=0, seed=0)
    if args.trainer == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        config = GRPOConfig(**common, max_completion_length=args.completion, num_generations=args.num_generations)
        return GRPOTrainer(model=model, reward_funcs=_length_reward, args=config,
                           train_dataset=_dataset(args.vocab, args.seq, 2 * args.batch, prompts_only=True),
                           processing_class=tokenizer, callbacks=[timer])
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(**common, max_length=args.seq + 2)
    return SFTTrainer(model=model, args=config, train_dataset=_dataset(args.vocab, args.seq, 2 * args.batch),
                      processing_class=tokenizer, callbacks=[timer])


class _StepTimer:
    """A TrainerCallback's two hooks: the seconds of each optimizer step, from its begin to its end."""

    def __init__(self):
        self.seconds: list[float] = []
        self._start = 0.0

    def on_step_begin(self, *args, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, *args, **kwargs):
        self.seconds.append(time.perf_counter() - self._start)


def run(args: argparse.Namespace) -> dict:
    from transformers import TrainerCallback

    from nmst_fast.integrations.hf import apply_nmst

    tokenizer = _tokenizer(args.vocab)
    plain = _model(args.vocab, args.hidden, args.layers, tokenizer.eos_token_id)
    head = apply_nmst(copy.deepcopy(plain), head="nmst", eps=1e-5)
    timer_type = type("StepTimer", (_StepTimer, TrainerCallback), {})
    times: dict[str, list[float]] = {"plain model": [], "NMST head": []}
    with tempfile.TemporaryDirectory() as out:
        trainers = {}
        for name, model in (("plain model", plain), ("NMST head", head)):
            timer = timer_type()
            trainers[name] = (_trainer(args, model, tokenizer, out, timer), timer)
        for r in range(args.rounds):
            for name in (trainers if r % 2 == 0 else reversed(list(trainers))):
                trainer, timer = trainers[name]
                timer.seconds.clear()
                trainer.train()
                times[name].append(timer.seconds[-1])
        logged = {name: sorted(k for k in trainer.state.log_history[0] if k in ("entropy", "mean_token_accuracy"))
                  for name, (trainer, _) in trainers.items()}  # GRPO's entropy is its own key
    ratios = [h / p for h, p in zip(times["NMST head"], times["plain model"])]
    return {"trainer": args.trainer,
            "shape": dict(V=args.vocab, H=args.hidden, layers=args.layers, B=args.batch, T=args.seq),
            "threads": torch.get_num_threads(), "rounds": args.rounds, "logged": logged,
            "median_s": {name: statistics.median(ts) for name, ts in times.items()},
            "head_over_plain": statistics.median(ratios), "ratio_range": (min(ratios), max(ratios))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trl_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", choices=("sft", "grpo"), default="sft")
    parser.add_argument("--vocab", type=int, default=QWEN3_06B["vocab_size"])
    parser.add_argument("--hidden", type=int, default=QWEN3_06B["hidden_size"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--completion", type=int, default=16, help="GRPO: tokens per completion")
    parser.add_argument("--num-generations", type=int, default=2, help="GRPO: completions per prompt")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
