"""benchmarks/seed_sweep.py on made-up summaries: each job keeps its setting, seed and provenance,
and the report groups the seeds of a setting, with times only from jobs timed alone."""

from __future__ import annotations

from tests.helpers import benchmark


def summary(lr: str, seed: int, acc: float, fit: float, load: float) -> dict:
    return {"status": "completed", "command": f"train.py optimizer.lr={lr} seed={seed} run.root=/tmp/x",
            "overrides": [f"optimizer.lr={lr}", f"seed={seed}", "run.root=/tmp/x"], "fit_time_s": fit,
            "wall_time_s": fit + 2, "metrics": {"test": {"acc": acc}, "val": {"acc": acc - 0.01}},
            "device": {"name": "Test CPU"},
            "host": {"name": "vm", "cpus": 2, "started": f"2026-12-03T21:0{seed}:00+00:00",
                     "ended": f"2026-12-03T21:0{seed}:30+00:00", "load_at_start": [load, 1, 1], "load_at_end": [load, 1, 1]}}


def test_jobs_group_by_setting_and_only_quiet_jobs_are_timed():
    sweep = benchmark("seed_sweep")
    jobs = [sweep.job_of(summary("0.02", seed, 0.98 + seed / 1000, 10.0 * seed, load), "python benchmarks/seed_sweep.py x")
            for seed, load in ((1, 1.9), (2, 2.1), (3, 4.0))]
    assert jobs[0]["setting"] == "optimizer.lr=0.02" and jobs[0]["seed"] == "1"
    assert jobs[0]["command"] == "python train.py optimizer.lr=0.02 seed=1 run.root=/tmp/x"
    assert [j["beside_load"] for j in jobs] == [False, False, True]
    text = "\n".join(sweep.report(jobs, "lr_grid"))
    assert "| `optimizer.lr=0.02` | 1, 2, 3 | 3 of 3 | 0.9820 ± 0.0010 (n=3) |" in text
    assert "| 15.0 ± 7.1 (n=2) |" in text  # the third ran beside a load of 4 on 2 CPUs
    assert "2 timed alone" in text and "`python benchmarks/seed_sweep.py x` (3)" in text
