"""The dW-accumulator error report runs (a small shape) and writes its JSON: with bf16 accumulation dW
stays within a few bf16 roundings of float64. ``python -m benchmarks.dw_dtype`` runs the full shape."""

import json

from benchmarks import dw_dtype


def test_report_runs_and_writes_json(tmp_path):
    result = dw_dtype.main(["--rows", "256", "--hidden", "32", "--vocab", "300", "--chunk", "32",
                            "--json", str(tmp_path / "dw.json")])
    assert json.loads((tmp_path / "dw.json").read_text()) == result
    for row in result["errors"]:
        assert row["fused_fp32_acc"] < 1e-2 and row["fused_bf16_acc"] < 3e-2, row
