"""A figure in the docs that is one small sweep (the default run's accuracy and time, an optimizer's
lr grid) kept as a results file: one Hydra multirun of train.py with the given overrides, every
job's numbers and provenance (command, start, end, duration, machine, load) in a jobs file, and a
report written from that file alone: each setting's test and val accuracy and fit time, mean ± sd
over its seeds (times only from jobs timed alone).

    python benchmarks/seed_sweep.py --name default_run seed=1,2,3
    python benchmarks/seed_sweep.py --name lr_grid_lamb optimizer=lamb optimizer.lr=0.01,0.02,0.04 seed=1,2
    python benchmarks/seed_sweep.py --name default_run --report-only
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sweep_jobs import (add_jobs, load_jobs, provenance_of, run_multirun, summaries, timed_alone,  # noqa: E402
                        write_report)

from trainer.measure.seed_groups import Spread, seed_of, setting_of  # noqa: E402 - after the repository is on the path

#: Overrides that say where a job ran, not what it was.
WHERE = ("run.root", "checkpointing", "progress", "trainer.accelerator")


def job_of(summary: dict[str, Any], study_command: str) -> dict[str, Any]:
    overrides = [o for o in summary.get("overrides", []) if o.split("=", 1)[0] not in WHERE]
    metrics = summary.get("metrics") or {}
    return {"setting": " ".join(setting_of(overrides)) or "(defaults)", "seed": seed_of(overrides) or "(config)",
            "status": summary.get("status"), "test_acc": (metrics.get("test") or {}).get("acc"),
            "val_acc": (metrics.get("val") or {}).get("acc"), "fit_s": summary.get("fit_time_s"),
            **provenance_of(summary), "study_command": study_command}


def key(job: dict[str, Any]) -> tuple:
    return job["setting"], str(job["seed"])


def report(jobs: list[dict[str, Any]], name: str) -> list[str]:
    alone = [j for j in jobs if timed_alone(j)]
    lines = [f"# {name}", "",
             f"Written {time.strftime('%Y-%m-%d')} from `{name}_jobs.json` alone ({len(jobs)} jobs on "
             f"{', '.join(sorted({j['machine'] for j in jobs}))}, run {min(j['started'] or '?' for j in jobs)} to "
             f"{max(j['started'] or '?' for j in jobs)}; {len(alone)} timed alone: 1-minute load within the CPUs + 0.5 "
             "at start and end). Each job's full command is in the jobs file.", "", "The study's commands (jobs):", "",
             *(f"- `{c}` ({sum(j['study_command'] == c for j in jobs)})" for c in dict.fromkeys(j["study_command"] for j in jobs)),
             "", "| setting | seeds | completed | test acc | val acc | fit time (s, timed alone) |", "|---|---|---:|---:|---:|---:|"]
    for setting in dict.fromkeys(j["setting"] for j in jobs):
        runs = [j for j in jobs if j["setting"] == setting]
        lines.append(f"| `{setting}` | {', '.join(str(j['seed']) for j in runs)} | "
                     f"{sum(j['status'] == 'completed' for j in runs)} of {len(runs)} | "
                     f"{Spread.of([j['test_acc'] for j in runs]).text('{:.4f}')} | "
                     f"{Spread.of([j['val_acc'] for j in runs]).text('{:.4f}')} | "
                     f"{Spread.of([j['fit_s'] for j in runs if timed_alone(j)]).text('{:.1f}')} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", required=True, help="the results' name: benchmarks/results/NAME_cpu.md")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--runs", type=Path, default=None, help="default: outputs/seed_sweep/NAME/DATE_TIME")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("overrides", nargs="*", help="train.py overrides; comma lists make the sweep")
    args = parser.parse_args(argv)
    out = args.out_dir / f"{args.name}_cpu.md"
    jobs_file = out.with_name(f"{args.name}_cpu_jobs.json")
    if not args.report_only:
        command = " ".join(["python benchmarks/seed_sweep.py", *(argv if argv is not None else sys.argv[1:])])
        runs = args.runs or REPO / "outputs" / "seed_sweep" / args.name / time.strftime("%Y-%m-%d_%H-%M-%S")
        # As users run it: checkpoints and the progress bar stay as configured.
        run_multirun(args.overrides, runs, args.name, quiet=False)
        add_jobs(jobs_file, [job_of(s, command) for s in summaries(runs)], key)
    jobs = load_jobs(jobs_file)
    if not jobs:
        raise SystemExit(f"{jobs_file}: no jobs yet; run without --report-only first")
    write_report(out, report(jobs, out.stem), lambda path: None)


if __name__ == "__main__":
    main()
