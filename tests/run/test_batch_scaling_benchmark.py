"""benchmarks/batch_scaling.py --quick, as CI runs it: one AdamW sweep over two batches (64, 128), two lr rules
and one seed on a tenth of the expanded digits ends with the verdict lines, a table row per batch
and rule with the lr each rule gave, the plot, the jobs file the report is written from, and the
sweep's own comparison beside them."""

from __future__ import annotations

import json

import pytest

from tests.helpers import benchmark

pytestmark = pytest.mark.run


def test_the_quick_study_writes_its_verdicts_table_jobs_and_plot(tmp_path):
    batch_scaling = benchmark("batch_scaling")
    out = tmp_path / "batch_scaling.md"
    batch_scaling.main(["--quick", "--out", str(out), "--runs", str(tmp_path / "runs")])
    text = out.read_text()
    # one seed: a difference but no interval, so nothing is called beyond the noise
    assert "- adamw, sqrt rule, val accuracy against batch 64: 128: " in text and "fewer than 2 seeds" in text
    assert "- adamw, sqrt against none: beyond the noise better at no batch; worse at no batch" in text
    # the sqrt rule moves AdamW's 0.004 at batch 256 to 0.002 at 64 and 0.00283 at 128; none keeps it
    for row in ("| 64 | sqrt (default) | 0.002 |", "| 128 | sqrt (default) | 0.00283 |", "| 128 | none | 0.004 |"):
        assert row in text, text
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    jobs = json.loads((tmp_path / "batch_scaling_jobs.json").read_text())
    assert sorted((j["lr_rule"], j["batch"]) for j in jobs) == [("none", 64), ("none", 128), ("sqrt", 64), ("sqrt", 128)]
    assert all(j["status"] == "completed" and 0 < j["val_acc"] <= 1 and j["wd_rule"] == "linear" for j in jobs)
    assert "## Over seeds" not in (tmp_path / "batch_scaling_sweeps" / "lr-adamw_b64-128.md").read_text()  # one seed

    # the report is written again from the jobs file alone, the runs gone
    out.unlink()
    batch_scaling.main(["--report-only", "--out", str(out)])
    assert "| 128 | none | 0.004 |" in out.read_text()
