"""pytest-benchmark suite for per-step selection (``pytest benchmarks``)."""

import pytest
import torch

from benchmarks.decoding_cases import STRATEGIES, fast, make_logits, sort_based
from nmst_fast.decoding import step_log_probs

SHAPES = [(32, 33278), (256, 50257)]


@pytest.mark.parametrize("B,V", SHAPES)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("impl", ["fast", "sort-based"])
def test_select(benchmark, B, V, strategy, impl):
    logits = make_logits(B, V)
    k, p = STRATEGIES[strategy]
    step = (fast if impl == "fast" else sort_based)(k, p)
    gen = torch.Generator().manual_seed(0)
    benchmark.group = f"select B={B} V={V} {strategy}"
    tokens = benchmark.pedantic(step, args=(logits, gen), warmup_rounds=1, rounds=5, iterations=1)
    assert tokens.shape == (B,)


def test_generation_report_runs(capsys, tmp_path):
    """The generation throughput report end to end on a tiny model (its table is in RESULTS.md), and its JSON."""
    import json

    from benchmarks import report_generation

    report_generation.main(["--vocab", "300", "--batches", "2", "--max-length", "5",
                            "--json", str(tmp_path / "g.json")])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["greedy", "top_k", "nucleus", "beam"]
    saved = json.loads((tmp_path / "g.json").read_text())["rows"]
    assert [(r["batch"], r["strategy"]) for r in saved] == [(2, s) for s in ("greedy", "top_k", "nucleus", "beam")]
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):  # a clear usage error, not a crash deep in torch
            report_generation.main(["--device", "cuda"])


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_host_overhead(benchmark, strategy):
    """A cached decoding step's host time with its kernels stubbed (``python -m benchmarks.host_overhead``)."""
    import nmst_fast.kernels.scan_select as scan_select
    from benchmarks.host_overhead import cached_step, device, kernels_stubbed

    real_kernel = scan_select._scan_select_kernel
    logits = make_logits(1, 50257, device=device())
    gen = torch.Generator(device=device()).manual_seed(0)
    with kernels_stubbed():
        benchmark.group = "host time per fused step, kernels stubbed, B=1 V=50257"
        tokens = benchmark(cached_step(*STRATEGIES[strategy], logits, gen))
    assert tokens.shape == (1,) and scan_select._scan_select_kernel is real_kernel


def test_host_overhead_report_runs(capsys):
    from benchmarks import host_overhead

    host_overhead.main(["--vocab", "300", "--batches", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert [row.split("|")[2].strip() for row in rows] == list(STRATEGIES)


def test_selection_report_writes_its_table_as_json(tmp_path, capsys):
    """``report_decoding --quick --json``: the CPU grid's rows, as printed, in a JSON file."""
    import json

    from benchmarks import report_decoding

    report_decoding.main(["--quick", "--repeats", "1", "--json", str(tmp_path / "d.json")])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 256 | 50257 |")]
    saved = json.loads((tmp_path / "d.json").read_text())["rows"]
    assert len(saved) == len(printed) == len(STRATEGIES) and {r["strategy"] for r in saved} == set(STRATEGIES)
    assert all(r["fast_ms"] > 0 and r["sort_based_ms"] > 0 for r in saved)


def test_cpu_step_report_runs(tmp_path, capsys):
    """``python -m benchmarks.cpu_step``: every strategy against the exp pass, the torch path and the plain torch
    version, flat and peaked logits, as a table and as JSON; the plain version draws valid tokens."""
    import json

    from benchmarks import cpu_step

    threads = torch.get_num_threads()
    cpu_step.main(["--batches", "2", "--vocabs", "300", "--calls", "2", "--repeats", "2", "--torch-path", "--json",
                   str(tmp_path / "c.json")])
    assert torch.get_num_threads() == threads  # the run's one thread is not left behind
    rows = json.loads((tmp_path / "c.json").read_text())
    assert [r["strategy"] for r in rows] == list(cpu_step.STRATEGIES) * len(cpu_step.SHAPES)
    assert all(r["ratio"] > 0 and r["floor_ratio"] > 0 and r["torch_path_us"] > 0 for r in rows)
    assert all(r["repeats"] == 2 and r["ratio_min"] <= r["ratio_max"] for r in rows)
    printed = [line for line in capsys.readouterr().out.splitlines() if " | 2 | 300 |" in line]
    assert len(printed) == len(cpu_step.STRATEGIES) * len(cpu_step.SHAPES)
    cpu_step.main(["--batches", "1", "--vocabs", "300", "--calls", "2", "--eos-inside", "--shapes", "peaked"])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| peaked | 1 | 300 |")]
    assert len(printed) == len(cpu_step.STRATEGIES)
    cpu_step.main(["--batches", "1", "--vocabs", "300", "--calls", "2", "--shapes", "flat", "--strategies", "top-p 0.9",
                   "greedy"])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| flat | 1 | 300 |")]
    assert [line.split(" | ")[3] for line in printed] == ["top-p 0.9", "greedy"]
    logits = torch.randn(3, 300)
    logits[0, 299 - cpu_step.INSIDE] = logits[1, 299] = 30.0  # eos wins these rows (t = STEP)
    for inside in (False, True):
        for k, p, m in cpu_step.STRATEGIES.values():
            tokens = cpu_step.plain_step(k, p, m, inside)(logits, torch.Generator().manual_seed(0))
            assert tokens.shape == (3,) and bool(((tokens >= 0) & (tokens < 300)).all())
        # The plain version is the NMST step: its greedy token is the exact distribution's best.
        eos = 299 - (cpu_step.INSIDE if inside else 0)
        exact, _ = step_log_probs(logits.double(), head="nmst", eos_index=eos, eps=cpu_step.EPS, steps=cpu_step.STEP)
        assert torch.equal(cpu_step.plain_step(1, None, None, inside)(logits, None), exact.argmax(dim=1))
