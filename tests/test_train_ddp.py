"""python -m train data-parallel under torchrun (2 gloo ranks): the training loop and the evaluation
equal one process (tests/distributed/train_ranks.py), the command writes its files once from rank 0
with the world size recorded, a refused --out stops every rank, a rank that fails ends the run, and
python -m train.sweep runs the same way."""

import json
import time

import pytest

from train.__main__ import main

from helpers import torchrun

FLAGS = ("--builtin-lines", "50", "--max-epochs", "2", "--max-length", "20", "--batch-size", "7", "--heads",
         "nmst", "va", "--quiet")


def test_training_and_evaluation_over_ranks_equal_one_process(tmp_path):
    run = torchrun("train_ranks.py", 2, str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    for rank in (0, 1):
        assert f"rank {rank}/2: training and evaluation equal one process" in run.stdout


@pytest.mark.slow  # (the fast set's bad rank: test_vocab_parallel's NaN weight)
def test_a_failing_rank_ends_the_run_with_its_error(tmp_path):
    start = time.monotonic()
    run = torchrun("train_ranks.py", 2, str(tmp_path), "--fail-rank", "1", timeout=300)
    assert run.returncode != 0
    assert "rank 1 failed on purpose" in run.stdout + run.stderr
    assert time.monotonic() - start < 240  # the other rank did not wait out a collective


@pytest.mark.slow
def test_the_command_under_torchrun_writes_once_and_matches_one_process(tmp_path):
    # python -m train, then again on the same --out (tests/distributed/train_command_ranks.py).
    run = torchrun("train_command_ranks.py", 2, str(tmp_path / "two"), "--", *FLAGS)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert run.stdout.count("report:") == 2  # rank 0 alone reports, once per run
    assert json.loads((tmp_path / "two" / "run.json").read_text())["world_size"] == 2
    two = json.loads((tmp_path / "two" / "first-results.json").read_text())
    assert not [p for p in (tmp_path / "two").rglob("*") if p.name.endswith(".tmp")]
    one = json.loads((main(["--out", str(tmp_path / "one"), *FLAGS]) / "results.json").read_text())
    for head in ("nmst", "va"):
        assert two[head]["world_size"] == 2 and one[head]["world_size"] == 1
        for key in ("perplexity", "valid_perplexity"):
            assert abs(two[head][key] - one[head][key]) <= 1e-4 * one[head][key], (head, key)
    # The rerun on the same --out: every rank resumed the finished runs (no epoch trained again, no
    # checkpoint rewritten).
    assert json.loads((tmp_path / "two" / "results.json").read_text())["va"]["history"] == two["va"]["history"]
    stamps = json.loads((tmp_path / "two" / "first-checkpoints.json").read_text())
    assert sorted(stamps) == ["nmst/checkpoint.pt", "va/checkpoint.pt"]
    assert all((tmp_path / "two" / name).stat().st_mtime_ns == stamp for name, stamp in stamps.items())


@pytest.mark.slow
def test_a_refused_out_stops_every_rank(tmp_path):
    (tmp_path / "notes.txt").write_text("a user's file")
    run = torchrun("train", 2, "--out", str(tmp_path), *FLAGS, module=True, timeout=300)
    assert run.returncode != 0
    assert run.stderr.count("no run.json") == 2  # rank 0's refusal, raised on both ranks
    assert (tmp_path / "notes.txt").read_text() == "a user's file" and not (tmp_path / "run.json").exists()


@pytest.mark.slow
def test_the_sweep_under_torchrun(tmp_path):
    """The sweep's run ends with rc 0 after writing its results: no rank aborts at the group's teardown.

    Teardown loop, two at once (each in a copy of the checkout, 100 runs):

        for i in $(seq 100); do python -m pytest tests/test_train_ddp.py -q -n 0 -m "slow or not slow" \
            -k test_the_sweep_under_torchrun >/dev/null 2>&1 || echo failed; done | grep -c failed

    With the first import of train/distributed.py: 0 failures in 200 runs. Without it, also 0 in 200: the abort
    (SIGABRT, "terminate called without an active exception"; once in 29 runs of the command and once in 36 of
    the suite before) did not show here, so this loop alone cannot tell the two apart. Its cause, gloo threads
    outliving the group, is checked on every run of tests/distributed/train_ranks.py (it fails without the
    import), and tests/distributed/teardown_ranks.py widens its window (torch 2.13, Python 3.11, 2 shared cores)."""
    run = torchrun("train.sweep", 2, "--out", str(tmp_path), "--builtin-lines", "30", "--max-epochs", "1",
                   "--max-length", "10", "--seeds", "0", "--eps", "0.01", "--heads", "nmst", "va", "--quiet",
                   module=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert run.stdout.count("tables:") == 1
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert sweep["world_size"] == 2 and [r["head"] for r in sweep["runs"]] == ["nmst", "va"]
    assert (tmp_path / "tables.md").exists() and json.loads((tmp_path / "run.json").read_text())["world_size"] == 2
