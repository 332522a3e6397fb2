"""Time to accuracy on a small JPEG image folder: torchvision's reference recipe against this
framework's recipe for small image folders, on the same folder and machine, in one session, timed
by one rule for both sides.

What is raced: the bundled digits (1,797, scikit-learn) written as 32 px JPEGs in an ImageFolder
tree, a stratified 80/20 train/val split (nothing downloaded), batch 64, `--epochs` epochs (8) on
both sides:
- the reference: benchmarks/reference_classification.py (ResNet-18, SGD lr 0.1 per 256, the
  reference's transforms), with the reference's own flags for a short budget, by default
  `--lr-scheduler cosineannealinglr --lr-warmup-epochs 1 --lr-warmup-method linear
  --lr-warmup-decay 0.01 --label-smoothing 0.1` (torchvision's cosine over the epochs after the
  warmup; the label smoothing ours uses too); `--reference-args="..."` replaces them
  (`--reference-args=""`: the reference's defaults, a constant lr over 8 epochs);
- ours: `train.py +recipe=small_images trainer.max_epochs=<epochs>` (its warmup and cosine then
  span the same budget) with target.metric=val/acc target.value=<target>.

The rule, the same for both sides: the target (`--target`, val accuracy, default 0.85) is fixed
before the runs, the same in every round; a side's time is that of its first evaluation at or above
the target, in seconds from its first training batch to the end of that evaluation, training and
evaluation alike (the reference: the `train_s` of its first epoch line with val_acc >= target;
ours: summary.json's target.wall_s, which TargetWatch records when the validation at the target
ends). A side that never gets there within the budget has missed that round: it is shown and
counted, never dropped (in the medians a miss counts as an infinite time; in the ratio ours missing
counts as an infinite ratio and the reference missing as ours / the reference's whole training
time, the most the ratio could be).

Rounds are interleaved (reference round i, ours round i, ...) and round i seeds both sides with i.
Each job records its command, start (UTC), duration and the 1-minute load average at its start and
end; a job that started or ended with a load above `--load-limit` (CPUs + 0.5) ran beside other
load: it is flagged and left out of the time figures (and its round out of the ratio). Before each
job the benchmark waits up to `--settle-s` seconds for the load to fall below the limit.

The report (`--out`, markdown) gives per side the median time to target and its range, the ratio
ours/reference per round, its median, range and (5+ rounds) a seeded 95% percentile-bootstrap
interval of the median, the misses, the flagged jobs and a table of the rounds; `<out>.json` beside
it holds everything, and `--report-only` rewrites the markdown from it alone.

    python benchmarks/time_to_accuracy.py                          # 5 rounds, 8 epochs, target 0.85
    python benchmarks/time_to_accuracy.py --rounds 7 --target 0.9 --reference-args="--lr-scheduler cosineannealinglr"
    python benchmarks/time_to_accuracy.py --report-only            # the markdown again, from <out>.json
    python benchmarks/time_to_accuracy.py --quick                  # CI: 1 round, 1 epoch, 20 images a digit
                                                                   # (the reference's cosine without warmup)
    python benchmarks/time_to_accuracy.py --write-folder /tmp/digits_jpeg    # the folder alone, for:
    benchmarks/ladder.sh small_images data=imagefolder data.root=/tmp/digits_jpeg target.metric=val/acc target.value=0.85
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "time_to_accuracy_cpu.md"
QUICK_OUT = REPO / "outputs" / "time_to_accuracy_quick.md"
#: The reference's own flags for a short budget (torchvision's references/classification/train.py).
DEFAULT_REFERENCE_ARGS = ("--lr-scheduler cosineannealinglr --lr-warmup-epochs 1 --lr-warmup-method linear "
                          "--lr-warmup-decay 0.01 --label-smoothing 0.1")
#: --quick's single epoch leaves no room for a warmup before the cosine.
QUICK_REFERENCE_ARGS = "--lr-scheduler cosineannealinglr --label-smoothing 0.1"
BOOTSTRAP_RESAMPLES = 10_000
#: Rounds from which the report gives an interval of the median ratio.
INTERVAL_MIN_ROUNDS = 5
SIDES = ("reference", "ours")
INF = math.inf


# --- the folder ---------------------------------------------------------------------------------

def write_digits_folder(root: Path, size: int = 32, val_share: float = 0.2, seed: int = 0,
                        per_class: Optional[int] = None) -> dict[str, int]:
    """The digits as `size`-px grayscale JPEGs (quality 95): root/{train,val}/digit_N/*.jpg; `per_class`
    keeps only the first that many of each digit (the --quick folder)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (bunch.images * (255.0 / 16.0)).round().astype(np.uint8)
    rng = np.random.default_rng(seed)
    counts = {"train": 0, "val": 0}
    for label in range(10):
        members = rng.permutation(np.flatnonzero(bunch.target == label))[:per_class]
        cut = int(round(len(members) * val_share))
        for split, chosen in (("val", members[:cut]), ("train", members[cut:])):
            folder = root / split / f"digit_{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in chosen:
                image = Image.fromarray(images[i], mode="L").resize((size, size), Image.BILINEAR)
                image.save(folder / f"{i}.jpg", quality=95)
                counts[split] += 1
    return counts


# --- the commands -------------------------------------------------------------------------------

def reference_command(root: Path, epochs: int, workers: int, seed: int, reference_args: str,
                      crop: int = 32) -> list[str]:
    return [sys.executable, str(REPO / "benchmarks" / "reference_classification.py"), str(root),
            "--epochs", str(epochs), "--batch-size", "64", "--crop", str(crop), "--workers", str(workers),
            "--seed", str(seed), *shlex.split(reference_args)]


def ours_command(root: Path, target: float, epochs: int, run_dir: Path, seed: int, extra: Sequence[str]) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), "+recipe=small_images", f"data.root={root}",
            f"trainer.max_epochs={epochs}", "target.metric=val/acc", f"target.value={target}",
            f"hydra.run.dir={run_dir}", "progress=off", f"seed={seed}", *extra]


# --- one job: its load and its time to target ---------------------------------------------------

def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def beside_other_load(load_start: float, load_end: float, limit: float) -> bool:
    """A job ran beside other load when the 1-minute load average at its start or its end exceeded
    `limit` (the CPUs + 0.5: a job alone keeps about one runnable thread a CPU)."""
    return load_start > limit or load_end > limit


def wait_for_quiet(limit: float, settle_s: float, loadavg: Callable[[], tuple[float, float, float]] = os.getloadavg,
                   sleep: Callable[[float], None] = time.sleep, poll_s: float = 2.0) -> float:
    """Wait up to `settle_s` for the 1-minute load to fall to `limit` (the last job's own load decays
    with a minute's time constant); the seconds waited."""
    waited = 0.0
    while loadavg()[0] > limit and waited < settle_s:
        sleep(poll_s)
        waited += poll_s
    return waited


def run_job(command: list[str], load_limit: float, settle_s: float) -> tuple[dict[str, Any], str]:
    """Run one side's job; its record (command, start, duration, loads, flag) and its stdout. A failed
    job stops the benchmark with its last lines of stderr."""
    settled_s = wait_for_quiet(load_limit, settle_s)
    load_start = os.getloadavg()[0]
    started_utc = datetime.now(timezone.utc).isoformat(timespec="seconds")
    started = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    duration = time.perf_counter() - started
    load_end = os.getloadavg()[0]
    if out.returncode != 0:
        tail = "\n".join(out.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"failed (exit {out.returncode}): {shlex.join(command)}\n{tail}")
    # The flag from the loads as recorded (rounded), so that a reader recomputing it from the file
    # agrees: from the unrounded ones, a load of 2.503 recorded as 2.5 was flagged above a limit of 2.5.
    load_start, load_end = round(load_start, 2), round(load_end, 2)
    record = {"command": command, "started_utc": started_utc, "duration_s": round(duration, 2),
              "load_start": load_start, "load_end": load_end, "settled_s": settled_s,
              "beside_other_load": beside_other_load(load_start, load_end, load_limit)}
    return record, out.stdout


def first_at_target(epoch_lines: Sequence[dict[str, Any]], target: float) -> Optional[dict[str, Any]]:
    """The first epoch line whose val_acc is at or above `target` (None: never): its time and epoch."""
    for line in epoch_lines:
        if line["val_acc"] >= target:
            return {"time_s": line["train_s"], "epoch": line["epoch"], "val_acc": line["val_acc"]}
    return None


def reference_result(stdout: str, target: float) -> dict[str, Any]:
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    epochs = [line for line in lines if "epoch" in line and "final" not in line]
    final = lines[-1]
    hit = first_at_target(epochs, target)
    return {"reached": hit is not None, "time_s": hit["time_s"] if hit else None, "epoch": hit["epoch"] if hit else None,
            "val_acc_at_target": hit["val_acc"] if hit else None, "best_val_acc": max(e["val_acc"] for e in epochs),
            "final_val_acc": final["val_acc"], "train_s": final["train_s"], "epochs_trained": final["epochs"],
            "epoch_lines": epochs, "final": final}


def ours_result(summary: dict[str, Any]) -> dict[str, Any]:
    target = summary["target"]
    reached = bool(target["reached"])
    return {"reached": reached, "time_s": target["wall_s"] if reached else None,
            "epoch": target["epoch"] + 1 if reached else None,  # summary.json's epoch counts from 0
            "val_acc_at_target": target.get("value_reached"), "best_val_acc": target.get("best"),
            "final_val_acc": summary["metrics"]["val"]["acc"], "train_s": summary["fit_time_s"],
            "epochs_trained": summary["epochs"], "target": target}


# --- the arithmetic -----------------------------------------------------------------------------

def side_time(job: dict[str, Any]) -> Optional[float]:
    """A job's time to target for the figures: None when it ran beside other load (left out),
    infinite when it missed."""
    if job["beside_other_load"]:
        return None
    return job["time_s"] if job["reached"] else INF


def round_ratio(rnd: dict[str, Any]) -> Optional[float]:
    """Ours / reference for one round; None when either job is left out or neither side reached the
    target. Ours missing counts as infinite; the reference missing as ours over its whole training
    time (its time to target was longer, so the ratio is at most that)."""
    ref, ours = rnd["reference"], rnd["ours"]
    if ref["beside_other_load"] or ours["beside_other_load"] or not (ref["reached"] or ours["reached"]):
        return None
    if not ours["reached"]:
        return INF
    if not ref["reached"]:
        return ours["time_s"] / ref["train_s"]
    return ours["time_s"] / ref["time_s"]


def bootstrap_interval(values: Sequence[float], level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of the median: the medians of `resamples` resamples (with
    replacement) of `values` drawn from a generator seeded with `seed`, and their (1-level)/2 and
    (1+level)/2 order statistics (no interpolation, so a miss's infinity stays one)."""
    data = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    medians = np.sort(np.median(data[rng.integers(0, len(data), size=(resamples, len(data)))], axis=1))
    tail = (1.0 - level) / 2.0
    low = medians[int(math.floor(tail * resamples))]
    high = medians[min(resamples - 1, int(math.ceil((1.0 - tail) * resamples)) - 1)]
    return float(low), float(high)


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """The figures the report gives, from the raw rounds alone."""
    rounds = data["rounds"]
    settings = data["settings"]
    figures: dict[str, Any] = {}
    for side in SIDES:
        counted = [t for t in (side_time(r[side]) for r in rounds) if t is not None]
        figures[side] = {
            "rounds_counted": len(counted),
            "missed_rounds": [r["round"] for r in rounds if not r[side]["reached"]],
            "flagged_rounds": [r["round"] for r in rounds if r[side]["beside_other_load"]],
            "median_s": statistics.median(counted) if counted else None,
            "range_s": (min(counted), max(counted)) if counted else None,
        }
    ratios = [(r["round"], x) for r in rounds if (x := round_ratio(r)) is not None]
    values = [x for _, x in ratios]
    figures["ratio"] = {
        "per_round": {str(n): x for n, x in ratios},
        "rounds_counted": len(values),
        "median": statistics.median(values) if values else None,
        "range": (min(values), max(values)) if values else None,
        "interval": (bootstrap_interval(values, seed=settings["bootstrap_seed"])
                     if len(values) >= INTERVAL_MIN_ROUNDS else None),
    }
    return figures


# --- the report ---------------------------------------------------------------------------------

def fmt_s(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return "not reached" if math.isinf(x) else f"{x:.1f}"


def fmt_ratio(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return "inf (ours missed)" if math.isinf(x) else f"{x:.2f}x"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def rounds_list(numbers: Sequence[int]) -> str:
    if not numbers:
        return "no round"
    return ("round " if len(numbers) == 1 else "rounds ") + ", ".join(str(n) for n in numbers)


def json_safe(value: Any) -> Any:
    """Infinities (misses) as the string "inf": the JSON stays standard."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def job_cell(job: dict[str, Any]) -> str:
    if job["reached"]:
        cell = f"{job['time_s']:.1f} (epoch {job['epoch']})"
    else:
        best = job.get("best_val_acc")
        cell = f"missed (best {best:.3f})" if best is not None else "missed"
    return cell + (" [beside other load]" if job["beside_other_load"] else "")


def report(data: dict[str, Any]) -> str:
    """The markdown report, from the JSON record alone."""
    settings, rounds = data["settings"], data["rounds"]
    figures = summarize(data)
    target, epochs, limit = settings["target"], settings["epochs"], settings["load_limit"]
    ref_fig, ours_fig, ratio = figures["reference"], figures["ours"], figures["ratio"]
    counts = data["folder"]
    lines = [
        f"# Time to accuracy: a small JPEG folder ({settings['cpu']}, {settings['cpus']} CPUs, "
        f"{settings['started_utc'][:10]})",
        "",
        f"`{settings['command_line']}`: the bundled digits as 32 px JPEGs ({counts['train']} train, {counts['val']} "
        f"val), batch 64, {plural(epochs, 'epoch')} on both sides, {plural(len(rounds), 'interleaved round')} (round i seeds both sides "
        "with i, so the rounds vary the initialization, the data order and the augmentation as well as the timing).",
        "",
        f"**The rule, the same for both sides:** the target, val accuracy >= {target:g}, was fixed before the runs and "
        "is the same in every round; a side's time is that of its first evaluation at or above it, in seconds from "
        "its first training batch to the end of that evaluation, training and evaluation alike (the reference: the "
        "`train_s` of its first epoch line at the target; ours: summary.json's `target.wall_s`). A side that never "
        "reached the target in its budget missed that round; misses are counted, not dropped (in a median a miss is "
        "an infinite time; in the ratio ours missing counts as infinite, the reference missing as ours / the "
        "reference's whole training time, the most the ratio could be).",
        "",
        f"- reference: `benchmarks/reference_classification.py` with "
        f"`{settings['reference_args'] or '(its defaults: StepLR every 30 epochs, no warmup)'}`",
        f"- ours: `train.py +recipe=small_images trainer.max_epochs={epochs}"
        + (f" {' '.join(settings['ours_overrides'])}" if settings["ours_overrides"] else "") + "`",
        "",
        "| side | reached the target (rounds) | median time to target (s) | range (s) | median whole process (s) |",
        "|---|---|---|---|---|",
    ]
    for side, fig, name in (("reference", ref_fig, "torchvision reference"), ("ours", ours_fig, "`+recipe=small_images`")):
        reached = sum(1 for r in rounds if r[side]["reached"])
        rng = fig["range_s"]
        clean = [r[side]["duration_s"] for r in rounds if not r[side]["beside_other_load"]]
        process = statistics.median(clean) if clean else None
        lines.append(f"| {name} | {reached} of {len(rounds)} | {fmt_s(fig['median_s'])} | "
                     f"{f'{fmt_s(rng[0])}-{fmt_s(rng[1])}' if rng else '-'} | {fmt_s(process)} |")
    lines.append("")
    if ratio["median"] is None:
        lines.append("**Ratio (ours / reference): no round with both jobs counted and a side at the target.**")
    else:
        low, high = ratio["range"]
        text = (f"**Ratio (ours / reference): median {fmt_ratio(ratio['median'])}** over {ratio['rounds_counted']} rounds "
                f"(range {fmt_ratio(low)}-{fmt_ratio(high)}")
        if ratio["interval"] is not None:
            ilow, ihigh = ratio["interval"]
            text += (f"; 95% percentile-bootstrap interval of the median {fmt_ratio(ilow)}-{fmt_ratio(ihigh)}, "
                     f"{BOOTSTRAP_RESAMPLES:,} resamples of the rounds, seed {settings['bootstrap_seed']}")
        else:
            text += f"; no interval below {INTERVAL_MIN_ROUNDS} rounds counted"
        lines.append(text + ").")
    lines += [
        "",
        f"Missed the target: reference in {rounds_list(ref_fig['missed_rounds'])}; ours in "
        f"{rounds_list(ours_fig['missed_rounds'])}.",
        f"Beside other load (1-minute load average above {limit:g} = CPUs + 0.5 at a job's start or end; left out of "
        f"the time figures, and its round out of the ratio): reference in {rounds_list(ref_fig['flagged_rounds'])}; "
        f"ours in {rounds_list(ours_fig['flagged_rounds'])}.",
        "",
        "| round | seed | reference: time to target s (epoch) | ref. final acc | ours: time to target s (epoch) | "
        "ours final acc | ratio | load ref. start-end | load ours start-end | started (UTC) ref. / ours | "
        "whole process s ref. / ours |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rounds:
        ref, ours = r["reference"], r["ours"]
        x = round_ratio(r)
        if x is None:
            ratio_cell = "left out (load)" if ref["beside_other_load"] or ours["beside_other_load"] else "neither reached"
        elif ref["reached"] or math.isinf(x):
            ratio_cell = fmt_ratio(x)
        else:
            ratio_cell = f"<= {x:.2f}x (reference missed)"
        lines.append(
            f"| {r['round']} | {r['seed']} | {job_cell(ref)} | {ref['final_val_acc']:.3f} | {job_cell(ours)} | "
            f"{ours['final_val_acc']:.3f} | {ratio_cell} | {ref['load_start']:.2f}-{ref['load_end']:.2f} | "
            f"{ours['load_start']:.2f}-{ours['load_end']:.2f} | {ref['started_utc'][11:19]} / "
            f"{ours['started_utc'][11:19]} | {ref['duration_s']:.1f} / {ours['duration_s']:.1f} |")
    if rounds:
        lines += ["", "Round 1's commands (the others differ in the seed and the run folder; every job's command is "
                  "in the JSON):", "", "```",
                  shlex.join(rounds[0]["reference"]["command"]), shlex.join(rounds[0]["ours"]["command"]), "```"]
    return "\n".join(lines) + "\n"


def load_record(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"--report-only: {path} does not exist; run the race first (or give --out)") from None
    if not isinstance(data, dict) or "rounds" not in data or "settings" not in data:
        raise SystemExit(f"--report-only: {path} is not this benchmark's record (an older format?); run the race again")
    return revive(data)


def revive(value: Any) -> Any:
    """json_safe's "inf" back to a float."""
    if value == "inf":
        return INF
    if isinstance(value, dict):
        return {k: revive(v) for k, v in value.items()}
    if isinstance(value, list):
        return [revive(v) for v in value]
    return value


def write_record(data: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(json_safe(data), indent=1))
    tmp.replace(path)


# --- the race -----------------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=8, help="both sides' budget")
    parser.add_argument("--target", type=float, default=0.85, help="val accuracy; fixed before the runs")
    parser.add_argument("--reference-args",
                        help="the reference's schedule/loss flags, replacing the default (write --reference-args=\"...\"); "
                             f"default: {DEFAULT_REFERENCE_ARGS} (--quick: {QUICK_REFERENCE_ARGS})")
    parser.add_argument("--workers", type=int, default=1, help="the reference's loader workers (ours: auto)")
    parser.add_argument("--load-limit", type=float, help="1-minute load above which a job is flagged (CPUs + 0.5)")
    parser.add_argument("--settle-s", type=float, default=20.0, help="wait up to this long for the load before a job")
    parser.add_argument("--bootstrap-seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help=f"markdown report; <out>.json beside it (default {RESULTS.relative_to(REPO)}, "
                                                 f"--quick: {QUICK_OUT.relative_to(REPO)})")
    parser.add_argument("--report-only", action="store_true", help="rewrite --out from <out>.json, run nothing")
    parser.add_argument("--quick", action="store_true", help="CI: 1 round, 1 epoch, 20 images a digit")
    parser.add_argument("--write-folder", type=Path, help="only write the JPEG folder there (for the accuracy ladder)")
    parser.add_argument("ours", nargs="*", help="extra overrides for our run")
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["python", "benchmarks/time_to_accuracy.py", *(sys.argv[1:] if argv is None else argv)])
    if args.quick:
        args.rounds, args.epochs, args.settle_s = 1, 1, 0.0
    if args.out is None:
        args.out = QUICK_OUT if args.quick else RESULTS
    if args.rounds < 1 or args.epochs < 1:
        parser.error("--rounds and --epochs: at least 1")
    if not 0.0 < args.target <= 1.0:
        parser.error(f"--target {args.target}: a val accuracy, allowed 0 < target <= 1")
    if args.reference_args is None:
        args.reference_args = QUICK_REFERENCE_ARGS if args.quick else DEFAULT_REFERENCE_ARGS
    if not (args.report_only or args.write_folder):
        check_reference_args(parser, args.reference_args, args.epochs)
    return args


def check_reference_args(parser: argparse.ArgumentParser, reference_args: str, epochs: int) -> None:
    """Refuse flags the reference would refuse, before any folder is written or round run."""
    spec = importlib.util.spec_from_file_location("reference_classification",
                                                  REPO / "benchmarks" / "reference_classification.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.parse_args(["ROOT", "--epochs", str(epochs), *shlex.split(reference_args)])
    except SystemExit:
        parser.error(f"--reference-args {reference_args!r} with --epochs {epochs}: refused by "
                     "reference_classification.py (its message above)")


def race(args: argparse.Namespace) -> dict[str, Any]:
    from trainer.infra.fingerprint import cpu_name

    cpus = usable_cpus()
    limit = args.load_limit if args.load_limit is not None else cpus + 0.5
    data: dict[str, Any] = {
        "settings": {"command_line": args.command_line, "target": args.target, "epochs": args.epochs,
                     "rounds": args.rounds, "quick": args.quick, "reference_args": args.reference_args,
                     "ours_overrides": list(args.ours), "workers": args.workers, "cpus": cpus, "cpu": cpu_name(),
                     "load_limit": limit, "settle_s": args.settle_s, "bootstrap_seed": args.bootstrap_seed,
                     "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds")},
        "rounds": [],
    }
    partial = args.out.with_suffix(".partial.json")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "digits_jpeg"
        data["folder"] = write_digits_folder(root, per_class=20 if args.quick else None)
        for i in range(args.rounds):
            try:
                command = reference_command(root, args.epochs, args.workers, i, args.reference_args)
                job, stdout = run_job(command, limit, args.settle_s)
                reference = job | reference_result(stdout, args.target)
                run_dir = Path(tmp) / f"ours{i}"
                job, _ = run_job(ours_command(root, args.target, args.epochs, run_dir, i, args.ours), limit,
                                 args.settle_s)
                ours = job | ours_result(json.loads((run_dir / "summary.json").read_text()))
            except SystemExit as failure:
                kept = f"\nrounds finished before it: {partial}" if data["rounds"] else ""
                raise SystemExit(f"round {i + 1}: {failure}{kept}") from None
            data["rounds"].append({"round": i + 1, "seed": i, "reference": reference, "ours": ours})
            # A failure later leaves these rounds here, and the last finished record (<out>.json) untouched.
            write_record(data, partial)
            print(json.dumps(json_safe({"round": i + 1, "reference_s": reference["time_s"],
                                        "ours_s": ours["time_s"], "ratio": round_ratio(data["rounds"][-1])})),
                  flush=True)
    data["finished_utc"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    data["summary"] = summarize(data)
    return data


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.write_folder:
        print(write_digits_folder(args.write_folder))
        return
    record = args.out.with_suffix(".json")
    if args.report_only:
        data = load_record(record)
    else:
        data = race(args)
        write_record(data, record)
        args.out.with_suffix(".partial.json").unlink(missing_ok=True)
    text = report(data)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
