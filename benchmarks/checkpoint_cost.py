"""What a saved model costs at real size: opening it with the head, and exporting it to GGUF.

    python -m benchmarks.checkpoint_cost               # a Qwen3-0.6B-shaped model (596 M parameters, V = 151936)
    python -m benchmarks.checkpoint_cost --layers 2    # the same width and vocabulary, 2 layers (quick)

The model (random weights, float32, tied embeddings) is saved once with an NMST head and once as the plain base
model (``export_plain``: the same weights). Then, each in a fresh process, in interleaved rounds:

* ``from_pretrained`` of the plain directory (transformers alone), of the NMST directory (``import nmst_fast``
  first), and the plain directory then ``apply_nmst``: the imports, the calls, and their total, whose ratio to the
  plain one's is the cost a user sees (transformers imports a model's modules on its first ``from_pretrained``;
  nmst-fast imports some of them first);
* ``nmst-fast export-gguf`` of the NMST directory to f16 and q8_0: time and peak resident memory above the
  process's own before the export, against the checkpoint's size and its largest tensor.

Prints one JSON object; ``--json PATH`` writes it too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                 max_position_embeddings=40960, rms_norm_eps=1e-6, eos_token_id=2)
# --tiny: the benchmark's plumbing in seconds (its test)
TINY = dict(QWEN3_06B, vocab_size=1000, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


def build(directory: Path, layers: int, shape: dict = QWEN3_06B) -> None:
    """The NMST model of ``shape`` in ``directory``/nmst, its plain export in ``directory``/plain."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from nmst_fast.data.bpe import train_byte_level_bpe
    from nmst_fast.integrations.hf import apply_nmst, export_plain

    config = Qwen3Config(**{**shape, "num_hidden_layers": layers})
    config.rope_parameters = {"rope_type": "default", "rope_theta": 1e6}
    torch.manual_seed(0)
    model = apply_nmst(AutoModelForCausalLM.from_config(config), head="nmst", eps=1e-4)
    model.save_pretrained(directory / "nmst")
    # a byte-level BPE (what the export writes for llama.cpp); its ids beyond the tokenizer's are unused tokens
    text = ["the tower stands by the river", "a stone bridge crosses the water", "the town grew around it"]
    train_byte_level_bpe(text * 20, vocab_size=300).save_pretrained(directory / "nmst")
    export_plain(directory / "nmst", directory / "plain")


def child(what: str, directory: Path) -> dict:
    """One measurement, in this (fresh) process."""
    t0 = time.perf_counter()
    import transformers

    if what == "open with the head":
        import nmst_fast  # noqa: F401
    if what == "plain, then apply_nmst":
        from nmst_fast.integrations.hf import apply_nmst
    if what.startswith("export-gguf"):
        from benchmarks import memory
        from nmst_fast.integrations.llama_cpp.export import export_gguf

        kind = what.split()[-1]
        base = memory.rss_bytes()
        memory.reset_peak()
        t1 = time.perf_counter()
        out = export_gguf(directory / "nmst", directory / f"model-{kind}.gguf", dtype=kind)
        seconds = time.perf_counter() - t1
        return {"seconds": seconds, "peak_gb": (memory.peak_bytes() - base) / 1e9, "file_gb": out.stat().st_size / 1e9}
    t1 = time.perf_counter()
    source = directory / ("nmst" if what == "open with the head" else "plain")
    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    if what == "plain, then apply_nmst":
        apply_nmst(model, head="nmst", eps=1e-4)
    return {"seconds": time.perf_counter() - t1, "imports": t1 - t0}


def run_child(what: str, directory: Path) -> dict:
    command = [sys.executable, "-m", "benchmarks.checkpoint_cost", "--child", what, "--dir", str(directory)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def checkpoint_sizes(directory: Path) -> dict:
    """The NMST checkpoint's size and its largest tensor's, in GB (from the safetensors header)."""
    path = directory / "nmst" / "model.safetensors"
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    largest = max(end - start for key, entry in header.items() if key != "__metadata__"
                  for start, end in [entry["data_offsets"]])
    return {"checkpoint_gb": path.stat().st_size / 1e9, "largest_tensor_gb": largest / 1e9}


LOADS = ("plain from_pretrained", "open with the head", "plain, then apply_nmst")
EXPORTS = ("export-gguf f16", "export-gguf q8_0")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=QWEN3_06B["num_hidden_layers"])
    parser.add_argument("--tiny", action="store_true", help="a 64-wide model of 1000 tokens (the plumbing only)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the models are (built there if absent)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.dir)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.dir or Path(scratch)
        if not (directory / "plain").is_dir():
            build(directory, args.layers, TINY if args.tiny else QWEN3_06B)
        loads = {what: [] for what in LOADS}
        for _ in range(args.rounds):
            for what in LOADS:
                loads[what].append(run_child(what, directory))
        plain = [r["seconds"] + r["imports"] for r in loads[LOADS[0]]]
        result = {"layers": args.layers, **checkpoint_sizes(directory), "rounds": args.rounds, "loads": {
            what: {"call_s": statistics.median(r["seconds"] for r in runs),
                   "imports_s": statistics.median(r["imports"] for r in runs),
                   "total_s": statistics.median(r["seconds"] + r["imports"] for r in runs),
                   "x_plain": statistics.median((r["seconds"] + r["imports"]) / p for r, p in zip(runs, plain))}
            for what, runs in loads.items()}}
        result["exports"] = {what: run_child(what, directory) for what in EXPORTS}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
