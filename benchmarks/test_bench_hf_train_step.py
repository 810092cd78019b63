"""benchmarks.hf_train_step runs on a tiny model (its numbers are RESULTS', at a Llama shape)."""

from benchmarks import hf_train_step


def test_the_training_step_benchmark_runs():
    result = hf_train_step.main(["--vocab", "300", "--hidden", "64", "--layers", "1", "--seq", "16", "--rounds", "2"])
    assert set(result["median_s"]) == {"plain HF loss", "NMST head"} and result["head_over_plain"] > 0
