"""The evidence for the gradient clipping: what each clipping mode does to loss spikes, divergence,
final accuracy and the time to an accuracy, where training is fragile and where it is not, over seeds.

Two settings, each one Hydra multirun of `train.py` crossing the clipping arm with the seed:

- `fragile`: the default network without its BatchNorm layers (`model.norm=none`), SGD with Nesterov
  momentum at a high lr (`--fragile-lr` at batch 256, moved to the run's batch by SGD's default rule)
  and no warmup. This is what users meet: a plain network (many research and older production
  models have no normalization), an lr raised to finish sooner, and the warmup off because the
  recipe they copied had none. Such runs spike early and some diverge.
- `stable`: today's defaults (AdamW with warmup, BatchNorm): what the clipping costs when nothing is fragile.

Arms: `clipping=off`, `fixed_norm` (max_norm 1.0), `percentile` (the default: the 95th percentile
of the first calibration steps' norms, each of those steps clipped to the percentile so far) and
`autoclip` (the same, then a rolling window); `--arms` can add `percentile_unclipped_calibration`
(`clipping.clip_during_calibration=false`, the default before this study; its own multirun).
Seeds: as many as the decision rule asks per setting (docs/practices.md, `planned_seeds`), the
default against each other arm being one family, corrected by Holm.
A spike is a step whose loss is above 3x the median of the previous 50 steps (counted by the run
itself: summary.json `loss.spikes`, trainer/callbacks/loss_record.py). A run diverged when it was
stopped for non-finite steps, ended with a non-finite loss, or ended below val acc 0.5 (chance 0.1).
Validation runs every `--val-every` steps, so the time and steps to the target have that resolution.

Every job's numbers and provenance (command, start, end, duration, machine, load, the study command)
go into `<out>_jobs.json` (a later call adds to it); the report (the power, verdicts, one table per
setting, a plot) is written from that file alone.

    python benchmarks/clipping_study.py                                # both settings, 13 and 9 seeds, about 12 min here
    python benchmarks/clipping_study.py --report-only                  # the report from the jobs file
    python benchmarks/clipping_study.py --quick --out /tmp/clipping.md # CI: outputs only, about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sweep_jobs import (add_jobs, keep_comparison, load_jobs, overrides_of, provenance_of, run_multirun,  # noqa: E402
                        summaries, timed_alone, write_report)

from trainer.infra.figures import new_figure, save_png  # noqa: E402
from trainer.measure.decision_rule import compare, correct, detectable_drop, pooled_sd, seeds_for  # noqa: E402
from trainer.measure.seed_groups import Spread  # noqa: E402 - after the repository is on the path

#: Config names, except the `UNCLIPPED` arm: a config name with its calibration left unclipped
#: (the default before this study).
ARMS = ("off", "fixed_norm", "percentile", "autoclip", "percentile_unclipped_calibration")
#: The arms a study runs unless told: the calibration's own comparison (clipped or not) is the batch
#: study's `calibration` arm now, so the unclipped arm runs only when asked for.
DEFAULT_ARMS = ARMS[:4]
UNCLIPPED = "_unclipped_calibration"
DEFAULT_ARM = "percentile"
SETTINGS = ("fragile", "stable")
DIVERGED_BELOW = 0.5
#: The decision rule (docs/practices.md, "How a default is decided"), per setting: the smallest
#: difference in val accuracy the study must catch, and the spread it was sized on (the within-arm
#: sd pooled over the runs that did not diverge in the 2026-12-02 jobs file, commit 2a22e87). Where
#: training is stable one point matters; where it is fragile the question is whether a mode rescues
#: the run, so ten points.
MARGINS = {"stable": 0.01, "fragile": 0.10}
PILOT_SD = {"stable": 0.0071, "fragile": 0.059}


def planned_seeds(setting: str, arms: int = len(DEFAULT_ARMS)) -> int:
    """The seeds the rule asks for: the default against each other arm is one family (m = arms - 1)."""
    return seeds_for(PILOT_SD[setting], arms - 1, drop=MARGINS[setting])
#: Overrides that differ between the jobs of a setting or only say where a job ran.
PER_JOB = ("clipping", "clipping.clip_during_calibration", "seed", "run.root", "hydra.sweep.dir", "checkpointing", "progress", "trainer.accelerator")


def setting_overrides(setting: str, fragile_lr: float) -> list[str]:
    if setting == "fragile":
        # SGD's lr and warmup are set; its lr rule is today's default (at batch 64 it moves the lr).
        return ["model.norm=none", "optimizer=sgd", f"optimizer.lr={fragile_lr:g}", "scheduler.warmup=0"]
    return []


def job_of(summary: dict[str, Any], setting: str) -> dict[str, Any]:
    overrides = overrides_of(summary)
    metrics = summary.get("metrics") or {}
    loss = summary.get("loss") or {}
    clipping = summary.get("clipping") or {}
    target = summary.get("target") or {}
    val_acc = metrics.get("val", {}).get("acc")
    final = loss.get("final")
    steps = summary.get("steps") or 0
    stopped = summary.get("status") != "completed"
    diverged = stopped or final is None or not math.isfinite(final) or val_acc is None or val_acc < DIVERGED_BELOW
    arm = overrides.get("clipping", DEFAULT_ARM)
    if arm in ("percentile", "autoclip") and not clipping.get("clip_during_calibration", False):
        arm += UNCLIPPED  # summaries older than the setting recorded their calibration unclipped
    return {"setting": setting, "arm": arm, "seed": int(overrides.get("seed", 42)),
            "status": summary.get("status"), "val_acc": val_acc, "test_acc": metrics.get("test", {}).get("acc"),
            "spikes": loss.get("spikes"), "first_spike": loss.get("first_spike"),
            "skipped_steps": (summary.get("nonfinite") or {}).get("skipped_steps", 0),
            "clipped_share": (clipping.get("steps_clipped", 0) / steps) if steps else None,
            "threshold": clipping.get("threshold"), "diverged": diverged, "steps": steps,
            "reached": bool(target.get("reached")), "target_s": target.get("wall_s") if target.get("reached") else None,
            "target_steps": target.get("steps") if target.get("reached") else None,
            "lr": (summary.get("hyperparameters") or {}).get("lr"), **provenance_of(summary),
            "overrides": [o for o in summary.get("overrides", []) if o.split("=", 1)[0] not in PER_JOB]}


def key(job: dict[str, Any]) -> tuple:
    return job["setting"], job["arm"], job["seed"]


def arm_jobs(jobs: list[dict[str, Any]], setting: str, arm: str) -> list[dict[str, Any]]:
    return [j for j in jobs if j["setting"] == setting and j["arm"] == arm]


def values(runs: list[dict[str, Any]], measure: str) -> list[float | None]:
    return [None if r[measure] is None else float(r[measure]) for r in runs]


def table(setting: str, jobs: list[dict[str, Any]]) -> list[str]:
    lines = [f"### {setting}", "",
             "| clipping | spikes a run | runs with a spike | diverged | steps clipped | val acc (mean ± sd, n) | "
             "reached | time to target (s) | steps to target |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm in ARMS:
        runs = arm_jobs(jobs, setting, arm)
        if not runs:
            continue
        clipped = Spread.of(values(runs, "clipped_share"))
        lines.append(
            f"| {arm}{' (default)' if arm == DEFAULT_ARM else ''} | {Spread.of(values(runs, 'spikes')).text('{:.1f}')} | "
            f"{sum(bool(r['spikes']) for r in runs)} of {len(runs)} | {sum(r['diverged'] for r in runs)} of {len(runs)} | "
            f"{'-' if clipped.mean is None else f'{clipped.mean:.1%}'} | {Spread.of(values(runs, 'val_acc')).text('{:.4f}')} | "
            f"{sum(r['reached'] for r in runs)} of {len(runs)} | "
            f"{Spread.of(values([r for r in runs if timed_alone(r)], 'target_s')).text('{:.1f}')} | "
            f"{Spread.of(values(runs, 'target_steps')).text('{:.0f}')} |")
    return lines


def accuracies(runs: list[dict[str, Any]]) -> list[float]:
    """Val accuracies; a run that measured none (stopped for non-finite steps) counts at chance."""
    return [0.1 if r["val_acc"] is None or not math.isfinite(r["val_acc"]) else float(r["val_acc"]) for r in runs]


def verdicts(setting: str, jobs: list[dict[str, Any]]) -> list[str]:
    """The default against each other arm, one family corrected by Holm: the difference in val
    accuracy with Welch's interval and p-values; the runs that diverged and that spiked beside it."""
    default = arm_jobs(jobs, setting, DEFAULT_ARM)
    others = [a for a in ARMS if a != DEFAULT_ARM and arm_jobs(jobs, setting, a)]
    family = correct([c for c in (compare(a, accuracies(arm_jobs(jobs, setting, a)), accuracies(default)) for a in others)
                      if c is not None])
    lines = []
    for found in family:
        other = arm_jobs(jobs, setting, found.label)
        lines.append(f"- {setting}, {DEFAULT_ARM} (default) against {found.label}: val acc {found.text()}; diverged "
                     f"{sum(r['diverged'] for r in default)} of {len(default)} against {sum(r['diverged'] for r in other)} "
                     f"of {len(other)}; runs with a loss spike {sum(bool(r['spikes']) for r in default)} against "
                     f"{sum(bool(r['spikes']) for r in other)}")
    return lines


