"""benchmarks.hf_forward runs on a tiny model (its numbers are RESULTS', at a Llama shape)."""

from benchmarks import hf_forward


def test_the_forward_benchmark_runs():
    (row,) = hf_forward.main(["--vocabs", "300", "--hidden", "64", "--layers", "1", "--seq", "16", "--rounds", "2"])
    assert row["V"] == 300 and row["head_over_plain"] > 0
