"""The HF generate benchmark runs (a small shape): every case pairs the head's runs with the plain model's, and
the head's eos column takes a share of the head's step. ``python -m benchmarks.hf_generate`` runs the issue's
shapes (V = 128256 and 50257, B = 1 and 8)."""

from benchmarks import hf_generate


def test_the_head_and_the_plain_model_are_timed_side_by_side():
    rows = hf_generate.main(["--vocabs", "1000", "--batches", "2", "--hidden", "64", "--layers", "1",
                             "--new-tokens", "3", "--rounds", "2"])
    assert [(r["sampling"], r["batch"]) for r in rows] == [("greedy", 2), ("sampled", 2)]
    assert all(r["ratio"] > 0 and 0 < r["head_share"] < 1 for r in rows), rows
