"""benchmarks.sampler_peers' llama.cpp peer stays runnable (benchmarks.cpu_step --peer runs it in this environment):
one tiny case of every strategy, each chain drawing tokens of the row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import cpu_step, sampler_peers  # noqa: E402


def test_the_llama_cpp_peer_times_every_strategy(tmp_path):
    sampler_peers.main(["llama.cpp", "--batches", "2", "--vocabs", "300", "--shapes", "flat", "--calls", "2",
                        "--json", str(tmp_path / "peer.json")])
    rows = json.loads((tmp_path / "peer.json").read_text())
    assert [r["strategy"] for r in rows] == list(cpu_step.STRATEGIES)
    assert all(r["peer_us"] > 0 and r["ours_us"] > 0 for r in rows)


def test_the_chains_draw_from_the_rows():
    logits = cpu_step.shaped_logits(3, 300, "peaked")
    greedy = sampler_peers.llama_cpp_step(logits, 1, None, None)()
    assert greedy == logits.argmax(dim=1).tolist()
    for k, p, m in cpu_step.STRATEGIES.values():
        tokens = sampler_peers.llama_cpp_step(logits, k, p, m)()
        assert len(tokens) == 3 and all(0 <= t < 300 for t in tokens)
        if k is not None:  # top-k keeps the k best
            best = torch.topk(logits, k, dim=1).indices
            assert all(t in best[b].tolist() for b, t in enumerate(tokens))
