"""The batch-scaling report's rule on made-up jobs (benchmarks/batch_scaling_report.py): the limit
stops at a batch called worse or with a diverged run, an alternative changes a default only when it
is better somewhere and worse nowhere, failures count instead of disappearing, only jobs timed alone
enter the time column, and the report is written from the jobs alone."""

from __future__ import annotations

import pytest

from tests.helpers import benchmark

DEFAULTS = {"adamw": {"lr_rule": "sqrt", "wd_rule": "sqrt", "warmup": 0.05, "calibration": "clipped"},
            "lamb": {"lr_rule": "sqrt", "wd_rule": "none", "warmup": 0.05, "calibration": "clipped"}}
#: Five seeds' offsets around an arm's mean: sd about 0.0029, like the pilot.
SPREAD = (-0.004, -0.002, 0.0, 0.002, 0.004)


def jobs_at(optimizer: str, batch: int, mean: float, *, diverged: int = 0, alone: bool = True, **changed) -> list[dict]:
    settings = {**DEFAULTS[optimizer], **changed}
    made = []
    for seed, offset in enumerate(SPREAD, 1):
        failed = seed <= diverged
        made.append({"optimizer": optimizer, "batch": batch, "seed": seed, **settings,
                     "status": "failed" if failed else "completed", "val_acc": None if failed else mean + offset,
                     "test_acc": None if failed else mean + offset, "final_loss": float("nan") if failed else 0.2,
                     "spikes": 1 if seed == 5 else 0, "reached": True, "target_steps": 100, "target_s": 10.0,
                     "lr": 0.002, "weight_decay": 0.1, "beside_load": not alone})
    return made


@pytest.fixture
def report():
    module = benchmark("batch_scaling_report")
    return module, module.Defaults(DEFAULTS)


def test_the_limit_is_the_last_batch_before_one_called_worse(report):
    module, defaults = report
    jobs = [*jobs_at("adamw", 64, 0.96), *jobs_at("adamw", 128, 0.959), *jobs_at("adamw", 256, 0.958),
            *jobs_at("adamw", 512, 0.94), *jobs_at("adamw", 1024, 0.96)]
    limit = module.findings(jobs, defaults)["limits"]["adamw"]
    assert (limit.holds_to, limit.next_batch) == (256, 512) and limit.lost == pytest.approx(0.02)


def test_a_diverged_run_ends_the_limit_and_counts_at_chance_in_its_arm(report):
    module, defaults = report
    jobs = [*jobs_at("adamw", 64, 0.96), *jobs_at("adamw", 128, 0.96, diverged=1), *jobs_at("adamw", 256, 0.96)]
    assert module.findings(jobs, defaults)["limits"]["adamw"].holds_to == 64
    arm = module.arm(jobs, defaults, "adamw", 128)
    assert module.accuracies(arm).count(0.1) == 1 and len(module.accuracies(arm)) == 5
    row = module.arm_row(128, "defaults", arm)
    assert "| 1 of 5 |" in row and "(n=4)" in row


def test_an_alternative_changes_the_default_only_if_better_somewhere_and_worse_nowhere(report):
    module, defaults = report
    jobs = [*jobs_at("adamw", 128, 0.96), *jobs_at("adamw", 2048, 0.90),
            *jobs_at("adamw", 128, 0.96, lr_rule="none"), *jobs_at("adamw", 2048, 0.93, lr_rule="none"),
            *jobs_at("adamw", 128, 0.94, lr_rule="linear"), *jobs_at("adamw", 2048, 0.95, lr_rule="linear")]
    [family] = [f for f in module.families(jobs, defaults) if "lr rule" in f.name]
    outcome = module.decision(family)
    assert outcome["none"].startswith("**changes the default**")
    assert outcome["linear"].startswith("keeps the default") and "worse at 128" in outcome["linear"]


def test_holm_can_leave_a_lone_raw_win_uncalled(report):
    module, defaults = report
    small = (0.0, 0.001, 0.002, 0.003, 0.004)  # a difference of 0.004: p under 0.05 alone, not among six
    jobs = [*jobs_at("adamw", 64, 0.96)]
    for batch in (128, 256, 512, 1024, 2048, 32):
        jobs += jobs_at("adamw", batch, 0.96)
    for job, extra in zip([j for j in jobs if j["batch"] == 128], small):
        job["val_acc"] = 0.964 + extra - 0.002
    [family] = [f for f in module.families(jobs, defaults) if "against batch" in f.name]
    [at_128] = [c for c in family.comparisons if c.label == "128"]
    assert at_128.p < 0.05 and at_128.adjusted > at_128.p


def test_lamb_is_named_where_it_is_called_better_than_adamw(report):
    module, defaults = report
    jobs = [*jobs_at("adamw", 2048, 0.86), *jobs_at("lamb", 2048, 0.94), *jobs_at("adamw", 1024, 0.95),
            *jobs_at("lamb", 1024, 0.951)]
    alternative = module.findings(jobs, defaults)["alternatives"]["adamw"]
    assert (alternative["optimizer"], alternative["batch"]) == ("lamb", 2048)
    assert alternative["by"] == pytest.approx(0.08)


def test_times_come_only_from_jobs_timed_alone(report):
    module, defaults = report
    jobs = jobs_at("adamw", 64, 0.96)
    for job in jobs[:3]:
        job["beside_load"] = True
        job["target_s"] = 99.0
    row = module.arm_row(64, "defaults", module.arm(jobs, defaults, "adamw", 64))
    assert "10.0 ± 0.0 (n=2) (2 timed alone)" in row and "99" not in row


def test_the_report_has_the_power_the_verdicts_and_every_family(report, tmp_path):
    module, defaults = report
    jobs = [*jobs_at("adamw", 64, 0.96), *jobs_at("adamw", 2048, 0.9), *jobs_at("adamw", 2048, 0.92, wd_rule="none")]
    text = "\n".join(module.report(jobs, defaults, ["# title"]))
    assert "**5 seeds**" in text and "Seeds an arm: 5." in text
    assert "| up to 512 | 1 | 0.0032 | " in text and "(the planned power holds)" in text
    assert "**adamw, today's defaults hold to batch 64**; at 2,048 it lost 0.0600" in text
    assert "adamw: the weight-decay rule against its default (sqrt)" in text and "Holm p=" in text
    module.plot(jobs, defaults, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")
