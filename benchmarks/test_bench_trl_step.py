"""benchmarks.trl_step runs on a tiny model (its numbers are RESULTS', at Qwen3-0.6B's vocabulary and width)."""

from benchmarks import trl_step


def test_the_trl_step_benchmark_runs():
    result = trl_step.main(["--vocab", "300", "--hidden", "64", "--layers", "1", "--seq", "16", "--rounds", "2"])
    assert set(result["median_s"]) == {"plain model", "NMST head"} and result["head_over_plain"] > 0
    # both trainers log the statistics the head's pass computes
    assert result["logged"]["NMST head"] == result["logged"]["plain model"] == ["entropy", "mean_token_accuracy"]


def test_the_grpo_step_benchmark_runs():
    result = trl_step.main(["--trainer", "grpo", "--vocab", "300", "--hidden", "64", "--layers", "1", "--seq", "8",
                            "--completion", "4", "--rounds", "2"])
    assert result["trainer"] == "grpo" and result["head_over_plain"] > 0
