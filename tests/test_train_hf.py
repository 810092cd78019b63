"""python -m train.hf: any causal LM family, random init or a local model directory, a BPE trained on
the corpus when no tokenizer is given; the fused loss, evaluation, plots and the saved head."""

import json

import pytest
import transformers

from train.hf import main


def _run(corpus, out, *extra):
    return main(["--data-dir", str(corpus), "--max-length", "6", "--eval-contexts", "3", "--vocab-size", "300",
                 "--max-tokens", "256", "--quiet", "--out", str(out), *extra])


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
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "tokenizer")
    saved = transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    assert saved.config.model_type == family and saved.config.vocab_size == len(tokenizer) <= 300
    assert saved.config.nmst == dict(head="nmst", eps=0.05, context_length=10, eos_token_id=tokenizer.eos_token_id)


def test_a_local_model_directory_and_its_tokenizer(corpus, tmp_path):
    """--model-dir (from_pretrained) with the tokenizer in the same directory; the run resumes."""
    first = _run(corpus, tmp_path / "first", "--config", "qwen2", "--head", "st", "--eps", "0.05")
    model_dir = tmp_path / "pretrained"
    transformers.AutoModelForCausalLM.from_pretrained(first / "model").save_pretrained(model_dir)
    transformers.AutoTokenizer.from_pretrained(first / "tokenizer").save_pretrained(model_dir)
    common = ["--model-dir", str(model_dir), "--head", "st", "--eps", "0.05", "--epochs", "2"]
    cut = _run(corpus, tmp_path / "cut", *common, "--stop-after", "1")
    resumed = _run(corpus, cut, *common)
    full = _run(corpus, tmp_path / "full", *common)
    assert json.loads((full / "results.json").read_text()) == json.loads((resumed / "results.json").read_text())
    assert json.loads((full / "run.json").read_text())["entry"] == "train.hf"


def test_bad_flags_are_refused_before_anything_is_written(corpus, tmp_path, capsys):
    for flags in (["--vocab-size", "1"], ["--config", "no-such-family"], ["--model-dir", str(tmp_path / "none")]):
        with pytest.raises(SystemExit) as exit_info:
            _run(corpus, tmp_path / "bad", *flags)
        assert exit_info.value.code == 2 and "Traceback" not in capsys.readouterr().err
        assert not (tmp_path / "bad").exists()
