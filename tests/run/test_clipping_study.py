"""benchmarks/clipping_study.py --quick, as CI runs it: the fragile and the stable setting, clipping off and
percentile, two seeds, one epoch of a 2-copy set. Each job's spikes, clipped share and divergence come
from its own summary.json, with its provenance (command, start, duration, load); the report has the
decision rule's power, Holm-corrected verdicts, a table per setting and a plot."""

from __future__ import annotations

import json

import pytest

from tests.helpers import benchmark



@pytest.mark.run
def test_the_quick_study_writes_its_verdicts_tables_jobs_and_plot(tmp_path):
    clipping_study = benchmark("clipping_study")
    out = tmp_path / "clipping.md"
    clipping_study.main(["--quick", "--out", str(out), "--runs", str(tmp_path / "runs")])
    text = out.read_text()
    assert "- fragile, percentile (default) against off: val acc " in text and "Holm p=" in text
    assert "- stable: a drop of 0.01 to catch with 80% power" in text and "2 an arm ran" in text
    assert "### fragile" in text and "### stable" in text and "| percentile (default) |" in text
    assert "`python benchmarks/clipping_study.py --quick --out" in text
    all_jobs = json.loads((tmp_path / "clipping_jobs.json").read_text())
    assert len(all_jobs) == 8
    jobs = {(j["setting"], j["arm"]): j for j in all_jobs}
    assert set(jobs) == {("fragile", "off"), ("fragile", "percentile"), ("stable", "off"), ("stable", "percentile")}
    # SGD's 0.8 at batch 256, moved to batch 64 by its default sqrt rule, in the fragile setting only
    assert jobs["fragile", "off"]["lr"] == pytest.approx(0.4) and jobs["stable", "off"]["lr"] == pytest.approx(0.002)
    for job in all_jobs:
        assert job["command"].startswith("python train.py ") and f"seed={job['seed']}" in job["command"]
        assert job["started"] <= job["ended"] and job["duration_s"] > 0 and job["cpus"] >= 1
        assert job["load_1min"]["start"] is not None and isinstance(job["beside_load"], bool)
        assert job["study_command"].startswith("python benchmarks/clipping_study.py --quick")
        assert isinstance(job["spikes"], int) and isinstance(job["diverged"], bool)
        # off never clips; percentile clips a calibration step only above the percentile so far
        assert job["clipped_share"] == 0.0 if job["arm"] == "off" else 0.0 <= job["clipped_share"] < 1.0
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")


def test_the_unclipped_calibration_arms_run_as_their_own_sweep_and_are_named_from_the_summary():
    clipping_study = benchmark("clipping_study")
    assert clipping_study.planned_seeds("stable") > clipping_study.planned_seeds("fragile") >= 2
    assert clipping_study.sweeps(["off", "percentile_unclipped_calibration", "percentile"]) == [
        ("", ["off", "percentile"], []),
        ("_unclipped_calibration", ["percentile"], ["clipping.clip_during_calibration=false"])]
    with pytest.raises(SystemExit, match="unknown"):
        clipping_study.sweeps(["percentile_clipped"])

    def summary(clipping: dict) -> dict:
        return {"overrides": ["clipping=percentile", "seed=3"], "clipping": clipping, "status": "completed",
                "metrics": {"val": {"acc": 0.9}}, "loss": {"final": 0.3}, "steps": 10}
    job_of = clipping_study.job_of
    assert job_of(summary({"clip_during_calibration": True}), "stable")["arm"] == "percentile"
    assert job_of(summary({"clip_during_calibration": False}), "stable")["arm"] == "percentile_unclipped_calibration"
    # summaries written before the setting existed recorded their calibration unclipped
    assert job_of(summary({}), "stable")["arm"] == "percentile_unclipped_calibration"
