"""Peak memory of one training step of a Hugging Face causal LM: patched (fused loss) vs unpatched.

    python -m benchmarks.hf_memory            # Llama-family, V = 128256, H = 512, 4 x 512 tokens, fp32, CPU

Each variant runs in a fresh process: build the model and the batch, reset the peak, then one
forward + backward with ``labels``. The patched model never forms the (B, T, V) logits (nor their
log-softmax and gradient), so its peak should sit below the unpatched one's by at least the fp32
logits' B·T·V·4 bytes. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--variant", choices=["patched", "unpatched"], help=argparse.SUPPRESS)  # one child's run
    return p


def _one_step(args) -> int:
    """Peak bytes above the resident set before the step, for one forward + backward."""
    import transformers

    from benchmarks import memory
    from nmst_fast.integrations.hf import apply_nmst

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                      num_attention_heads=8, num_key_value_heads=8,
                                      intermediate_size=4 * args.hidden, eos_token_id=args.vocab - 1)
    model = transformers.LlamaForCausalLM(config)
    if args.variant == "patched":
        apply_nmst(model, head="nmst", eps=1e-5)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    base = memory.rss_bytes()
    memory.reset_peak()
    model(ids, labels=ids).loss.backward()
    return memory.peak_bytes() - base


def measure(args) -> dict:
    """Both variants, each in its own process; sizes in bytes."""
    flags = [f"--{k}={getattr(args, k)}" for k in ("vocab", "hidden", "layers", "batch", "seq")]
    peaks = {}
    for variant in ("unpatched", "patched"):
        run = subprocess.run([sys.executable, "-m", "benchmarks.hf_memory", *flags, "--variant", variant],
                             capture_output=True, text=True, check=True)
        peaks[variant] = int(run.stdout.strip().splitlines()[-1])
    logits = args.batch * args.seq * args.vocab * 4
    saved = peaks["unpatched"] - peaks["patched"]
    return dict(shape=dict(V=args.vocab, H=args.hidden, layers=args.layers, B=args.batch, T=args.seq),
                peak_unpatched=peaks["unpatched"], peak_patched=peaks["patched"], logits_fp32=logits,
                saved=saved, saved_over_logits=saved / logits)


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    if args.variant is not None:
        print(_one_step(args))
        return {}
    result = measure(args)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
