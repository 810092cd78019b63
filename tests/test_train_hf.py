"""python -m train.hf: any causal LM family, random init or a local model directory, a BPE trained on
the corpus when no tokenizer is given; the fused loss, evaluation, plots and the saved head; the model
and its tokenizer saved in one directory (atomically), which from_pretrained, vLLM and lm-eval read."""

import json
import os

import pytest
import torch
import transformers

from nmst_fast.data.bpe import train_byte_level_bpe
from train.checkpoint import add_tokenizer, save_model_atomic
from train.hf import main, model_dirs_tokenizer

from hf_models import tiny_model

# What save_pretrained of a causal LM and of a tokenizer write (transformers 4.x and 5.x); anything
# else in a saved model directory (a training state, an adapter or params.json, a sub-directory, a
# temporary file) is a file a server could take for part of the model.
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors"}
# A model with a head: the NMST checkpoint type's nmst_checkpoint.py, which config.json's auto_map names.
HEAD_FILES = {"nmst_checkpoint.py"}
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "chat_template.jinja"}


def _run(corpus, out, *extra):
    return main(["--data-dir", str(corpus), "--max-length", "6", "--eval-contexts", "3", "--vocab-size", "300",
                 "--max-tokens", "256", "--quiet", "--out", str(out), *extra])


def _assert_servable(run, name):
    """``run/name`` is one plain directory of a model and its tokenizer, with nothing beside them."""
    directory = run / name
    entries = {p.name: p for p in directory.iterdir()}
    assert all(p.is_file() for p in entries.values()), sorted(entries)
    allowed = MODEL_FILES | HEAD_FILES | TOKENIZER_FILES
    assert MODEL_FILES | {"tokenizer.json", "tokenizer_config.json"} <= set(entries) <= allowed
    assert not any((run / f"{name}{suffix}").exists() for suffix in (".tmp", ".old"))  # no swap left over


def _tokenizer_files(directory):
    return {p.name for p in directory.iterdir()} & TOKENIZER_FILES


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_random_init_family_with_a_trained_bpe(corpus, tmp_path, family):
    out = _run(corpus, tmp_path / "run", "--config", family, "--head", "nmst", "--eps", "0.05")
    results = json.loads((out / "results.json").read_text())["nmst"]
    assert 1 < results["perplexity"] < float("inf")
    assert set(results["r_nt"]) >= {"greedy", "top-k 2", "nucleus 0.4", "beam 4"}
    for artifact in ("r_nt.png", "p_eos.png", "lengths.png", "report.md"):  # as python -m train writes them
        assert (out / artifact).stat().st_size > 0
    assert results["p_eos"]["t"][0] == 1 and 0 <= min(results["p_eos"]["model"]) <= max(results["p_eos"]["model"]) <= 1
    assert len(results["examples"]) == 3 and set(results["generated_lengths"]) == set(results["r_nt"])
    # The trained BPE lies beside the best model and the latest: each directory is all a server needs.
    assert not (out / "tokenizer").exists()
    for name in ("model", "last"):
        _assert_servable(out, name)
        tokenizer = transformers.AutoTokenizer.from_pretrained(out / name)
        saved = transformers.AutoModelForCausalLM.from_pretrained(out / name)
        assert (saved.config.model_type, saved.config.base_model_type) == ("nmst", family)  # the NMST checkpoint type
        assert (out / name / "nmst_checkpoint.py").is_file()
        assert saved.config.vocab_size == len(tokenizer) <= 300
        eos = tokenizer.eos_token_id
        assert saved.config.eos_token_id == eos is not None
        assert saved.config.nmst == dict(head="nmst", eps=0.05, context_length=10, eos_token_id=eos)
        line = " " + (corpus / "test.txt").read_text().splitlines()[0]  # a line as training fed it
        ids = tokenizer.encode(line, add_special_tokens=False)
        assert tokenizer.decode(ids) == line and len(ids) < len(line.encode())  # merges, not bytes alone
        assert json.loads((out / name / "config.json").read_text())["nmst"]["head"] == "nmst"


