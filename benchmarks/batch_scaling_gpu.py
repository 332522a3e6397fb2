"""The batch study's first GPU regime (issue 51 item 6), designed under the project's decision rule
(trainer/measure/decision_rule.py) for one lease of at most 6 minutes: the check's `batch_study` step.

The design, committed before its first job (`DESIGN`; every job records this file's commit):

- **Regime**: ResNet-18 (`model=resnet18`) on the expanded digits drawn at 28 px
  (`data=digits_expanded data.image_size=28`, 21 copies: 26,397 training images), AdamW with today's
  defaults, 2 epochs, bf16 and the GPU's other defaults: GPU-sized batches, not the CPU study's.
- **Arms**: the default lr rule (sqrt) and one alternative (none: the lr as given at batch 256) at
  two GPU-sized batches, 512 and 4,096: four arms, every arm the same seeds.
- **Questions** (one family, Holm): at each batch, none against the default (better / worse
  two-sided; the default *holds* where its one-sided bound lies above minus one point); and the
  default at 4,096 against the default at 512 (does it hold within one point at 8x the batch?).
- **Seeds: as many as fit.** Seed-major (every arm of seed 1, then of seed 2, ...), a new seed
  started only while the time spent plus the slowest seed so far stays within `budget_s`; at least
  2 are needed for any paired test, and the report states the power on the spread the test met.
  A stopping rule on the clock, never on the results.

    python benchmarks/batch_scaling_gpu.py --out DIR/batch_scaling_gpu.md        # on the GPU, <= 330 s
    python benchmarks/batch_scaling_gpu.py --dry-run --out /tmp/gpu_batch.md      # the CPU stand-in (CI)

The dry run is the same code on the CPU at a tenth of the size (the default network at 16 px,
batches 32 and 64, one epoch of a 2-copy set; 2 seeds always, a third only within 40 s, which two
seeds already pass): it checks that the study runs, stops by its clock and writes its report with
a paired verdict, not any figure.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sweep_jobs import add_jobs, design_of, load_jobs, overrides_of, provenance_of, run_multirun, summaries, write_report  # noqa: E402

from trainer.measure.decision_rule import MARGIN, compare, correct, detectable_drop, outcome, spread_used  # noqa: E402

DESIGN: dict[str, Any] = {
    "gpu": {"batches": (512, 4096), "epochs": 2, "budget_s": 330.0, "least_seeds": 1, "most_seeds": 8, "accelerator": "gpu",
            "overrides": ("model=resnet18", "data=digits_expanded", "data.image_size=28", "data.copies=21")},
    "dry": {"batches": (32, 64), "epochs": 1, "budget_s": 40.0, "least_seeds": 2, "most_seeds": 3, "accelerator": "cpu",
            "overrides": ("data=digits_expanded", "data.copies=2", "data.eval_copies=1")},
}
RULES = ("sqrt", "none")
DEFAULT_RULE = "sqrt"
DESIGN_FILES = ("benchmarks/batch_scaling_gpu.py", "trainer/measure/decision_rule.py")


def job_of(summary: dict[str, Any]) -> dict[str, Any]:
    overrides = overrides_of(summary)
    metrics = summary.get("metrics") or {}
    return {"rule": overrides.get("optimizer.lr_scaling", DEFAULT_RULE), "batch": int(overrides["data.batch_size"]),
            "seed": int(overrides["seed"]), "status": summary.get("status"),
            "val_acc": (metrics.get("val") or {}).get("acc"), "test_acc": (metrics.get("test") or {}).get("acc"),
            "final_loss": (summary.get("loss") or {}).get("final"), "steps": summary.get("steps"),
            "lr": (summary.get("hyperparameters") or {}).get("lr"), **provenance_of(summary)}


def run(design: dict[str, Any], jobs_file: Path, runs: Path, command: str) -> list[str]:
    """Seed-major within the budget; each seed one multirun of the four arms. The lines to report."""
    started, slowest, said, recorded = time.monotonic(), 0.0, [], design_of(DESIGN_FILES)
    for seed in range(1, int(design["most_seeds"]) + 1):
        spent = time.monotonic() - started
        if seed > int(design["least_seeds"]) and spent + slowest > float(design["budget_s"]):
            said.append(f"stopped after {seed - 1} seeds at {spent:.0f} s (another would take up to {slowest:.0f} s)")
            break
        folder = runs / f"seed{seed}"
        wall = run_multirun([f"optimizer.lr_scaling={','.join(RULES)}",
                             f"data.batch_size={','.join(map(str, design['batches']))}", f"seed={seed}",
                             *design["overrides"], f"trainer.max_epochs={design['epochs']}"],
                            folder, f"seed {seed}", str(design["accelerator"]))
        slowest = max(slowest, wall)
        add_jobs(jobs_file, [{**job_of(s), "study_command": command, "design": recorded} for s in summaries(folder)],
                 lambda j: (j["rule"], j["batch"], j["seed"]))
        said.append(f"seed {seed}: {wall:.0f} s")
    return said


def arm(jobs: list[dict[str, Any]], rule: str, batch: int) -> dict[int, float | None]:
    return {j["seed"]: outcome(j["status"], j["val_acc"], j.get("final_loss")) for j in jobs
            if j["rule"] == rule and j["batch"] == batch}


def verdicts(jobs: list[dict[str, Any]], batches: tuple[int, ...]) -> list[str]:
    """The family: none against the default at each batch, and the default at the larger batch
    against the smaller (the default is `other` in each, so *holds* is the default's)."""
    small, large = batches
    found = [compare(f"{DEFAULT_RULE} against none at {b:,}", arm(jobs, "none", b), arm(jobs, DEFAULT_RULE, b))
             for b in batches]
    found.append(compare(f"{DEFAULT_RULE} at {large:,} against {small:,}", arm(jobs, DEFAULT_RULE, small),
                         arm(jobs, DEFAULT_RULE, large)))
    family = correct([c for c in found if c is not None])
    lines = [f"- {c.label}: val acc {c.text()}" for c in family]
    spreads = [s for s in (spread_used(arm(jobs, "none", b), arm(jobs, DEFAULT_RULE, b)) for b in batches) if s]
    seeds = min((len(arm(jobs, r, b)) for r in RULES for b in batches), default=0)
    if spreads and seeds > 1:
        sd = max(spreads)
        shown = detectable_drop(seeds, sd, len(family), is_paired=True, test="noninferiority")
        lines.append(f"- Power: {seeds} seeds an arm; the paired spread (largest) {sd:.4f}; non-inferiority shown within "
                     f"{shown:.4f} with 80% power at Holm's strictest level of {len(family)}: "
                     + ("the one-point margin is within reach" if shown <= MARGIN else "**short of a one-point margin**"))
    return lines


def report(jobs: list[dict[str, Any]], design: dict[str, Any], said: list[str], jobs_file: Path) -> list[str]:
    machines = sorted({j["machine"] for j in jobs})
    return ["# The batch study's GPU regime: the lr rule at two GPU-sized batches", "",
            f"From {jobs_file.name} ({len(jobs)} jobs on {', '.join(machines)}). Regime: `{' '.join(design['overrides'])}` "
            f"AdamW's defaults, {design['epochs']} epochs, batches {', '.join(f'{b:,}' for b in design['batches'])}; "
            f"a {design['budget_s']:.0f} s budget, seed-major. The rule: trainer/measure/decision_rule.py (paired by "
            "seed, Holm over the family, *holds* within one point). This call: " + ("; ".join(said) or "report only") + ".",
            "", "## Verdicts", "", *verdicts(jobs, tuple(design["batches"])), "", "## Runs", "",
            "| batch | rule | lr | steps | val acc (mean ± sd, n) |", "|---:|---|---:|---:|---:|",
            *(row(jobs, r, b) for b in design["batches"] for r in RULES)]


def row(jobs: list[dict[str, Any]], rule: str, batch: int) -> str:
    from trainer.measure.seed_groups import Spread

    runs = [j for j in jobs if j["rule"] == rule and j["batch"] == batch]
    if not runs:
        return f"| {batch:,} | {rule} | - | - | - |"
    return (f"| {batch:,} | {rule} | {runs[0]['lr']:.3g} | {runs[0]['steps']} | "
            f"{Spread.of(list(arm(jobs, rule, batch).values())).text('{:.4f}')} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "batch_scaling_gpu.md")
    parser.add_argument("--runs", type=Path, default=None, help="default: outputs/batch_scaling_gpu/DATE_TIME")
    parser.add_argument("--dry-run", action="store_true", help="the CPU stand-in: the study's code at a tenth of the size")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    design = DESIGN["dry" if args.dry_run else "gpu"]
    jobs_file = args.out.with_name(f"{args.out.stem}_jobs.json")
    runs = args.runs or REPO / "outputs" / "batch_scaling_gpu" / time.strftime("%Y-%m-%d_%H-%M-%S")
    command = " ".join(["python benchmarks/batch_scaling_gpu.py", *(argv if argv is not None else sys.argv[1:])])
    said = [] if args.report_only else run(design, jobs_file, runs, command)
    jobs = load_jobs(jobs_file)
    write_report(args.out, report(jobs, design, said, jobs_file), lambda path: None)


if __name__ == "__main__":
    main()
