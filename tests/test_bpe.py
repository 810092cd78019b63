"""GPT-2 BPE data: local tokenizer files, the 11–1024-token filter, length bucketing."""

import random

import pytest
import torch
from tokenizers import ByteLevelBPETokenizer

from nmst_fast.data.bpe import bucket_batches, collate_bpe, encode_bpe_lines, load_gpt2_tokenizer

WORDS = "the river flows past stone and reed while bells ring out over the harbor".split()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A tiny byte-level BPE in GPT-2's file format (vocab.json + merges.txt): no download."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) for _ in range(300)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"])
    path = tmp_path_factory.mktemp("gpt2-tokenizer")
    bpe.save_model(str(path))
    return path


def test_lines_become_eos_terminated_sequences_of_11_to_1024_tokens(tokenizer_dir):
    tok = load_gpt2_tokenizer(tokenizer_dir)
    lines = ["", " = Heading = ", "the river", " ".join(["harbor bells ring"] * 5), " ".join(["stone"] * 2000)]
    seqs = encode_bpe_lines(lines, tok)
    lengths = [len(tok(" " + line.strip(), add_special_tokens=False)["input_ids"]) + 1
               for line in lines if line.strip()]
    expected = [n for n in lengths if 11 <= n <= 1024]
    assert [len(s) for s in seqs] == expected and len(expected) < len(lengths)  # short and long lines dropped
    assert all(s[-1] == tok.eos_token_id for s in seqs)


def test_lines_are_stripped_and_take_one_prefix_space(tokenizer_dir):
    """WikiText lines start and end with a space: the trailing one must not become a bare-space
    token before every eos; the text between survives the round trip."""
    tok = load_gpt2_tokenizer(tokenizer_dir)
    line = " the river flows past stone and reed while bells ring out over the harbor \n"
    (seq,) = encode_bpe_lines([line], tok)
    assert tok.decode(seq[:-1]) == " " + line.strip()
    assert tok.convert_ids_to_tokens(seq[-2]) != "Ġ" and seq[-1] == tok.eos_token_id
    assert encode_bpe_lines(["the river flows past stone and reed while bells ring out"], tok)[0][:-1] == \
        encode_bpe_lines(["  the river flows past stone and reed while bells ring out  "], tok)[0][:-1]


def test_bucketing_bounds_tokens_per_batch_and_covers_every_sequence_once():
    rng = random.Random(1)
    lengths = [rng.randint(11, 1024) for _ in range(500)]
    batches = bucket_batches(lengths, max_tokens=1024, seed=3)
    assert sorted(i for b in batches for i in b) == list(range(500))
    assert all(len(b) * max(lengths[i] for i in b) <= 1024 for b in batches)
    assert batches == bucket_batches(lengths, max_tokens=1024, seed=3)
    assert batches != bucket_batches(lengths, max_tokens=1024, seed=4)  # the order is shuffled by seed
    padding = sum(len(b) * max(lengths[i] for i in b) - sum(lengths[i] for i in b) for b in batches)
    assert padding < 0.05 * sum(lengths)  # sorted buckets: little padding


def test_collate_masks_padding_in_labels():
    batch = collate_bpe([[5, 6, 7], [8]], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch.labels.tolist() == [[5, 6, 7], [8, -100, -100]]
    assert torch.equal(batch.attention_mask, torch.tensor([[1, 1, 1], [1, 0, 0]]))


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_gpt2_tokenizer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="vocab.json"):
        load_gpt2_tokenizer(tmp_path)


def test_gpt2_fine_tuning_command_end_to_end(tokenizer_dir, tmp_path):
    """python -m train.gpt2 on a random-init GPT-2 and a local corpus: fused NMST loss, results, saved head."""
    import json

    import transformers

    from train.gpt2 import main

    files = _gpt2_run_files(tokenizer_dir, tmp_path)
    out = main(files + ["--head", "nmst", "--eps", "0.05", "--max-length", "20", "--eval-contexts", "6",
                        "--out", str(tmp_path / "run")])
    results = json.loads((out / "results.json").read_text())["nmst"]
    assert results["perplexity"] > 1 and set(results["r_nt"]) >= {"greedy", "top-k 2", "nucleus 0.4", "beam 4"}
    saved = transformers.GPT2LMHeadModel.from_pretrained(out / "model").config
    assert saved.nmst == dict(head="nmst", eps=0.05, context_length=10, eos_token_id=saved.eos_token_id)
    with pytest.raises(SystemExit):
        main(files + ["--max-length", "60", "--out", str(tmp_path / "run2")])  # 10 + 60 - 1 > 64 positions


@pytest.mark.slow
def test_gpt2_fine_tuning_interrupted_and_resumed_equals_one_run(tokenizer_dir, tmp_path):
    """Interrupted after one of two epochs, then resumed: the same model and results as an uninterrupted run."""
    import json

    import transformers

    from train.gpt2 import main

    files = _gpt2_run_files(tokenizer_dir, tmp_path)
    common = files + ["--head", "st", "--eps", "0.05", "--epochs", "2"]
    full = main(common + ["--out", str(tmp_path / "full")])
    main(common + ["--out", str(tmp_path / "cut"), "--stop-after", "1"])
    resumed = main(common + ["--out", str(tmp_path / "cut")])
    a = transformers.GPT2LMHeadModel.from_pretrained(full / "last").state_dict()
    b = transformers.GPT2LMHeadModel.from_pretrained(resumed / "last").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((full / "results.json").read_text()) == json.loads((resumed / "results.json").read_text())


