"""train/: the built-in corpus, the recipe's loop (resume == uninterrupted), checkpoints, the CLI."""

import json
import sys
from pathlib import Path

import pytest
import torch

from nmst_fast.data.wikitext import CONTEXT_LENGTH, Vocabulary, encode_lines
from train.__main__ import main
from train.checkpoint import load_checkpoint, load_model, save_atomic
from train.config import TrainConfig
from train.corpus import CONTEXT_WORDS, builtin_splits, prefix_corpus, stop_probabilities
from train.loop import train


def test_corpus_lines_are_prefixes_of_one_another():
    lines = prefix_corpus(400, seed=3)
    assert lines == prefix_corpus(400, seed=3)  # reproducible
    motifs = stop_probabilities()
    by_motif = {}
    for line in lines:
        words = line.split()
        assert CONTEXT_WORDS == CONTEXT_LENGTH and len(words) > CONTEXT_WORDS
        continuation = words[CONTEXT_WORDS:]
        motif = tuple(continuation[:3])
        assert motif in motifs and continuation == list(motif) * (len(continuation) // 3)  # ends at a motif end
        by_motif.setdefault(motif, set()).add(len(continuation))
    assert all(len(lengths) > 1 for lengths in by_motif.values())  # several lengths per family: prefixes


def test_corpus_splits_differ_but_share_the_process():
    splits = builtin_splits(0, sizes=(50, 20, 20))
    assert [len(splits[s]) for s in ("train", "valid", "test")] == [50, 20, 20]
    assert splits["train"][:20] != splits["valid"]


@pytest.mark.parametrize("field,value,message", [("head", "nmts", "unknown head"), ("arch", "gru", "unknown arch"),
                                                 ("eps", 1.0, "eps"), ("eps", 0.0, "eps"), ("size", "huge", "size"),
                                                 ("max_epochs", 0, "max_epochs")])
def test_config_rejects_bad_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{field: value}).validate()


def _data(n_train=60, n_valid=20):
    splits = builtin_splits(1, sizes=(n_train, n_valid, 10))
    vocab = Vocabulary.from_lines(splits["train"])
    return vocab, encode_lines(splits["train"], vocab), encode_lines(splits["valid"], vocab)


def test_resume_after_interruption_equals_uninterrupted_run(tmp_path):
    """Dropout on (size "small"), so the RNG state must be restored as well as weights and optimizer."""
    vocab, tr, va = _data()
    config = TrainConfig(arch="rnn", head="st", size="small", max_epochs=3, batch_size=16, seed=5)
    full, full_state = train(config, tr, va, vocab, tmp_path / "a.pt", progress=False)
    train(config, tr, va, vocab, tmp_path / "b.pt", progress=False, stop_after=1)
    assert load_checkpoint(tmp_path / "b.pt")["state"]["epoch"] == 1
    resumed, resumed_state = train(config, tr, va, vocab, tmp_path / "b.pt", progress=False)
    assert resumed_state.history == full_state.history
    for key, value in full.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


def test_checkpoint_rebuilds_the_trained_head_and_refuses_another_vocabulary(tmp_path):
    vocab, tr, va = _data(30, 10)
    config = TrainConfig(head="nmst", eps=0.05, size="tiny", max_epochs=1, seed=0)
    model, _ = train(config, tr, va, vocab, tmp_path / "c.pt", progress=False)
    loaded, loaded_vocab, loaded_config = load_model(tmp_path / "c.pt")
    assert loaded_vocab == vocab and loaded_config.head == "nmst" and loaded_config.eps == 0.05
    assert loaded.nmst_head.head == "nmst" and loaded.nmst_head.eps == 0.05  # never silently vanilla
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key])
    other = Vocabulary.from_lines(["completely different words here"])
    with pytest.raises(ValueError, match="different vocabulary"):
        load_model(tmp_path / "c.pt", other)
    with pytest.raises(ValueError, match="different vocabulary"):
        train(config, tr, va, other, tmp_path / "c.pt", progress=False)


def test_atomic_save_leaves_no_partial_file(tmp_path):
    save_atomic({"x": 1}, tmp_path / "ck.pt")
    save_atomic({"x": 2}, tmp_path / "ck.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]
    assert torch.load(tmp_path / "ck.pt")["x"] == 2

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        save_atomic({"x": Unpicklable()}, tmp_path / "ck.pt")
    assert torch.load(tmp_path / "ck.pt")["x"] == 2  # the previous checkpoint survived the failed write
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]
    with pytest.raises(ValueError, match="not an nmst-fast"):
        load_checkpoint(tmp_path / "ck.pt")


