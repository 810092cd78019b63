"""python -m train.hf under torchrun (2 gloo ranks), in one launch (tests/distributed/hf_train_ranks.py):

* its training step, data-parallel (DDP) and sharded (FSDP2: fully_shard per decoder layer, on the
  output layer and the root), gives one process's loss and gradients for every head, with ragged
  shares and an empty one (tests/distributed/hf_step_ranks.py); the loss reads the output layer's
  weight inside that layer's own call, where FSDP2 has gathered it;
* DDP and --fsdp training update the weights as one process does, the evaluation equals one
  process's, rank 0 alone writes, and an FSDP run resumes under torchrun (slow: the fast set runs the step
  checks alone)."""

import json

import pytest
import torch
import transformers

from train.hf import main

from helpers import torchrun

# Batches of up to 128 tokens hold 3-8 rows: the two ranks' shares have different token counts.
FLAGS = ("--max-length", "6", "--eval-contexts", "5", "--vocab-size", "300", "--max-tokens", "128", "--epochs",
         "2", "--head", "st", "--eps", "0.05", "--quiet")


def _weights(run):
    return transformers.AutoModelForCausalLM.from_pretrained(run / "last").state_dict()


def _results(run):
    return json.loads((run / "results.json").read_text())["st"]


def test_the_training_step_over_ranks_equals_one_process():
    """The fast set's run of the step checks alone (tests/distributed/hf_step_ranks.py): DDP and FSDP2
    steps of every head equal one process's; the whole command under torchrun is the slow test below."""
    proc = torchrun("hf_step_ranks.py", 2, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for rank in (0, 1):
        assert f"rank {rank}/2: DDP and FSDP2 steps equal one process" in proc.stdout


@pytest.mark.slow
def test_ddp_and_fsdp_train_as_one_process_and_fsdp_resumes(corpus, tmp_path):
    one = main(["--data-dir", str(corpus), "--out", str(tmp_path / "one"), *FLAGS])
    proc = torchrun("hf_train_ranks.py", 2, str(tmp_path), "--", "--data-dir", str(corpus), *FLAGS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for rank in (0, 1):
        assert f"rank {rank}/2: DDP and FSDP2 steps equal one process" in proc.stdout
    assert proc.stdout.count("cut after epoch 1") == 2  # both ranks saw the interrupted run's state
    assert proc.stdout.count("results:") == 3  # rank 0 alone reports, once per finished run
    ddp, fsdp, cut = (tmp_path / name for name in ("ddp", "fsdp", "cut"))
    # Rank 0 trained the BPE and handed it to rank 1: the vocabulary one process trains, saved beside
    # each model, with nothing left over from a swap.
    for run in (ddp, fsdp, cut):
        for name in ("model", "last"):
            assert (run / name / "tokenizer.json").read_text() == (one / "model" / "tokenizer.json").read_text()
        assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["last", "model"]
    want = _weights(one)
    for run in (ddp, fsdp):
        for name, value in _weights(run).items():
            torch.testing.assert_close(value, want[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{run.name} {name}: {m}")
        got, ref = _results(run), _results(one)
        assert got["world_size"] == 2 and ref["world_size"] == 1
        assert json.loads((run / "run.json").read_text())["world_size"] == 2
        for key in ("perplexity", "valid_perplexity"):
            assert abs(got[key] - ref[key]) <= 1e-4 * ref[key], (run.name, key)
        assert got["data_lengths"] == ref["data_lengths"] and len(got["examples"]) == 3
    assert json.loads((fsdp / "run.json").read_text())["fsdp"] is True

    # The FSDP run stopped after its first epoch resumed under torchrun to the uninterrupted run's weights.
    want = _weights(fsdp)
    for name, value in _weights(cut).items():
        torch.testing.assert_close(value, want[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert _results(cut)["history"] == _results(fsdp)["history"]
