"""The HF memory benchmark runs (a small shape): the patched step's peak sits below the unpatched
one's by at least the fp32 logits it no longer forms. ``python -m benchmarks.hf_memory`` runs the
issue's shape (V = 128256)."""

from benchmarks import hf_memory


def test_patched_step_saves_at_least_the_logits():
    result = hf_memory.main(["--vocab", "32000", "--hidden", "64", "--layers", "1", "--batch", "2", "--seq", "256"])
    assert result["saved"] >= result["logits_fp32"], result
