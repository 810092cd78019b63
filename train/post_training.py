"""Fine-tune with TRL, evaluate with lm-eval, serve with vLLM: the post-training pipeline on the built-in corpus.

    python -m train.post_training                     # NMST, ε = 0.05, about half a minute on 2 CPU cores
    python -m train.post_training --head st --eps 0.02 --steps 600 --out runs/st-pipeline

1. **TRL.** A tiny random-init Llama with a byte-level BPE over the built-in corpus (each word one token)
   (:mod:`train.corpus`: a 10-word context, then a motif repeated until the line stops) is patched with
   :func:`~nmst_fast.integrations.hf.apply_nmst` and fine-tuned by TRL's own ``SFTTrainer`` on
   prompt-completion pairs (the context as the prompt, the motifs + eos as the completion). TRL's fused
   LM head is answered by the head (:mod:`nmst_fast.integrations.trl`): its loss is the head's NLL of the
   completion, with t = 1 at the completion's first token, and its logged ``entropy`` and
   ``mean_token_accuracy`` are the head's distribution's.
2. **One servable directory.** The model (the NMST checkpoint type: its config records head, ε and eos) and the
   tokenizer land in ``OUT/model``, which ``from_pretrained`` (after ``import nmst_fast``), lm-eval's model
   ``nmst`` and ``vllm serve`` take as it is.
3. **lm-eval.** lm-eval's own ``simple_evaluate`` runs the model ``"nmst"``
   (:mod:`nmst_fast.integrations.lm_eval`) on a local task over the test split (``OUT/lm_eval_tasks``, no
   hub): the ``loglikelihood`` of each completion, eos included, after its prompt, t = 1 at the completion's
   first token. Its per-token perplexity equals the project's own evaluation of the same completions (the
   fused loss); ``is_greedy`` is the share of completions that the head's greedy decoding reproduces exactly.
4. **Greedy decoding** of the test prompts up to ``--max-length`` tokens: the share that ends with eos
   (NMST and ST stop by t½ = ``termination_bound(ε)``; the corpus makes a plain softmax loop).
5. **vLLM**: the command that serves ``OUT/model`` as it is (in vLLM's own environment, where nmst-fast's plugin
   opens the checkpoint and its processor decodes the head), and the test prompts as text
   (``OUT/test_prompts.json``) to send it.

``OUT/report.json`` holds the numbers, ``OUT/report.md`` says what they mean.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from nmst_fast import termination_bound
from nmst_fast.generation import generate
from nmst_fast.integrations.hf import HFDecoder, apply_nmst

from .checkpoint import save_model_atomic
from .corpus import CONTEXT_WORDS, builtin_splits
from .loop import token_perplexity


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.post_training", description=__doc__.split("\n\n")[0])
    p.add_argument("--head", choices=("nmst", "st", "va"), default="nmst")
    p.add_argument("--eps", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=300, help="SFT optimizer steps")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--test-lines", type=int, default=100, help="test lines lm-eval and decoding use")
    p.add_argument("--max-length", type=int, default=100, help="greedy decoding's length limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="default: runs/post-training-<date-time>")
    return p


def corpus_tokenizer(lines: list[str]):
    """A byte-level BPE over the corpus in which every word, with or without the space before it, is one token:
    ``<pad>`` 0, ``<eos>`` 1, the 256 bytes, then the merges that spell the words. So a line's 10-word context is
    10 tokens, and the model exports to llama.cpp (GPT-2's split: ``nmst-fast export-gguf``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = sorted({word for line in lines for word in line.split()})
    forms = words + [" " + word for word in words]  # a line's first word, and the others
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1 << 20, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(forms, trainer=trainer)  # merges until every form is one token
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>")
    split = [form for form in forms if len(tokenizer(form)["input_ids"]) != 1]
    if split:
        raise RuntimeError(f"the corpus tokenizer splits {split[:3]}")
    return tokenizer


def tiny_llama(tokenizer, seed: int):
    """A random-init Llama over ``tokenizer``: width 64 in two heads of 32 (vLLM's CPU attention takes head
    dimensions of 32 and more), two layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def split_line(line: str) -> tuple[str, str]:
    words = line.split()
    return " ".join(words[:CONTEXT_WORDS]), " " + " ".join(words[CONTEXT_WORDS:])


def write_task(directory: Path, lines: list[str]) -> str:
    """An lm-eval task over ``lines`` (local JSON data; ``--include_path directory``): the log-likelihood of each
    completion, eos included, after its prompt. Returns its name."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "test.jsonl"
    with data.open("w") as f:
        for line in lines:
            prompt, completion = split_line(line)
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    (directory / "builtin_completions.yaml").write_text(
        f"task: builtin_completions\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: loglikelihood\ndoc_to_text: '{{prompt}}'\n"
        "doc_to_target: '{{completion}}<eos>'\ntarget_delimiter: ''\nmetric_list:\n"
        "  - {metric: acc, aggregation: mean, higher_is_better: true}\n")
    return "builtin_completions"


def run(args: argparse.Namespace) -> dict:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    out = args.out or Path("runs") / time.strftime("post-training-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    splits = builtin_splits(args.seed)
    tokenizer = corpus_tokenizer(splits["train"] + splits["valid"] + splits["test"])
    model = apply_nmst(tiny_llama(tokenizer, args.seed), head=args.head, eps=args.eps,
                       eos_token_id=tokenizer.eos_token_id)
    pairs = [split_line(line) for line in splits["train"]]
    data = Dataset.from_dict({"prompt": [p for p, _ in pairs], "completion": [c for _, c in pairs]})
    config = SFTConfig(output_dir=str(out / "trl"), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
                       learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=min(20, args.steps // 10),
                       logging_steps=max(1, args.steps // 10), save_strategy="no", report_to="none", use_cpu=True,
                       bf16=False, seed=args.seed, dataloader_num_workers=0)
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    model_dir = out / "model"
    save_model_atomic(model, model_dir, tokenizer=tokenizer)

    import lm_eval
    from lm_eval.tasks import TaskManager

    import nmst_fast.integrations.lm_eval  # noqa: F401  (registers the lm-eval model "nmst")

    test = splits["test"][:args.test_lines]
    task = write_task(out / "lm_eval_tasks", test)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_args = f"pretrained={model_dir},dtype=float32,device={device}"
    evaluated = lm_eval.simple_evaluate(model="nmst", model_args=model_args, tasks=[task], batch_size=16,
                                        log_samples=True,
                                        task_manager=TaskManager(include_path=str(out / "lm_eval_tasks")))
    samples = evaluated["samples"][task]
    log_likelihood = sum(float(sample["filtered_resps"][0][0]) for sample in samples)
    sequences = [tokenizer(line)["input_ids"] + [tokenizer.eos_token_id] for line in test]
    completion_tokens = sum(len(seq) - CONTEXT_WORDS for seq in sequences)
    # The same completions scored by the project's own evaluation (the patched model's fused loss, t = 1 at the
    # completion's first token): lm-eval's numbers are the head's, so the two agree.
    own = token_perplexity(model, sequences, CONTEXT_WORDS, 4096, tokenizer.pad_token_id, device)
    scores = {"is_greedy": evaluated["results"][task]["acc,none"],
              "completion_perplexity": math.exp(-log_likelihood / completion_tokens),
              "completion_perplexity_fused_loss": own}

    model.eval()
    prompts = [tokenizer(split_line(line)[0])["input_ids"] for line in test]
    contexts = torch.tensor(prompts)  # every prompt is CONTEXT_WORDS words: one token each
    decoded = generate(HFDecoder(model), contexts, strategy="greedy", max_length=args.max_length)
    report = {
        "head": args.head, "eps": args.eps,
        "termination_bound": termination_bound(args.eps) if args.head != "va" else None,
        "sft": {"first_loss": logged[0]["loss"], "last_loss": logged[-1]["loss"],
                "last_entropy": logged[-1].get("entropy"), "last_token_accuracy": logged[-1].get("mean_token_accuracy"),
                "steps": args.steps},
        "lm_eval": scores,
        "greedy": {"max_length": args.max_length, "terminated": float(decoded.terminated.float().mean()),
                   "mean_length": float(decoded.lengths.float().mean())},
        "model_dir": str(model_dir),
        "serve": f"vllm serve {model_dir} --host 127.0.0.1 --port 8000",
        "test_prompts": str(out / "test_prompts.json"),
    }
    # The prompts decoded above, as text: what to send the server (tests_vllm/test_walk_through.py does).
    (out / "test_prompts.json").write_text(json.dumps([split_line(line)[0] for line in test], indent=1) + "\n")
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(_markdown(report))
    return report


def _markdown(report: dict) -> str:
    lines = [f"# Post-training pipeline: head {report['head']}, ε = {report['eps']}", ""]
    if report["termination_bound"] is not None:
        lines += [f"Greedy decoding must end with eos by t½ = {report['termination_bound']}.", ""]
    sft = report["sft"]
    lines += ["## TRL SFT", "",
              f"Loss (the head's NLL of each completion, t = 1 at its first token): {sft['first_loss']:.4g} at the "
              f"first logged step, {sft['last_loss']:.4g} at the last ({sft['steps']} steps). Entropy and token "
              f"accuracy are the head's distribution's: {sft['last_entropy']}, {sft['last_token_accuracy']}.", "",
              "## lm-eval (model `nmst`)", ""]
    scores = report["lm_eval"]
    lines += [f"Per-token perplexity of the test completions (eos included, t = 1 at each one's first token): "
              f"{scores['completion_perplexity']:.6g} from lm-eval's log-likelihoods, "
              f"{scores['completion_perplexity_fused_loss']:.6g} from the project's fused loss. is_greedy (the head's "
              f"greedy decoding reproduces the whole completion): {scores['is_greedy']:.3g}."]
    greedy = report["greedy"]
    lines += ["", "## Greedy decoding", "",
              f"{100 * greedy['terminated']:.1f}% of the test prompts end with eos within {greedy['max_length']} "
              f"tokens (mean length {greedy['mean_length']:.1f}).", "", "## Serve", "", f"    {report['serve']}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    report = run(parser().parse_args(argv))
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