def power_lines(setting: str, jobs: list[dict[str, Any]]) -> list[str]:
    """The seeds the rule asked for, and what the runs' own spread lets "within the noise" rule out."""
    groups = [[r["val_acc"] for r in arm_jobs(jobs, setting, a) if not r["diverged"]] for a in ARMS]
    measured, m = pooled_sd(groups), sum(1 for a in ARMS if arm_jobs(jobs, setting, a)) - 1
    seeds = min((len(arm_jobs(jobs, setting, a)) for a in ARMS if arm_jobs(jobs, setting, a)), default=0)
    line = (f"- {setting}: a drop of {MARGINS[setting]:g} to catch with 80% power at Holm's strictest level of "
            f"m={m}, pilot sd {PILOT_SD[setting]}: {planned_seeds(setting, m + 1)} seeds planned; {seeds} an arm ran")
    if measured is not None and m > 0:
        line += (f"; measured sd {measured:.4f} (runs that did not diverge), so within the noise rules out a drop of "
                 f"{detectable_drop(seeds, measured, m):.4f} or more")
    return [line]


def plot(jobs: list[dict[str, Any]], path: Path) -> None:
    """Per setting: val accuracy and spikes a run for each arm, every seed a dot, the mean a bar."""
    settings = [s for s in SETTINGS if any(j["setting"] == s for j in jobs)]
    figure = new_figure(figsize=(7 * max(len(settings), 1), 7.5), layout="constrained")
    axes = figure.subplots(2, max(len(settings), 1), squeeze=False)
    for column, setting in enumerate(settings):
        for row_index, (measure, label) in enumerate((("val_acc", "final val accuracy"), ("spikes", "loss spikes a run"))):
            ax = axes[row_index][column]
            arms = [a for a in ARMS if arm_jobs(jobs, setting, a)]
            for x, arm in enumerate(arms):
                present = [v for v in values(arm_jobs(jobs, setting, arm), measure) if v is not None and math.isfinite(v)]
                if present:
                    ax.bar(x, sum(present) / len(present), color="C0" if arm != DEFAULT_ARM else "C1", alpha=0.5)
                    ax.plot([x] * len(present), present, "k.", alpha=0.7)
            ax.set_xticks(range(len(arms)), [a.replace(UNCLIPPED, "\n(calibration\nunclipped)") for a in arms],
                          fontsize=8)
            ax.set(ylabel=label, title=f"{setting}: {label} (bar: mean; dots: seeds)")
            ax.grid(alpha=0.3, axis="y")
    save_png(figure, path)


