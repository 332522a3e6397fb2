"""benchmarks/clipping_study.py --quick, as CI runs it: the fragile and the stable setting, clipping off and
percentile, two seeds, one epoch of a 2-copy set. Each job's spikes, clipped share and divergence come
from its own summary.json, with its provenance (command, start, duration, load); the report has the
decision rule's power, its verdicts (trainer/measure/decision_rule.py), a table per setting and a
plot; every job records the commit of its design."""

from __future__ import annotations

import json

import pytest

from tests.forked_jobs import fork_study_jobs
from tests.helpers import benchmark



@pytest.mark.run
def test_the_quick_study_writes_its_verdicts_tables_jobs_and_plot(tmp_path, monkeypatch):
    fork_study_jobs(monkeypatch)
    clipping_study = benchmark("clipping_study")
    out = tmp_path / "clipping.md"
    clipping_study.main(["--quick", "--out", str(out), "--runs", str(tmp_path / "runs")])
    text = out.read_text()
    assert "- fragile, percentile (default) against off: val acc " in text and "paired" in text
    assert "- stable: margin 0.01, family m=1;" in text and "2 an arm ran" in text
    assert "- **stable: the default" in text and "Pre-registration:" in text
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
        assert job["design"]["files"] == ["benchmarks/clipping_study.py", "trainer/measure/decision_rule.py"]
        assert len(job["design"]["commit"]) == 40 and isinstance(job["design"]["clean"], bool)
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


def test_the_rule_reads_stalled_runs_as_measured_and_says_how_the_default_stays():
    """On made-up jobs: a run that completed at 0.2 is measured (never chance), a stopped one failed;
    the default kept by the evidence where it holds against every arm, by incumbency where not."""
    clipping_study = benchmark("clipping_study")

    def jobs(arm: str, values: list, status: str = "completed") -> list[dict]:
        return [{"setting": "stable", "arm": arm, "seed": seed, "status": status, "val_acc": v, "test_acc": v,
                 "final_loss": 0.3, "spikes": 0} for seed, v in enumerate(values, 1)]
    default = [0.90, 0.91, 0.92, 0.905, 0.915]
    close = jobs("percentile", default) + jobs("off", [v - 0.001 * (i % 2) for i, v in enumerate(default)])
    assert "kept by the evidence" in clipping_study.setting_verdict("stable", close)
    stalled = jobs("percentile", default) + jobs("off", [0.2, 0.95, 0.3, 0.96, 0.91])
    assert clipping_study.arm_outcomes(stalled[5:])[1] == 0.2 and clipping_study.stalled(stalled[5:]) == 2
    assert "by incumbency" in clipping_study.setting_verdict("stable", stalled)
    stopped = jobs("off", [None] * 5, status="stopped")
    assert clipping_study.failed_runs(stopped) == 5
    assert "off should replace" not in clipping_study.setting_verdict("stable", jobs("percentile", default) + stopped)
    # the fine-tuning setting: the encoder recipe, and the seeds its paired spread asks for
    assert clipping_study.setting_overrides("finetune", 0.8) == ["+recipe=encoder_tiny_text"]
    assert clipping_study.finetune_seeds(0.01) < clipping_study.finetune_seeds(0.02)
    assert clipping_study.finetune_seeds(0.5) is None