def test_cli_writes_results_report_and_plots(tmp_path):
    out = main(["--out", str(tmp_path / "run"), "--heads", "va", "nmst", "--max-epochs", "1", "--max-length", "80",
                "--quiet"])
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"va", "nmst"}
    for head in ("va", "nmst"):
        assert results[head]["perplexity"] > 1.0
        assert set(results[head]["r_nt"]) == {"greedy", "top-k 2", "top-k 4", "nucleus 0.2", "nucleus 0.4",
                                              "beam 2", "beam 4"}
        curve = results[head]["r_nt"]["greedy"]
        assert "80" in curve and all(0.0 <= r <= 1.0 for r in curve.values())
    for name in ("report.md", "r_nt.png", "p_eos.png", "lengths.png", "config.json", "nmst/checkpoint.pt"):
        assert (out / name).is_file(), name


@pytest.mark.parametrize("argv,message", [(["--heads", "bogus"], "unknown head"), (["--eps", "1.5"], "eps"),
                                          (["--arch", "gru"], "unknown arch"),
                                          (["--data-dir", "/no/such/dir"], "does not exist"),
                                          (["--dataset", "wikitext-2"], "--data-dir")])
def test_cli_bad_input_is_one_clear_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as on a machine without it: no hub
    with pytest.raises(SystemExit) as exit_info:
        main(argv + ["--out", str(tmp_path / "bad")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_builtin_run_separates_the_heads(tmp_path):
    """The main command's acceptance: VA's greedy decoding fails to stop for some contexts, ST and
    NMST always stop (NMST by its bound t½), and NMST fits the non-monotone eos pattern better than ST."""
    out = main(["--out", str(tmp_path / "default"), "--quiet"])
    results = json.loads((out / "results.json").read_text())
    L = max(results["va"]["r_nt"]["greedy"], key=int)
    assert results["va"]["r_nt"]["greedy"][L] > 0
    assert results["st"]["r_nt"]["greedy"][L] == 0 and results["nmst"]["r_nt"]["greedy"][L] == 0
    assert max(results["nmst"]["generated_lengths"]["greedy"]) <= results["nmst"]["greedy_bound"]
    assert results["nmst"]["perplexity"] <= results["st"]["perplexity"]


def test_sweep_writes_mean_std_tables(tmp_path):
    from train.sweep import main as sweep

    # ε = 0.02 has t½ = 35 > --max-length 30: its runs decode greedily to 35, where every NMST row has stopped.
    out = sweep(["--out", str(tmp_path / "sweep"), "--builtin-lines", "120", "--max-epochs", "1", "--max-length", "30",
                 "--heads", "va", "nmst", "--eps", "0.05", "0.02", "--seeds", "0", "1", "--quiet"])
    runs = json.loads((out / "sweep.json").read_text())["runs"]
    assert len(runs) == 2 * (1 + 2)  # per seed: VA once (no ε), NMST per ε
    assert {(r["head"], r["eps"]) for r in runs} == {("va", None), ("nmst", 0.05), ("nmst", 0.02)}
    for r in runs:
        greedy_L = "35" if r["eps"] == 0.02 else "30"
        assert max(r["r_nt"]["greedy"], key=int) == greedy_L and max(r["r_nt"]["top-k 2"], key=int) == "30"
        if r["eps"] == 0.02:
            assert r["r_nt"]["greedy"]["35"] == 0
    table = (out / "tables.md").read_text()
    assert "| nmst | 0.05 | 2 |" in table and "±" in table and "| va | — | 2 |" in table
    assert "| nmst | 0.02 | 2 | " in table and " | 35 | " in table and " | 30 | " in table
    assert (out / "sweep_r_nt.png").is_file()
    again = sweep(["--out", str(out), "--builtin-lines", "120", "--max-epochs", "1", "--max-length", "30",
                   "--heads", "va", "nmst", "--eps", "0.05", "0.02", "--seeds", "0", "1", "--quiet"])
    assert json.loads((again / "sweep.json").read_text())["runs"] == runs  # resumed: same numbers


@pytest.mark.parametrize("head", ["va", "st", "nmst"])
def test_teacher_forced_eos_probability_matches_the_full_distribution(head):
    from nmst_fast import nmst_log_probs
    from train.checkpoint import build_model
    from train.evaluate import eos_log_probs
    from train.loop import batches

    vocab, tr, _ = _data(12, 2)
    model = build_model(TrainConfig(head=head, eps=0.05, size="tiny"), vocab).double().eval()
    batch = next(batches(tr, vocab, 6))
    with torch.no_grad():
        got = eos_log_probs(model, batch.inputs, batch.steps)
        hidden, _ = model(batch.inputs)
        full = nmst_log_probs(model.nmst_head(hidden), eos_index=vocab.eos, eps=0.05, head=head, steps=batch.steps)
    torch.testing.assert_close(got, full[..., vocab.eos], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("head", ["va", "st", "nmst"])
def test_eos_probability_by_rows_matches_the_full_distribution(head):
    """train.hf's p(eos) curve: from the eos logit alone (NMST, ST) or a logsumexp over a few rows at a time (VA),
    equal to the full (B, T, V) distribution's, with context positions, a restart of t and a short last chunk."""
    from nmst_fast import NMSTHead, nmst_log_probs
    from train.evaluate import head_eos_log_probs

    g = torch.Generator().manual_seed(11)
    B, T, H, V = 3, 7, 5, 37
    nmst = NMSTHead(H, V, eos_index=4, head=head, eps=0.05, bias=True, softcap=20.0).double()
    with torch.no_grad():
        nmst.weight.copy_(torch.randn(V, H, generator=g, dtype=torch.float64) * 2)
        nmst.bias.copy_(torch.randn(V, generator=g, dtype=torch.float64))
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    steps = torch.tensor([[-1, 0, 1, 2, 3, 4, 5], [1, 2, 3, 1, 2, 3, 4], [0, 0, 0, 0, 0, 1, 2]])
    with torch.no_grad():
        got = head_eos_log_probs(nmst, hidden, steps, rows=4)
        full = nmst_log_probs(nmst(hidden), eos_index=4, eps=0.05, head=head, steps=None if head == "va" else steps)
    torch.testing.assert_close(got, full[..., 4], rtol=1e-9, atol=1e-12)


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path, capsys):
    """A rerun into the same --out with another ε trained nothing (the old run had finished) and
    reported the old weights under the new ε; another size crashed in load_state_dict."""
    vocab, tr, va = _data(30, 10)
    config = TrainConfig(head="nmst", eps=0.05, size="tiny", max_epochs=1, seed=0)
    train(config, tr, va, vocab, tmp_path / "c.pt", progress=False)
    for change in (dict(eps=0.001), dict(size="small"), dict(head="st"), dict(seed=1)):
        with pytest.raises(ValueError, match=next(iter(change))):
            train(TrainConfig(**(dict(head="nmst", eps=0.05, size="tiny", max_epochs=1, seed=0) | change)),
                  tr, va, vocab, tmp_path / "c.pt", progress=False)
    longer = TrainConfig(head="nmst", eps=0.05, size="tiny", max_epochs=2, seed=0)  # training longer is resuming
    assert train(longer, tr, va, vocab, tmp_path / "c.pt", progress=False)[1].epoch == 2
    common = ["--heads", "nmst", "--max-epochs", "1", "--max-length", "20", "--builtin-lines", "60", "--quiet",
              "--out", str(tmp_path / "run")]
    main(common + ["--eps", "0.05"])
    with pytest.raises(SystemExit):
        main(common + ["--eps", "0.001"])
    assert "eps=0.05" in capsys.readouterr().err


def test_a_resumed_cli_run_reads_its_weights_once(tmp_path, monkeypatch):
    """The entry points check every run directory before writing anything: that check maps a
    checkpoint's tensors without reading them, and the run that resumes it loads it once."""
    common = ["--heads", "nmst", "--max-length", "20", "--builtin-lines", "60", "--quiet", "--out", str(tmp_path)]
    main(common + ["--max-epochs", "1"])
    loads = []
    real_load = torch.load

    def recording_load(path, *args, **kwargs):
        loads.append((Path(path).name, kwargs.get("mmap", False)))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    main(common + ["--max-epochs", "2"])
    assert [mmap for name, mmap in loads if name == "checkpoint.pt"] == [True, False]


def _wikitext_dir(tmp_path, splits=("valid", "test"), lines=40):
    data = tmp_path / "wt"
    data.mkdir()
    for split in splits:
        (data / f"{split}.txt").write_text("\n".join(f"{split} line {i} with a few words" for i in range(lines)) + "\n")
    return data


@pytest.mark.parametrize("valid_split", ["valid", "validation"])
def test_early_stopping_text_is_held_out_of_training_under_either_name(tmp_path, valid_split):
    from train.__main__ import _parser
    from train.runner import load_data

    data = _wikitext_dir(tmp_path)
    args = _parser().parse_args(["--data-dir", str(data), "--train-split", "valid", "--valid-split", valid_split,
                                 "--eval-split", "test"])
    loaded = load_data(args)
    assert len(loaded.train) == 36 and len(loaded.valid) == 4  # every 10th line held out
    assert not {tuple(s) for s in loaded.valid} & {tuple(s) for s in loaded.train}
    assert "held out" in loaded.source


@pytest.mark.parametrize("argv,message", [
    (["--max-epochs", "0"], "max_epochs"), (["--max-length", "0"], "max-length"),
    (["--eval-contexts", "0"], "eval-contexts"), (["--eval-contexts", "-1"], "eval-contexts"),
    (["--device", "gpu"], "device"), (["--eval-split", "valid"], "need --data-dir"),
    (["--dataset", "wikitext-2", "--data-dir", "."], "not both")])
def test_cli_refuses_flag_values_before_training(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(argv + ["--out", str(tmp_path / "bad"), "--quiet"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "bad").exists()


def test_cli_refuses_evaluating_on_training_text_and_empty_splits(tmp_path, capsys):
    data = _wikitext_dir(tmp_path)
    with pytest.raises(SystemExit):
        main(["--data-dir", str(data), "--train-split", "valid", "--eval-split", "validation", "--quiet",
              "--out", str(tmp_path / "a")])
    assert "training split" in capsys.readouterr().err
    (data / "test.txt").write_text("")
    with pytest.raises(SystemExit):
        main(["--data-dir", str(data), "--train-split", "valid", "--quiet", "--out", str(tmp_path / "b")])
    assert "no lines in the eval split" in capsys.readouterr().err


def test_greedy_length_reaches_the_runs_bound():
    from argparse import Namespace

    from train.runner import greedy_length

    def run(head, eps=1e-2):
        return TrainConfig(head=head, eps=eps)

    args = Namespace(max_length=None, greedy_length=None)
    assert greedy_length(args, run("va", 1e-5)) == 1000  # VA has no bound
    assert greedy_length(args, run("nmst", 1e-2)) == greedy_length(args, run("st", 1e-3)) == 1000
    assert greedy_length(args, run("nmst", 1e-4)) == 6932 and greedy_length(args, run("st", 1e-5)) == 69315
    assert greedy_length(Namespace(max_length=50, greedy_length=80), run("nmst", 1e-5)) == 80  # the flag wins
    with pytest.raises(SystemExit):
        main(["--max-length", "50", "--greedy-length", "40", "--quiet"])


def test_sweep_counts_a_repeated_value_once(tmp_path):
    from train.sweep import main as sweep

    out = sweep(["--heads", "nmst", "--eps", "0.05", "0.050", "--seeds", "0", "0", "--max-epochs", "1",
                 "--max-length", "10", "--builtin-lines", "60", "--quiet", "--out", str(tmp_path / "sweep")])
    runs = json.loads((out / "sweep.json").read_text())["runs"]
    assert len(runs) == 1


def test_training_stops_when_the_loss_or_the_gradient_turns_non_finite(tmp_path, monkeypatch):
    """A NaN loss went through backward and AdamW into every weight, and the run went on (or failed
    later on 'hidden contains NaN'); now the step stops first, and the checkpoint keeps the last
    finished epoch."""
    from dataclasses import replace

    from nmst_fast.models.recurrent import RecurrentLM
    from train.checkpoint import Diverged

    vocab, tr, va = _data(30, 10)
    config = TrainConfig(head="nmst", eps=0.05, size="tiny", max_epochs=1, seed=0, batch_size=8)
    train(config, tr, va, vocab, tmp_path / "c.pt", progress=False)
    before = load_checkpoint(tmp_path / "c.pt", vocab)
    real_loss, calls = RecurrentLM.loss, []

    def nan_on_the_second_call(self, *args, **kwargs):
        calls.append(1)
        loss = real_loss(self, *args, **kwargs)
        return loss * float("nan") if len(calls) == 2 else loss

    longer = replace(config, max_epochs=2)
    with monkeypatch.context() as patch:
        patch.setattr(RecurrentLM, "loss", nan_on_the_second_call)
        with pytest.raises(Diverged, match=r"training loss \(nmst: epoch 2, batch 2\) is nan"):
            train(longer, tr, va, vocab, tmp_path / "c.pt", progress=False)
    after = load_checkpoint(tmp_path / "c.pt", vocab)
    assert after["state"]["epoch"] == 1 and all(torch.equal(after["model"][k], before["model"][k])
                                                for k in after["model"])
    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.utils, "clip_grad_norm_", lambda parameters, clip: torch.tensor(float("inf")))
        with pytest.raises(Diverged, match=r"gradient norm \(nmst: epoch 2, batch 1\) is inf"):
            train(longer, tr, va, vocab, tmp_path / "c.pt", progress=False)
    # Through the command: a learning rate that diverges ends with one line and exit status 1 (not a
    # usage error, and not a report of the untrained weights).
    with pytest.raises(SystemExit) as exit_info:
        main(["--heads", "nmst", "--lr", "1e10", "--builtin-lines", "20", "--max-epochs", "2", "--max-length", "5",
              "--eval-contexts", "2", "--quiet", "--out", str(tmp_path / "run")])
    assert str(exit_info.value.code).startswith("python -m train: ") and "diverged" in str(exit_info.value.code)
    assert not (tmp_path / "run" / "results.json").exists()


def test_cli_resumes_only_on_its_own_data_and_directory(tmp_path, capsys):
    """A rerun on other data continued the run (early stopping compared two validation sets); a
    refused resume still rewrote config.json; another command's directory had its results.json
    overwritten; a --out that cannot be a directory gave a traceback."""
    common = ["--heads", "va", "--max-epochs", "1", "--max-length", "10", "--eval-contexts", "2", "--quiet"]
    out = tmp_path / "run"
    main(common + ["--builtin-lines", "40", "--out", str(out)])
    config = (out / "config.json").read_text()
    for change, message in ((["--builtin-lines", "50"], "data="), (["--builtin-lines", "40", "--lr", "0.005"], "lr=")):
        with pytest.raises(SystemExit) as exit_info:
            main(common + change + ["--out", str(out)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
        assert (out / "config.json").read_text() == config  # nothing written
    main(common + ["--builtin-lines", "40", "--max-epochs", "2", "--out", str(out)])  # training longer resumes
    (tmp_path / "a_file").write_text("x")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "results.json").write_text("{}")
    other_command = tmp_path / "gpt2_run"
    other_command.mkdir()
    (other_command / "run.json").write_text(json.dumps(dict(entry="train.gpt2", data="0123")))
    for bad, message in ((tmp_path / "a_file", "cannot be made a directory"), (foreign, "no run.json"),
                         (other_command, "entry='train.gpt2'")):
        with pytest.raises(SystemExit) as exit_info:
            main(common + ["--builtin-lines", "40", "--out", str(bad)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    assert (foreign / "results.json").read_text() == "{}"


def test_sweep_tables_take_an_infinite_perplexity():
    import math

    from train.sweep import _mean_std

    assert _mean_std([1.0, 3.0]) == "2.000 ± 1.414"
    assert _mean_std([math.inf, 5.0]) == "inf (a seed's value is inf)"
    assert _mean_std([math.nan, 5.0]).endswith("(a seed's value is NaN)")


def test_data_fingerprint_sees_tokens_order_and_boundaries():
    from train.checkpoint import data_fingerprint

    base = data_fingerprint([[1, 2], [3]], [[4]])
    assert base == data_fingerprint([[1, 2], [3]], [[4]])
    for other in (([[1, 2, 3]], [[4]]), ([[3], [1, 2]], [[4]]), ([[1, 2], [3]], [[5]]), ([[1, 2], [3], [4]], [])):
        assert data_fingerprint(*other) != base


def test_epoch_batches_hold_lines_of_similar_length():
    """Each epoch's order cuts into batches of lines of similar length (little padding), differs by
    epoch and seed, covers every line once, and leaves the one short batch last."""
    from train.loop import POOL_BATCHES, epoch_order

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 700, (POOL_BATCHES * 8 * 3 + 5,), generator=gen).tolist()
    config = TrainConfig(batch_size=8)
    order = epoch_order(config, 0, lengths)
    assert sorted(order.tolist()) == list(range(len(lengths)))
    assert torch.equal(order, epoch_order(config, 0, lengths))  # a resume sees the same batches
    assert not torch.equal(order, epoch_order(config, 1, lengths))
    assert not torch.equal(order, epoch_order(TrainConfig(batch_size=8, seed=1), 0, lengths))
    batches = order.split(8)
    assert len(batches[-1]) == 5 and all(len(b) == 8 for b in batches[:-1])
    padded = sum(len(b) * max(lengths[i] for i in b.tolist()) for b in batches)
    assert padded < 1.1 * sum(lengths)  # random batches of 8 would pad to ~1.6× the text
    starts = [lengths[int(b[0])] for b in batches[:-1]]
    assert starts != sorted(starts)  # the batches themselves come in random order
