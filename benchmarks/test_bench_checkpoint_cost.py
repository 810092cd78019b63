"""benchmarks.checkpoint_cost runs end to end on a tiny model (its numbers are RESULTS', at real size)."""

import json

from benchmarks import checkpoint_cost


def test_the_checkpoint_cost_report_runs(tmp_path, capsys):
    checkpoint_cost.main(["--tiny", "--layers", "2", "--rounds", "1", "--dir", str(tmp_path),
                          "--json", str(tmp_path / "out.json")])
    result = json.loads((tmp_path / "out.json").read_text())
    assert set(result["loads"]) == set(checkpoint_cost.LOADS) and set(result["exports"]) == set(checkpoint_cost.EXPORTS)
    assert result["loads"]["plain from_pretrained"]["x_plain"] == 1.0
    assert all(r["file_gb"] > 0 and r["peak_gb"] >= 0 for r in result["exports"].values())
    assert 0 < result["largest_tensor_gb"] < result["checkpoint_gb"]
