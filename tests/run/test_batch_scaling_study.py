"""benchmarks/batch_scaling.py --quick, as CI runs it: AdamW's defaults at two batches and one
other lr rule, two seeds, one epoch of a 2-copy set. Every job carries its provenance, and the
report written again from the jobs file alone (--report-only) says the same."""

from __future__ import annotations

import json
import time

import pytest

from tests.forked_jobs import fork_study_jobs
from tests.helpers import benchmark


@pytest.mark.run
def test_the_quick_study_keeps_each_job_s_provenance_and_reports_from_the_jobs_alone(tmp_path, monkeypatch):
    fork_study_jobs(monkeypatch)
    study = benchmark("batch_scaling")
    out = tmp_path / "scaling.md"
    study.main(["--quick", "--out", str(out), "--runs", str(tmp_path / "runs")])
    jobs = json.loads((tmp_path / "scaling_jobs.json").read_text())
    assert {(j["batch"], j["lr_rule"]) for j in jobs} == {(64, "sqrt"), (128, "sqrt"), (128, "none")}
    assert len(jobs) == 6
    for job in jobs:
        assert job["command"].startswith("python train.py optimizer=adamw") and "data.copies=2" in job["command"]
        assert job["started"] <= job["ended"] and job["duration_s"] > 0 and job["machine"]
        assert job["load_1min"]["end"] is not None and isinstance(job["beside_load"], bool)
        assert job["study_command"].startswith("python benchmarks/batch_scaling.py --quick")
        assert job["calibration"] == "clipped" and job["wd_rule"] == "sqrt"  # today's defaults
    first = out.read_text()
    assert "## The decision rule and its power" in first and "adamw: the lr rule against its default (sqrt)" in first
    assert "data.copies=2" in first  # the regime, read from the jobs' commands
    study.main(["--report-only", "--out", str(out)])
    again = out.read_text()
    strip = lambda text: text.split("## The decision rule")[1]  # noqa: E731 - the header names this call's sweeps
    assert strip(again) == strip(first)


def test_every_arm_is_today_s_defaults_with_one_change_and_warmup_runs_long_enough():
    """No study pins an old default any more; each names only its own change, and warmup runs at
    the largest batches whose 5% warmup is ten steps or more."""
    study = benchmark("batch_scaling")
    sweeps = study.plan_sweeps(list(study.STUDIES), ["adamw", "sgd"], [32, 64, 128, 256, 512, 1024, 2048],
                               ["sqrt", "linear", "none"], copies=21, epochs=2)
    by_study: dict[str, list] = {}
    for sweep in sweeps:
        by_study.setdefault(sweep.study, []).append(sweep)
    assert [s.overrides for s in by_study["defaults"]] == [(), ()]
    assert [s.overrides for s in by_study["lr"]] == [("optimizer.lr_scaling=linear,none",)] * 2
    assert by_study["lr"][0].batches == (32, 128, 512, 2048)  # 32: SGD's linear rule (issue 51 item 4)
    assert [s.overrides for s in by_study["wd"]] == [("optimizer.wd_scaling=linear,none",), ("optimizer.wd_scaling=linear",)]
    assert by_study["calibration"][0].overrides == ("clipping.clip_during_calibration=false",)
    # the weight-decay rules and the calibration also where every run trains (issue 51 item 4)
    assert by_study["wd"][0].batches == by_study["calibration"][0].batches == (64, 512, 2048)
    assert by_study["large"][0].optimizers == ("lamb", "lars") and by_study["large"][0].overrides == ()
    # 26,397 images: batch 256 gives 104 steps an epoch, 208 in 2 epochs, a warmup of 10.4 steps; 512 gives 5.2
    assert by_study["warmup"][0].batches == (64, 128, 256)
    assert study.warmup_batches([256, 512, 1024, 2048], copies=42, epochs=2) == (256, 512)  # 1,024: 5.2 steps
    with pytest.raises(SystemExit, match="unknown study"):
        study.plan_sweeps(["sizes"], ["adamw"], [64], ["sqrt"], 21, 2)


@pytest.mark.run
@pytest.mark.slow
def test_the_gpu_batch_study_s_dry_run_fits_its_budget_and_decides_by_the_rule(tmp_path, monkeypatch):
    """benchmarks/batch_scaling_gpu.py --dry-run: the GPU step's design (issue 51 item 6) on the CPU,
    seed-major within its clock budget: every seed has all four arms, every job its design's commit,
    and the report the family's verdicts by the rule."""
    fork_study_jobs(monkeypatch)
    study = benchmark("batch_scaling_gpu")
    out = tmp_path / "gpu.md"
    started = time.monotonic()
    study.main(["--dry-run", "--out", str(out), "--runs", str(tmp_path / "runs")])
    elapsed = time.monotonic() - started
    jobs = json.loads((tmp_path / "gpu_jobs.json").read_text())
    seeds = sorted({j["seed"] for j in jobs})
    dry = study.DESIGN["dry"]
    assert seeds == list(range(1, len(seeds) + 1)) and dry["least_seeds"] <= len(seeds) <= dry["most_seeds"]
    assert sorted((j["rule"], j["batch"]) for j in jobs if j["seed"] == 1) == [("none", 32), ("none", 64),
                                                                                ("sqrt", 32), ("sqrt", 64)]
    assert len(jobs) == 4 * len(seeds)
    assert all(j["design"]["files"] == list(study.DESIGN_FILES) and j["status"] == "completed" for j in jobs)
    # the stopping rule: a seed starts only while spent + the slowest seed so far fits the budget
    walls = [float(w.split(": ")[1].rstrip(" s")) for w in out.read_text().split("This call: ")[1].split(".\n")[0].split("; ")
             if w.startswith("seed ")]
    assert len(walls) == len(seeds)
    if len(seeds) > dry["least_seeds"]:  # a seed past the least started only within the clock
        assert sum(walls[:-1]) + max(walls[:-1]) <= dry["budget_s"]
    else:
        assert "stopped after" in out.read_text() or len(seeds) == dry["most_seeds"]
    assert elapsed < sum(walls) + 60
    text = out.read_text()
    assert "- sqrt against none at 32: val acc" in text and "- sqrt at 64 against 32: val acc" in text
    assert "| 64 | none | 0.004 |" in text  # none: AdamW's 0.004 as given
