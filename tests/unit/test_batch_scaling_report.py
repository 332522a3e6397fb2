"""The batch-scaling report's rule on made-up jobs (benchmarks/batch_scaling_report.py): the limit
is the fixed sequence of batches shown to hold within one point of batch 64, a run that measured
nothing is a failure counted by Fisher's test while a stalled one is measured, an alternative
changes a default only when it is better somewhere and worse nowhere (else the default stays, by
the evidence or by incumbency), only jobs timed alone enter the time column, and the report is
written from the jobs alone."""

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
        # a per-arm jitter of at most 0.001, so that the per-seed differences between arms have a spread
        value = mean + offset + ((seed * 7 + batch + len(str(changed)) + len(optimizer)) % 5 - 2) * 0.0005
        made.append({"optimizer": optimizer, "batch": batch, "seed": seed, **settings,
                     "status": "failed" if failed else "completed", "val_acc": None if failed else value,
                     "test_acc": None if failed else value, "final_loss": float("nan") if failed else 0.2,
                     "spikes": 1 if seed == 5 else 0, "reached": True, "target_steps": 100, "target_s": 10.0,
                     "lr": 0.002, "weight_decay": 0.1, "beside_load": not alone})
    return made


@pytest.fixture
def report():
    module = benchmark("batch_scaling_report")
    return module, module.Defaults(DEFAULTS)


def test_the_limit_is_the_last_batch_shown_to_hold_in_the_fixed_sequence(report):
    module, defaults = report
    jobs = [*jobs_at("adamw", 64, 0.96), *jobs_at("adamw", 128, 0.959), *jobs_at("adamw", 256, 0.958),
            *jobs_at("adamw", 512, 0.94), *jobs_at("adamw", 1024, 0.96)]
    for job in jobs:
        job["steps"] = 52_000 // job["batch"]
    limit = module.findings(jobs, defaults)["limits"]["adamw"]
    assert (limit.holds_to, limit.next_batch, limit.steps) == (256, 512, 101) and limit.lost == pytest.approx(0.02, abs=2e-3)
    assert "worse" in limit.why  # 1,024 is never tested: the sequence stopped at 512


def test_a_failure_is_counted_by_fisher_and_a_stalled_run_is_measured(report):
    module, defaults = report
    jobs = [*jobs_at("adamw", 64, 0.96), *jobs_at("adamw", 128, 0.96, diverged=4), *jobs_at("adamw", 256, 0.96)]
    limit = module.findings(jobs, defaults)["limits"]["adamw"]
    assert (limit.holds_to, limit.next_batch, limit.why) == (64, 128, "fails more often")  # 4 of 5: Fisher p 5/210
    arm = module.arm(jobs, defaults, "adamw", 128)
    assert list(module.outcomes(arm).values()).count(None) == 4
    assert "| 4 of 5 | 0 of 5 |" in module.arm_row(128, "defaults", arm)
    one = [*jobs_at("adamw", 64, 0.96), *jobs_at("adamw", 128, 0.96, diverged=1)]
    assert module.findings(one, defaults)["limits"]["adamw"].holds_to == 128  # one failure of 5: Fisher p 1/2
    stalled = jobs_at("adamw", 128, 0.96)
    stalled[0]["val_acc"] = 0.30  # completed at 0.30: a measured value, in the mean, counted as stalled
    row = module.arm_row(128, "defaults", stalled)
    assert "| 0 of 5 | 1 of 5 |" in row and "(n=5)" in row and module.outcomes(stalled)[1] == 0.30


def test_an_alternative_changes_the_default_only_if_better_somewhere_and_worse_nowhere(report):
    module, defaults = report
    jobs = [*jobs_at("adamw", 128, 0.96), *jobs_at("adamw", 2048, 0.90),
            *jobs_at("adamw", 128, 0.96, lr_rule="none"), *jobs_at("adamw", 2048, 0.93, lr_rule="none"),
            *jobs_at("adamw", 128, 0.94, lr_rule="linear"), *jobs_at("adamw", 2048, 0.95, lr_rule="linear"),
            *jobs_at("adamw", 128, 0.96, wd_rule="none"), *jobs_at("adamw", 2048, 0.90, wd_rule="none")]
    [family] = [f for f in module.families(jobs, defaults) if "lr rule" in f.name]
    outcome = module.decision(family)
    assert outcome["none"].startswith("**changes the default**")
    assert outcome["linear"].startswith("the default stays by incumbency") and "worse at 128" in outcome["linear"]
    [decay] = [f for f in module.families(jobs, defaults) if "weight-decay" in f.name]
    assert module.decision(decay)["none"].startswith("the default stays by the evidence")


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
    assert "**5 seeds**" in text and "| adamw | 2,048 | 0.0011 | " in text and "(the planned power holds)" in text
    assert "**adamw, today's defaults hold to batch 64; at 2,048 it lost 0.060" in text
    assert "What the rule of issue 51 changed" in text and "one-sided bound" in text
    assert "adamw: the weight-decay rule against its default (sqrt)" in text and "Holm p=" in text
    module.plot(jobs, defaults, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")


def test_a_preregistered_studys_report_names_its_own_planning_and_no_earlier_report(report):
    """Jobs that record their design (every job since issue 51) were planned by the rule's power
    calculation: the report says so, with their seed count, and has no "what the rule changed"
    section, which compares the jobs of 2026-12-03 with their first report."""
    module, defaults = report
    design = {"commit": "abc", "committed": "2026-12-07T13:18:00+00:00", "files": [], "clean": True}
    jobs = [{**job, "design": design} for job in [*jobs_at("adamw", 64, 0.96), *jobs_at("adamw", 512, 0.95)]
            if job["seed"] <= 4]
    text = "\n".join(module.report(jobs, defaults, ["# title"]))
    assert "planned by this rule's power calculation" in text and "**4 seeds**" in text
    assert "every arm ran seeds 1-4" in text and "rule of the time" not in text
    assert "What the rule of issue 51 changed" not in text


def test_the_header_names_each_design_commit_and_the_jobs_threads():
    """A study run in several commands may record two designs: the header names each commit with
    its jobs, and the compute threads the jobs recorded; jobs from before the record name neither."""
    study = benchmark("batch_scaling")
    first = {"commit": "a" * 40, "committed": "2026-12-07T13:18:59+00:00", "files": [], "clean": True}
    second = {**first, "commit": "b" * 40, "committed": "2026-12-07T14:39:52+00:00"}
    jobs = [{**job, "design": first if job["seed"] <= 3 else second, "threads": 1, "started": "2026-12-07T15:00:00+00:00"}
            for job in jobs_at("adamw", 64, 0.96)]
    text = " ".join(study.header(jobs, study.REPO / "x_jobs.json", study.REPO / "x_sweeps", []))
    assert "5 of 5 jobs ran under a design committed before they started" in text
    assert "aaaaaaa of 2026-12-07T13:18:59+00:00 for 3, bbbbbbb of 2026-12-07T14:39:52+00:00 for 2" in text
    assert "Compute threads per job: 1 (5 jobs)" in text and "predate that record" not in text
    old = " ".join(study.header(jobs_at("adamw", 64, 0.96), study.REPO / "x_jobs.json", study.REPO / "x_sweeps", []))
    assert "0 of 5 jobs ran under a design" in old and "5 predate that record" in old
    assert "Compute threads" not in old
