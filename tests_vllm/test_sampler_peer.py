"""benchmarks.sampler_peers' vLLM peer stays runnable (benchmarks.cpu_step --peer runs it in this environment): one
tiny case of every strategy vLLM's CPU sampler has (min-p is a logits processor of vLLM's own: no column)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import cpu_step, sampler_peers  # noqa: E402


def test_the_vllm_peer_times_its_strategies(tmp_path):
    sampler_peers.main(["vllm", "--batches", "2", "--vocabs", "300", "--shapes", "flat", "--calls", "2",
                        "--json", str(tmp_path / "peer.json")])
    rows = json.loads((tmp_path / "peer.json").read_text())
    assert [r["strategy"] for r in rows] == list(cpu_step.STRATEGIES)
    timed = {r["strategy"] for r in rows if "peer_us" in r}
    assert timed == {name for name, (_, _, m) in cpu_step.STRATEGIES.items() if m is None}


def test_the_sampler_draws_from_the_rows():
    logits = cpu_step.shaped_logits(3, 300, "peaked")
    assert sampler_peers.vllm_step(logits, 1, None, None)().tolist() == logits.argmax(dim=1).tolist()
    for k, p, m in cpu_step.STRATEGIES.values():
        step = sampler_peers.vllm_step(logits, k, p, m)
        if step is None:
            continue
        tokens = step()
        assert tokens.shape == (3,) and bool(((tokens >= 0) & (tokens < 300)).all())
        if k is not None:
            best = torch.topk(logits, k, dim=1).indices
            assert all(int(t) in best[b].tolist() for b, t in enumerate(tokens))
