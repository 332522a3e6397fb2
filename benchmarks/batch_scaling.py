"""The evidence for the batch-scaling rules: what the lr rule does to accuracy and to the time to an
accuracy as the batch grows, over seeds, on a data set where the batch matters.

For each optimizer, one Hydra multirun of `train.py` on `data=digits_expanded` (52,794 training
images at 16 px: 25 steps an epoch even at batch 2,048) crosses the global batch, the lr rule
(`optimizer.lr_scaling`: the optimizer's default, the other one, and none, which holds the lr at
its value for the reference batch of 256) and the seed, each job training the same number of epochs
(the same samples seen) with validation every epoch and `target.metric=val/acc`. Its
`comparison.md` groups the seeds (trainer/seed_groups.py); this script then writes one table and
one plot per study: the final val accuracy (mean ± sd, n) and the time and steps to the target
against the batch, one line per rule, and verdict lines: for each optimizer, the largest batch at
which the default rule stays within the noise of batch 64 (Welch's 95% interval of the difference
holds 0, or the difference is positive), and at which batches it is beyond the noise better or
worse than the other rules.

    python benchmarks/batch_scaling.py --out benchmarks/results/batch_scaling_cpu.md     # the study
    python benchmarks/batch_scaling.py --quick --out /tmp/batch_scaling.md               # CI: outputs only, about 15 s

Every job is one process's run in sequence (Hydra's basic launcher): nothing else should run on
the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainer.fingerprint import cpu_name  # noqa: E402 - after the repository is on the path
from trainer.seed_groups import Spread, difference  # noqa: E402

DEFAULT_RULE = {"adamw": "sqrt", "sgd": "linear", "lamb": "sqrt", "lars": "linear"}
REFERENCE_BATCH = 64


def sweep(optimizer: str, batches: list[int], rules: list[str], seeds: list[int], epochs: int, target: float,
          folder: Path, data: list[str]) -> float:
    """Run one optimizer's multirun into `folder`; its wall time in seconds."""
    command = [sys.executable, str(REPO / "train.py"), "-m", f"optimizer={optimizer}",
               f"optimizer.lr_scaling={','.join(rules)}", f"data.batch_size={','.join(map(str, batches))}",
               f"seed={','.join(map(str, seeds))}", *data, f"trainer.max_epochs={epochs}", "checkpointing=off",
               "progress=off", "trainer.accelerator=cpu", "target.metric=val/acc", f"target.value={target}",
               f"run.root={folder}", f"hydra.sweep.dir={folder}"]
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the {optimizer} sweep failed:\n{done.stderr[-3000:]}")
    return time.monotonic() - started