def sweeps(arms: list[str]) -> list[tuple[str, list[str], list[str]]]:
    """The multiruns the arms need: (folder suffix, config names, extra overrides); the unclipped-calibration
    arms are their config names with `clipping.clip_during_calibration=false`, in a sweep of their own."""
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; allowed: {', '.join(ARMS)}")
    plain = [a for a in arms if not a.endswith(UNCLIPPED)]
    unclipped = [a.removesuffix(UNCLIPPED) for a in arms if a.endswith(UNCLIPPED)]
    return ([("", plain, [])] if plain else []) + (
        [(UNCLIPPED, unclipped, ["clipping.clip_during_calibration=false"])] if unclipped else [])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"some of {', '.join(ARMS)}")
    parser.add_argument("--seeds", default="auto", help="a list, or auto: 1 to as many as the decision rule asks "
                        "for each setting (planned_seeds)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--copies", type=int, default=4, help="distortions of each training digit (42 is the full set)")
    parser.add_argument("--fragile-lr", type=float, default=0.8, help="SGD's lr at batch 256 in the fragile setting")
    parser.add_argument("--val-every", type=int, default=40, help="validation every this many steps")
    parser.add_argument("--eval-copies", type=int, default=4, help="distortions of each validation digit")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "clipping_cpu.md")
    parser.add_argument("--runs", type=Path, default=None, help="default: outputs/clipping_study/DATE_TIME")
    parser.add_argument("--quick", action="store_true", help="two arms, two seeds, one epoch of a 2-copy set, "
                        "validation on the plain digits")
    parser.add_argument("--report-only", action="store_true", help="write the report from the jobs file, training nothing")
    args = parser.parse_args(argv)
    if args.quick:
        args.arms, args.seeds, args.epochs, args.copies, args.val_every = "off,percentile", "1,2", 1, 2, 10
        args.eval_copies = 1
    jobs_file = args.out.with_name(f"{args.out.stem}_jobs.json")
    runs = args.runs or REPO / "outputs" / "clipping_study" / time.strftime("%Y-%m-%d_%H-%M-%S")
    walls = []
    command = " ".join(["python benchmarks/clipping_study.py", *(argv if argv is not None else sys.argv[1:])])
    for setting in ([] if args.report_only else args.settings.split(",")):
        planned = planned_seeds(setting, len(args.arms.split(",")))
        seeds = ",".join(str(i) for i in range(1, planned + 1)) if args.seeds == "auto" else args.seeds
        for suffix, arms, extra in sweeps(args.arms.split(",")):
            folder, label = runs / f"{setting}{suffix}", f"{setting}{suffix}"
            wall = run_multirun([f"clipping={','.join(arms)}", *extra, f"seed={seeds}",
                                 *setting_overrides(setting, args.fragile_lr), "data=digits_expanded",
                                 f"data.copies={args.copies}", f"data.eval_copies={args.eval_copies}", f"trainer.max_epochs={args.epochs}",
                                 f"+trainer.val_check_interval={args.val_every}", "target.metric=val/acc",
                                 f"target.value={args.target}"], folder, label)
            walls.append(f"{label} {wall / 60:.1f} min")
            add_jobs(jobs_file, [{**job_of(s, setting), "study_command": command} for s in summaries(folder)], key)
            keep_comparison(folder, args.out.with_name(f"{args.out.stem}_sweeps"), label)
    jobs = load_jobs(jobs_file)
    settings = [s for s in SETTINGS if any(j["setting"] == s for j in jobs)]
    ran = "; ".join(f"{s}: `{' '.join(next(j for j in jobs if j['setting'] == s)['overrides'])}`" for s in settings)
    lines = ["# Gradient clipping: spikes, divergence and accuracy, fragile and stable", "",
             f"Written {time.strftime('%Y-%m-%d')} from {jobs_file.name} ({len(jobs)} jobs on "
             f"{', '.join(sorted({j['machine'] for j in jobs}))}, run {min((j.get('started') or '?') for j in jobs)} to "
             f"{max((j.get('started') or '?') for j in jobs)}). The settings, as run: {ran}. A spike: a step's "
             "loss above 3x the median of the previous 50 steps. Diverged: stopped for non-finite steps, a non-finite "
             f"final loss, or val acc below {DIVERGED_BELOW}. Steps clipped: the share of all steps. Differences are "
             "Welch's 95% intervals over the seeds with p-values, Holm-adjusted within each setting (the default "
             "against each other arm is one family); beyond the noise where the adjusted p is below 0.05. A run that "
             "measured no accuracy counts at chance (0.1). Times only from jobs timed alone "
             f"({sum(timed_alone(j) for j in jobs)} of {len(jobs)}: 1-minute load within the CPUs + 0.5). "
             + (f"This call's sweeps: {', '.join(walls)}." if walls else ""), "", "The study's commands (jobs):", "",
             *(f"- `{c}` ({sum(j.get('study_command', 'not recorded') == c for j in jobs)})"
               for c in dict.fromkeys(j.get("study_command", "not recorded") for j in jobs)),
             "", "## The decision rule and its power (docs/practices.md)", ""]
    for setting in settings:
        lines += power_lines(setting, jobs)
    lines += ["", "## Verdicts", ""]
    for setting in settings:
        lines += verdicts(setting, jobs)
    lines += ["", "## Tables", ""]
    for setting in settings:
        lines += table(setting, jobs) + [""]
    write_report(args.out, lines, lambda path: plot(jobs, path))


if __name__ == "__main__":
    main()
