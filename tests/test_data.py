"""WikiText word-level pipeline on small fixtures: context padding, blank lines, eos, vocabulary."""

import pytest
import torch

from nmst_fast.data import CONTEXT_LENGTH, Vocabulary, collate, encode_lines, find_split_file, load_wikitext_split

TRAIN = [" = Heading = ", "", " the cat sat on the mat because it was warm and dry today . ", " short line "]


def _write(tmp_path, name, lines):
    (tmp_path / name).write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_vocabulary_from_training_split_with_specials_last():
    vocab = Vocabulary.from_lines(TRAIN)
    assert vocab.words[-1] == "<eos>" and vocab.eos == len(vocab) - 1
    assert vocab.words[:3] == ["=", "Heading", "the"]
    assert vocab.id("unseen") == vocab.ids["<unk>"]
    assert Vocabulary.from_json(vocab.to_json()) == vocab


def test_encoding_pads_context_and_keeps_blank_lines_and_headings():
    vocab = Vocabulary.from_lines(TRAIN)
    seqs = encode_lines(TRAIN, vocab)
    bos, cpad, eos = vocab.ids["<bos>"], vocab.ids["<cpad>"], vocab.eos
    assert len(seqs) == 4  # the blank line is a sequence too
    assert seqs[1] == [bos] + [cpad] * CONTEXT_LENGTH + [eos]
    assert seqs[0] == [bos] + [cpad] * 7 + vocab.encode(["=", "Heading", "="]) + [eos]
    long = TRAIN[2].split()
    assert seqs[2] == [bos] + vocab.encode(long) + [eos] and len(long) > CONTEXT_LENGTH


def test_collate_targets_steps_and_padding():
    vocab = Vocabulary.from_lines(TRAIN)
    seqs = encode_lines(TRAIN, vocab)
    batch = collate(seqs, pad_id=vocab.pad)
    T = max(len(s) for s in seqs) - 1
    assert batch.inputs.shape == batch.targets.shape == batch.steps.shape == (4, T)
    # Target i predicts seq[i + 1]; the first token after the 10-token context has t = 1.
    assert batch.steps[0, CONTEXT_LENGTH].item() == 1 and batch.steps[0, CONTEXT_LENGTH - 1].item() == 0
    assert (batch.steps[:, :CONTEXT_LENGTH] == 0).all()  # every context position is t = 0
    assert batch.targets[1, CONTEXT_LENGTH].item() == vocab.eos  # a blank line: eos right after the context
    assert (batch.targets[1, CONTEXT_LENGTH + 1:] == -100).all()
    assert batch.lengths.tolist() == [len(s) - 1 for s in seqs]
    assert torch.equal(batch.inputs[2, : batch.lengths[2]], torch.tensor(seqs[2][:-1]))


@pytest.mark.parametrize("names", [("wiki.train.tokens", "wiki.test.tokens"), ("train.txt", "test.txt")])
def test_load_from_directory_both_file_conventions(tmp_path, names):
    _write(tmp_path, names[0], TRAIN)
    _write(tmp_path, names[1], [" the dog sat ", ""])
    train, vocab = load_wikitext_split(tmp_path, "train")
    test, same_vocab = load_wikitext_split(tmp_path, "test", vocab=vocab)
    assert same_vocab is vocab and len(train) == 4 and len(test) == 2
    assert vocab.ids["<unk>"] in test[0]  # "dog" is not in the training vocabulary


def test_clear_errors_for_missing_data(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_split_file(tmp_path / "nope", "train")
    with pytest.raises(FileNotFoundError, match="wiki.valid.tokens"):
        find_split_file(tmp_path, "valid")
    with pytest.raises(ValueError, match="split"):
        find_split_file(tmp_path, "dev")


def test_hub_loading_explains_what_to_do_when_unavailable(monkeypatch):
    import sys
    import types

    from nmst_fast.data import hub_lines

    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(RuntimeError, match="datasets` package is not installed"):
        hub_lines("wikitext-2", "train")

    def offline(*args, **kwargs):
        raise ConnectionError("no route to huggingface.co")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(RuntimeError, match="could not load wikitext-2 .validation. from the Hugging Face hub"):
        hub_lines("wikitext-2", "valid")

    seen = {}

    def fake_load(path, config, split):
        seen.update(path=path, config=config, split=split)
        return [{"text": " = Heading = \n"}, {"text": ""}, {"text": " some words \n"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=fake_load))
    assert hub_lines("wikitext-103", "test") == [" = Heading = ", "", " some words "]
    assert seen == dict(path="wikitext", config="wikitext-103-v1", split="test")
    with pytest.raises(ValueError, match="name"):
        hub_lines("wikitext-7", "test")