def _gpt2_run_files(tokenizer_dir, tmp_path, n_positions=64):
    """A random-init GPT-2 directory and a small local corpus (one line of ~100 tokens in train)."""
    import transformers

    tok = load_gpt2_tokenizer(tokenizer_dir)
    config = transformers.GPT2Config(vocab_size=len(tok), n_positions=n_positions, n_embd=32, n_layer=1, n_head=2,
                                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    rng = random.Random(3)
    data = tmp_path / "wikitext"
    data.mkdir()
    for split, n in (("train", 30), ("valid", 8), ("test", 8)):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(14, 30))) for _ in range(n)]
        if split == "train":
            lines.append(" ".join(rng.choice(WORDS) for _ in range(100)))  # longer than 64 positions
        (data / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return ["--model-dir", str(tmp_path / "gpt2"), "--tokenizer-dir", str(tokenizer_dir), "--data-dir", str(data),
            "--max-length", "5", "--eval-contexts", "2", "--quiet"]


@pytest.mark.parametrize("flag,value", [("--epochs", "0"), ("--lr", "-1"), ("--eval-contexts", "0"),
                                        ("--max-length", "0"), ("--context-length", "0"), ("--max-tokens", "10"),
                                        ("--device", "gpu")])
def test_gpt2_command_refuses_bad_flags_up_front(tokenizer_dir, tmp_path, capsys, flag, value):
    from train.gpt2 import main

    common = _gpt2_run_files(tokenizer_dir, tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        argv = [a for a in common if a != "--quiet"]
        pairs = dict(zip(argv[::2], argv[1::2])) | {flag: value, "--out": str(tmp_path / "bad")}
        main([a for pair in pairs.items() for a in pair] + ["--quiet"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert flag.lstrip("-").split("-")[0] in err and "Traceback" not in err
    assert not (tmp_path / "bad").exists()  # refused before anything was written


def test_gpt2_command_resumes_only_its_own_run_and_survives_a_cut_swap(tokenizer_dir, tmp_path, capsys):
    """A line longer than the position table is left out (it crashed training); a rerun into the same
    --out with another head is refused; a model swap cut between its renames is undone."""
    import os

    import transformers

    from train.checkpoint import recover_model_dir
    from train.gpt2 import main

    common = _gpt2_run_files(tokenizer_dir, tmp_path) + ["--max-tokens", "256", "--eps", "0.05"]
    out = main(common + ["--head", "nmst", "--out", str(tmp_path / "run"), "--stop-after", "1", "--epochs", "2"])
    with pytest.raises(SystemExit):
        main(common + ["--head", "va", "--out", str(out), "--epochs", "2"])
    assert "head='nmst'" in capsys.readouterr().err
    # Cut between the two renames of a swap: `last` moved aside, the new one not yet in place.
    os.replace(out / "last", out / "last.old")
    recover_model_dir(out / "last")
    assert transformers.GPT2LMHeadModel.from_pretrained(out / "last").config.nmst["head"] == "nmst"
    os.replace(out / "model", out / "model.old")
    resumed = main(common + ["--head", "nmst", "--out", str(out), "--epochs", "2"])  # recovers `model` itself
    assert (resumed / "results.json").is_file() and not (out / "model.old").exists()


def test_gpt2_command_stops_on_divergence_and_resumes_only_on_its_data(tokenizer_dir, tmp_path, capsys, monkeypatch):
    """The GPT-2 path: a perplexity past exp(709) raised OverflowError (after the epoch had trained,
    before its state was saved), a NaN went on into the weights, and a rerun on other data resumed."""
    import types

    import train.loop
    from train.gpt2 import main
    from train.loop import token_perplexity as perplexity

    class Huge(torch.nn.Module):  # a patched model whose summed NLL overflows exp
        _nmst_shifts_labels = True  # what apply_nmst records of a class that shifts its labels

        def forward(self, input_ids, **kwargs):
            return types.SimpleNamespace(loss=torch.tensor(1e6))

    assert perplexity(Huge(), [[1] * 12], 10, 64, 0, "cpu") == float("inf")
    common = _gpt2_run_files(tokenizer_dir, tmp_path) + ["--head", "nmst", "--eps", "0.05", "--epochs", "2"]
    out = main(common + ["--out", str(tmp_path / "run"), "--stop-after", "1"])
    valid = tmp_path / "wikitext" / "valid.txt"
    valid.write_text(valid.read_text().replace("a", "b"))
    with pytest.raises(SystemExit) as exit_info:
        main(common + ["--out", str(out)])
    assert exit_info.value.code == 2
    assert "data=" in capsys.readouterr().err
    monkeypatch.setattr(train.loop, "token_perplexity", lambda *args: float("nan"))
    with pytest.raises(SystemExit) as exit_info:
        main(common + ["--out", str(tmp_path / "nan")])
    message = str(exit_info.value.code)
    assert message.startswith("python -m train.gpt2: the validation perplexity (epoch 1) is nan")
    assert not (tmp_path / "nan" / "train_state.pt").exists()  # nothing non-finite saved