def read_jobs(folder: Path) -> list[dict[str, Any]]:
    """(rule, batch, seed, val acc, time and steps to target, steps) of each job of a sweep folder."""
    jobs = []
    for job in sorted((p for p in folder.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        try:
            summary = json.loads((job / "summary.json").read_text())
        except (OSError, ValueError):
            continue
        overrides = dict(o.split("=", 1) for o in summary.get("overrides", []) if "=" in o)
        target = summary.get("target") or {}
        completed = summary.get("status") == "completed"
        jobs.append({"rule": overrides.get("optimizer.lr_scaling"), "batch": int(overrides["data.batch_size"]),
                     "seed": overrides.get("seed"), "status": summary.get("status"),
                     "val_acc": (summary.get("metrics") or {}).get("val", {}).get("acc") if completed else None,
                     "target_s": target.get("wall_s") if target.get("reached") else None,
                     "target_steps": target.get("steps") if target.get("reached") else None,
                     "reached": bool(target.get("reached")), "steps": summary.get("steps"),
                     "lr": (summary.get("hyperparameters") or {}).get("lr")})
    return jobs


def cell(jobs: list[dict[str, Any]], rule: str, batch: int) -> list[dict[str, Any]]:
    return [j for j in jobs if j["rule"] == rule and j["batch"] == batch]


def table(optimizer: str, jobs: list[dict[str, Any]], rules: list[str], batches: list[int]) -> list[str]:
    lines = [f"### {optimizer} (default rule: {DEFAULT_RULE[optimizer]})", "",
             "| batch | rule | lr | val acc (mean ± sd, n) | reached | time to target (s) | steps to target |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for batch in batches:
        for rule in rules:
            runs = cell(jobs, rule, batch)
            if not runs:
                continue
            lr = runs[0]["lr"]
            reached = sum(j["reached"] for j in runs)
            lines.append(f"| {batch:,} | {rule}{' (default)' if rule == DEFAULT_RULE[optimizer] else ''} | "
                         f"{lr:.3g} | {Spread.of([j['val_acc'] for j in runs]).text('{:.4f}')} | {reached} of {len(runs)} | "
                         f"{Spread.of([j['target_s'] for j in runs]).text('{:.1f}')} | "
                         f"{Spread.of([j['target_steps'] for j in runs]).text('{:.0f}')} |")
    return lines


def verdicts(optimizer: str, jobs: list[dict[str, Any]], rules: list[str], batches: list[int]) -> list[str]:
    """Each batch's difference from batch 64 under the default rule, with its interval; the largest
    batch up to which every difference is within the noise (or positive); and where the default
    rule is beyond the noise better or worse than the others."""
    default = DEFAULT_RULE[optimizer]
    reference = [j["val_acc"] for j in cell(jobs, default, REFERENCE_BATCH)]
    lines = []
    if reference:
        shown = []
        for batch in (b for b in batches if b > REFERENCE_BATCH):
            found = difference(reference, [j["val_acc"] for j in cell(jobs, default, batch)])
            if found is not None:
                shown.append(f"{batch:,}: {found.text('{:.4f}')}")
        holding = _largest_holding(reference, jobs, default, batches)
        lines.append(f"- {optimizer}, {default} rule, val accuracy against batch {REFERENCE_BATCH}: " + "; ".join(shown))
        if not shown:
            lines.append(f"- {optimizer}, {default} rule: no batch above {REFERENCE_BATCH} was measured")
        elif holding:
            lines.append(f"- {optimizer}, {default} rule: within the noise of batch {REFERENCE_BATCH} (or above it) "
                         f"up to batch {holding:,}")
        else:
            lines.append(f"- {optimizer}, {default} rule: beyond the noise below batch {REFERENCE_BATCH} from the "
                         "next batch on")
    for rule in (r for r in rules if r != default):
        better, worse = [], []
        for batch in batches:
            found = difference([j["val_acc"] for j in cell(jobs, rule, batch)],
                               [j["val_acc"] for j in cell(jobs, default, batch)])
            if found is None or found.within_noise is not False:
                continue
            (better if found.value > 0 else worse).append(f"{batch:,} ({found.value:+.4f})")
        lines.append(f"- {optimizer}, {default} against {rule}: beyond the noise better at "
                     f"{', '.join(better) or 'no batch'}; worse at {', '.join(worse) or 'no batch'}; within it elsewhere")
    return lines


def _largest_holding(reference: list[float], jobs: list[dict[str, Any]], rule: str, batches: list[int]) -> int | None:
    """The largest batch above the reference such that at it and every measured batch between, the
    difference from the reference is within the noise or positive."""
    largest = None
    for batch in sorted(b for b in batches if b > REFERENCE_BATCH):
        if not _holds(reference, [j["val_acc"] for j in cell(jobs, rule, batch)]):
            break
        largest = batch
    return largest


def _holds(reference: list[float], values: list[float]) -> bool:
    found = difference(reference, values)
    return found is not None and (found.within_noise is not False or found.value > 0)


def plot(studies: dict[str, list[dict[str, Any]]], rules: list[str], batches: list[int], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6 * len(studies), 7), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, len(studies), squeeze=False)
    for column, (optimizer, jobs) in enumerate(studies.items()):
        for row, (measure, label) in enumerate((("val_acc", "final val accuracy"), ("target_s", "time to target (s)"))):
            ax = axes[row][column]
            for rule in rules:
                points = [(b, Spread.of([j[measure] for j in cell(jobs, rule, b)])) for b in batches]
                points = [(b, s) for b, s in points if s.mean is not None]
                if points:
                    ax.errorbar([b for b, _ in points], [s.mean for _, s in points], yerr=[s.sd or 0 for _, s in points],
                                marker="o", capsize=3, label=rule + (" (default)" if rule == DEFAULT_RULE[optimizer] else ""))
            ax.set_xscale("log", base=2)
            ax.set(xlabel="global batch", ylabel=label, title=f"{optimizer}: {label}, mean ± sd over seeds")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizers", default="adamw,sgd")
    parser.add_argument("--batches", default="32,64,128,256,512,1024,2048")
    parser.add_argument("--rules", default="sqrt,linear,none")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.9, help="val accuracy whose time and steps are reported")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "batch_scaling_cpu.md")
    parser.add_argument("--runs", type=Path, default=None,
                        help="where the sweeps' run folders go (default: outputs/batch_scaling/DATE_TIME)")
    parser.add_argument("--quick", action="store_true", help="two batches, two rules, one seed, a tenth of the data")
    parser.add_argument("--report-only", action="store_true",
                        help="write the report from the sweeps already in --runs, training nothing")
    args = parser.parse_args(argv)
    data = ["data=digits_expanded"]
    if args.quick:
        args.optimizers, args.batches, args.rules, args.seeds, args.epochs = "adamw", "64,128", "sqrt,none", "1", 1
        data += ["data.copies=2", "data.eval_copies=1"]
    optimizers, rules = args.optimizers.split(","), args.rules.split(",")
    batches, seeds = [int(b) for b in args.batches.split(",")], [int(s) for s in args.seeds.split(",")]
    # The runs themselves stay under outputs/ (ignored by git); each sweep's comparison.md is copied
    # beside the results.
    runs = args.runs or REPO / "outputs" / "batch_scaling" / time.strftime("%Y-%m-%d_%H-%M-%S")
    studies, walls = {}, {}
    for optimizer in optimizers:
        if not args.report_only:
            walls[optimizer] = sweep(optimizer, batches, rules, seeds, args.epochs, args.target, runs / optimizer, data)
        studies[optimizer] = read_jobs(runs / optimizer)
        comparison = runs / optimizer / "comparison.md"
        if comparison.is_file():
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.with_name(f"{args.out.stem}_{optimizer}_comparison.md").write_text(comparison.read_text())
    command = " ".join(["python benchmarks/batch_scaling.py", *(argv if argv is not None else sys.argv[1:])])
    lines = [f"# Batch scaling: the lr rules against the batch, {len(seeds)} seed(s) each", "",
             f"Measured {time.strftime('%Y-%m-%d')} on {cpu_name()}: `data=digits_expanded` "
             f"({'a tenth of it, --quick' if args.quick else '52,794 training images, 16 px'}), the default network, "
             f"{args.epochs} epoch(s) at every batch, target val acc {args.target}; seeds {args.seeds}. "
             f"Wall time: {', '.join(f'{o} {w / 60:.1f} min' for o, w in walls.items()) or 'not measured (--report-only)'}. "
             "Each sweep's own "
             f"comparison (every job, grouped over seeds) is `{args.out.stem}_OPTIMIZER_comparison.md` beside this "
             "file.", "", f"`{command}`", "", "## Verdicts", ""]
    for optimizer, jobs in studies.items():
        lines += verdicts(optimizer, jobs, rules, batches)
    lines += ["", "## Tables", ""]
    for optimizer, jobs in studies.items():
        lines += table(optimizer, jobs, rules, batches) + [""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    plot(studies, rules, batches, args.out.with_suffix(".png"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
