"""benchmarks/batch_scaling.py --quick, as CI runs it: one AdamW sweep over two batches (64, 128), two lr rules
and one seed on a tenth of the expanded digits ends with the verdict lines, a table row per batch
and rule with the lr each rule gave, the plot, the jobs file the report is written from, and the
sweep's own comparison beside them."""

from __future__ import annotations

import json

import pytest

from tests.helpers import benchmark


@pytest.mark.run
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


def test_the_studies_pin_their_base_settings_and_each_variant_study_changes_one():
    """Every study but `calibration` runs with the calibration unclipped, AdamW's studies but `wd` with
    the linear weight-decay rule and SGD's but `lr` with the linear lr rule they began with;
    `calibration` clips it, `wd` and `lr` vary their rule."""
    batch_scaling = benchmark("batch_scaling")
    sweeps = batch_scaling.plan_sweeps(["lr", "large", "calibration", "wd"], ["adamw", "sgd"], [32, 64, 2048],
                                       ["sqrt", "none"], [1024, 2048])
    by_study = {}
    for sweep in sweeps:
        by_study.setdefault(sweep.study, []).append(sweep)
    for sweep in by_study["lr"] + by_study["large"] + by_study["wd"]:
        assert "clipping.clip_during_calibration=false" in sweep.overrides
    for sweep in by_study["lr"] + by_study["calibration"]:
        assert ("optimizer.wd_scaling=linear" in sweep.overrides) == (sweep.optimizers == ("adamw",))
    assert [(s.optimizers, s.batches, s.overrides) for s in by_study["calibration"]] == [
        (("adamw",), (64, 2048), ("clipping.clip_during_calibration=true", "optimizer.wd_scaling=linear")),
        (("sgd",), (64, 2048), ("clipping.clip_during_calibration=true", "optimizer.lr_scaling=linear"))]
    for sweep in sweeps:
        pinned = "optimizer.lr_scaling=linear" in sweep.overrides
        assert pinned == (sweep.optimizers == ("sgd",) and sweep.study != "lr"), sweep
    assert by_study["wd"][0].overrides == ("optimizer.wd_scaling=sqrt,none", "clipping.clip_during_calibration=false")

    def job(calibration: str, seed: int, acc: float) -> dict:
        return {"optimizer": "adamw", "lr_rule": "sqrt", "wd_rule": "linear", "warmup": batch_scaling.DEFAULT_WARMUP,
                "calibration": calibration, "batch": 2048, "seed": seed, "val_acc": acc, "lr": 0.0113,
                "reached": False, "target_steps": None, "target_s": None, "machine": "m"}
    jobs = [job("unclipped", 1, 0.80), job("unclipped", 2, 0.82), job("clipped", 1, 0.90), job("clipped", 2, 0.91)]
    # the rule tables hold only the base calibration; the calibration section holds both, against it
    assert batch_scaling.select(jobs, "adamw", 2048, "lr_rule", "sqrt") == [0.80, 0.82]
    lines = batch_scaling.report(jobs, [])
    assert any(line.startswith("- adamw, calibration clipped against calibration unclipped (the other studies' "
                               "runs), val accuracy: 2,048: +0.0950") for line in lines), lines
