"""The gradient filter's benchmark runs (a small shape) and writes its JSON; on the synthetic workload the filter
keeps a small share of the vocabulary and its bf16 gradients are as accurate as the unfiltered ones.
``python -m benchmarks.grad_filter`` runs the full shapes."""

import json

from benchmarks import grad_filter


def test_report_runs_and_writes_json(tmp_path, capsys):
    grad_filter.main(["--shape", "1024", "128", "8191", "--rounds", "1", "--error-rows", "512",
                      "--json", str(tmp_path / "gf.json")])
    rows = {r["workload"]: r for r in json.loads((tmp_path / "gf.json").read_text())}
    assert set(rows) == {"synthetic", "random"}
    assert rows["synthetic"]["kept_share"] < 0.75 and rows["random"]["kept_share"] == 1.0
    # frequency-numbered rows and random ones keep the ids' order: the sorted and id-order cases filter alike
    for name in ("synthetic", "random"):
        assert not rows[name]["sorted"] and rows[name]["kept_share_id_order"] == rows[name]["kept_share"]
    for label in ("unfiltered", "filtered"):
        assert all(e < 2e-2 for e in rows["synthetic"]["errors"][label])
    assert "| synthetic | 1024×128×8191 |" in capsys.readouterr().out