def test_a_local_model_directory_and_its_tokenizer(corpus, tmp_path):
    """A run written when its tokenizer was kept apart (in the run's tokenizer/) reruns into the new
    layout; --model-dir a run's model/ (from_pretrained, the tokenizer in the same directory) trains,
    and that run resumes."""
    flags = ("--config", "qwen2", "--head", "st", "--eps", "0.05")
    first = _run(corpus, tmp_path / "first", *flags)
    results = (first / "results.json").read_text()
    legacy = first / "tokenizer"
    legacy.mkdir()
    for name in ("model", "last"):
        for file in _tokenizer_files(first / name):
            os.replace(first / name / file, legacy / file)  # the same BPE in both
    assert not _tokenizer_files(first / "model") and _tokenizer_files(legacy)
    assert model_dirs_tokenizer(first / "model") == legacy  # --model-dir such a run's model/ still works
    vocab = transformers.AutoTokenizer.from_pretrained(legacy).get_vocab()
    # Rerun (its epochs done: evaluated again): the run's models get its tokenizer, nothing else changes.
    _run(corpus, first, *flags)
    assert (first / "results.json").read_text() == results
    for name in ("model", "last"):
        _assert_servable(first, name)
        assert transformers.AutoTokenizer.from_pretrained(first / name).get_vocab() == vocab

    common = ["--model-dir", str(first / "model"), "--head", "st", "--eps", "0.05", "--epochs", "2"]
    cut = _run(corpus, tmp_path / "cut", *common, "--stop-after", "1")
    resumed = _run(corpus, cut, *common)
    full = _run(corpus, tmp_path / "full", *common)
    assert json.loads((full / "results.json").read_text()) == json.loads((resumed / "results.json").read_text())
    assert json.loads((full / "run.json").read_text())["entry"] == "train.hf"
    for name in ("model", "last"):
        _assert_servable(resumed, name)
        assert transformers.AutoTokenizer.from_pretrained(resumed / name).get_vocab() == vocab


def test_a_failed_save_leaves_the_previous_model_whole(tmp_path):
    """save_model_atomic writes the model and its tokenizer into a fresh directory and swaps it in: an
    error while writing leaves the previous directory as it was and no partial one; add_tokenizer
    completes a model-only directory the same way, its weights unchanged."""
    tokenizer = train_byte_level_bpe(["the river flows past stone and reed"] * 4, vocab_size=300)
    model = tiny_model("llama", seed=1, dtype=torch.float32)
    path = tmp_path / "model"
    save_model_atomic(model, path, tokenizer=tokenizer)
    _assert_servable(tmp_path, "model")
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    class Failing:  # a tokenizer whose save dies halfway (a full disk, a kill)
        def save_pretrained(self, directory):
            (directory / "tokenizer.json").write_text("{")
            raise OSError("No space left on device")

    with torch.no_grad():
        model.get_output_embeddings().weight.add_(1.0)
    with pytest.raises(OSError, match="No space"):
        save_model_atomic(model, path, tokenizer=Failing())
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]

    bare = tmp_path / "bare"
    model.save_pretrained(bare)
    weights = (bare / "model.safetensors").read_bytes()
    with pytest.raises(FileNotFoundError, match="--tokenizer-dir"):
        model_dirs_tokenizer(bare)  # not a run's model/: nothing beside it to read
    add_tokenizer(bare, tokenizer)
    _assert_servable(tmp_path, "bare")
    assert (bare / "model.safetensors").read_bytes() == weights
    assert transformers.AutoTokenizer.from_pretrained(bare).get_vocab() == tokenizer.get_vocab()
    assert model_dirs_tokenizer(bare) == bare


def test_bad_flags_are_refused_before_anything_is_written(corpus, tmp_path, capsys):
    for flags in (["--vocab-size", "1"], ["--config", "no-such-family"], ["--model-dir", str(tmp_path / "none")]):
        with pytest.raises(SystemExit) as exit_info:
            _run(corpus, tmp_path / "bad", *flags)
        assert exit_info.value.code == 2 and "Traceback" not in capsys.readouterr().err
        assert not (tmp_path / "bad").exists()


def test_bf16_training_reaches_the_gradient_filter(corpus, tmp_path, monkeypatch):
    """--bf16 trains under autocast, so the fused loss sees bf16 inputs and --grad-filter auto (off in float32)
    filters; the run finishes with a finite perplexity, and a resumed run must match both flags."""
    from nmst_fast import grad_filter

    dtypes = []
    init = grad_filter.GradFilter.__init__

    def recorded(self, threshold, weight, *args):
        dtypes.append((threshold, weight.dtype))
        init(self, threshold, weight, *args)

    monkeypatch.setattr(grad_filter.GradFilter, "__init__", recorded)
    out = _run(corpus, tmp_path / "run", "--config", "llama", "--bf16", "--grad-filter", "auto", "--epochs", "1")
    assert dtypes and set(dtypes) == {(2.0**-12, torch.bfloat16)}
    assert 1 < json.loads((out / "results.json").read_text())["nmst"]["perplexity"] < float("inf")
    settings = torch.load(out / "train_state.pt", weights_only=False)["settings"]  # what a resumed run must match
    assert settings["bf16"] is True and settings["grad_filter"] == "auto"


def test_a_bad_grad_filter_flag_is_refused(corpus, tmp_path, capsys):
    for value in ("often", "2"):
        with pytest.raises((SystemExit, ValueError)) as info:
            _run(corpus, tmp_path / "bad", "--grad-filter", value)
        if info.type is SystemExit:
            assert info.value.code == 2
        assert not (tmp_path / "bad").exists()
