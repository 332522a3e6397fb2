"""The evidence for the batch-scaling rules: what the lr rule, the weight-decay rule, warmup, the
clipping calibration and the large-batch optimizers do to accuracy as the batch grows, over seeds,
with today's defaults in every arm, decided by the rule of docs/practices.md ("How a default is
decided").

Every study is a set of Hydra multiruns of `train.py` on `data=digits_expanded` (`--copies` 21:
26,397 training images at 16 px), each job training the same number of epochs (the same samples
seen) with validation every epoch and `target.metric=val/acc`. Every arm is today's defaults with
one thing changed:

- `defaults`: each optimizer (AdamW, SGD) at every batch from 32 to 2,048;
- `lr`: the other lr rules at `LR_BATCHES`;
- `large`: LAMB and LARS (their own defaults) at `LARGE_BATCHES`;
- `warmup`: warmup off at the three largest batches whose 5% warmup is at least ten steps;
- `wd`: the other weight-decay rules at `WD_BATCHES`;
- `calibration`: the clipping's calibration steps left unclipped at `CALIBRATION_BATCHES`.

Every job's numbers and provenance (its command, start, end, duration, machine, the load average at
start and end, the study command that ran it) go into a jobs file (`<out>_jobs.json`, merged by
setting and seed), kept as soon as each sweep ends; the report is written from that file alone
(benchmarks/batch_scaling_report.py): the power, Holm-corrected verdicts by family, one table per
optimizer and a plot. Each sweep's own `comparison.md` is copied to `<out>_sweeps/`.

    python benchmarks/batch_scaling.py                                   # every study, 5 seeds, about 100 min here
    python benchmarks/batch_scaling.py --studies warmup,large            # some studies, added to the jobs file
    python benchmarks/batch_scaling.py --report-only                     # the report from the jobs file
    python benchmarks/batch_scaling.py --quick --out /tmp/batch_scaling.md   # CI: outputs only, about 30 s

The small-batch arms (issue 51 item 4), designed and committed before their first job: the weight-decay
rules and the calibration at 64 and 512, and SGD's linear lr rule at 32, each against the defaults run
in the same study with the same seeds, into their own report. Seeds from the power calculation on the
spread the test uses: the per-seed differences' sd measured at these batches in the first study was
at most 0.0038 (SGD at 512); a paired two-sided test calling a difference of one point with 80% power
at Holm's strictest level of the largest family, four (AdamW's two other weight-decay rules at two
batches), needs 5 seeds (`decision_rule.seeds_for(0.0038, family=4, is_paired=True)`), and
non-inferiority within one point needs 5 too. Every job on one thread (`--threads 1`, recorded in each
job): these jobs share the machine with other work, and a job's two OpenMP threads spinning against
other processes made one 22x slower (741 s against 34 s) in a first start of this design (6 seeds,
torch's threads), stopped after 3 jobs, none of them used:

    python benchmarks/batch_scaling.py --studies defaults,wd,calibration --batches 64,512 --seeds 1,2,3,4,5 \
        --threads 1 --out benchmarks/results/batch_scaling_small_cpu.md
    python benchmarks/batch_scaling.py --studies defaults,lr --optimizers sgd --rules linear --batches 32 \
        --seeds 1,2,3,4,5 --threads 1 --out benchmarks/results/batch_scaling_small_cpu.md

Every job is one process's run in sequence (Hydra's basic launcher): nothing else should run on
the machine meanwhile, and a job that ran beside other load is flagged and kept out of time figures.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from omegaconf import OmegaConf  # noqa: E402 - after the repository is on the path
from sweep_jobs import (add_jobs, design_of, keep_comparison, load_jobs, overrides_of, preregistered,  # noqa: E402
                        provenance_of, run_multirun, summaries, timed_alone, write_report)

from batch_scaling_report import Defaults, plot, report  # noqa: E402

REFERENCE_BATCH = 64  # the batch the others are held against, or the smallest measured if 64 was not
STUDIES = ("defaults", "lr", "large", "warmup", "wd", "calibration")
#: The optimizer each large-batch optimizer is compared with, at the same batch.
PARTNER = {"lamb": "adamw", "lars": "sgd"}
#: The other lr rules, tried at `LR_BATCHES`: the smallest, the middle and the largest (factors of 4),
#: and 32, where SGD's linear rule gives an lr 2.8x below sqrt's (the small-batch arms below).
LR_BATCHES = (32, 128, 512, 2048)
#: The other weight-decay rules, tried where the rules differ most from the reference batch of 256.
#: SGD's decay is 5e-5: only the linear rule moves it enough (x8 at batch 2,048) to be worth a run.
WD_ALTERNATIVES = {"adamw": ("linear", "none"), "sgd": ("linear",)}
#: 64 and 512 besides 2,048: batches where every run trains (the 2,048 runs stalled under the step
#: budget), so that the defaults kept by incumbency at 2,048 meet arms that can decide them.
WD_BATCHES = (64, 512, 2048)
#: LAMB and LARS against AdamW and SGD, and the clipping calibration left unclipped (today's default
#: clips it), where they are meant to matter.
LARGE_BATCHES = (1024, 2048)
CALIBRATION_BATCHES = (64, 512, 2048)  # 64 and 512 as for WD_BATCHES
#: Warmup off against the default, at the largest batches whose default warmup is at least
#: `WARMUP_STEPS` optimizer steps (below that, warmup is two or three steps and tests nothing).
WARMUP_ALTERNATIVES = ("0",)
WARMUP_STEPS = 10
WARMUP_BATCH_COUNT = 3
ORIGINALS = 1257  # the training digits each copy distorts (conf/data/digits_expanded.yaml)


def optimizer_defaults(name: str) -> dict[str, Any]:
    """The optimizer's own config (conf/optimizer/NAME.yaml): its rules live there, not here."""
    return dict(OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "optimizer" / f"{name}.yaml")))


DEFAULT_WARMUP = float(OmegaConf.load(REPO / "conf" / "scheduler" / "warmup_cosine.yaml").warmup)
#: Today's clipping default: the calibration steps clipped (conf/clipping/percentile.yaml).
DEFAULT_CALIBRATION = "clipped" if OmegaConf.load(REPO / "conf" / "clipping" / "percentile.yaml").clip_during_calibration \
    else "unclipped"


@dataclass(frozen=True)
class Sweep:
    """One multirun: `optimizers` x `batches` x seeds x the comma lists in `overrides`."""

    study: str
    optimizers: tuple[str, ...]
    batches: tuple[int, ...]
    overrides: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.study}-{'-'.join(self.optimizers)}_b{'-'.join(map(str, self.batches))}"


def warmup_batches(batches: list[int], copies: int, epochs: int) -> tuple[int, ...]:
    """The `WARMUP_BATCH_COUNT` largest of `batches` whose default warmup is `WARMUP_STEPS` steps or more."""
    def warmup_steps(batch: int) -> float:
        return DEFAULT_WARMUP * epochs * math.ceil(ORIGINALS * copies / batch)
    return tuple(sorted(b for b in batches if warmup_steps(b) >= WARMUP_STEPS)[-WARMUP_BATCH_COUNT:])


def plan_sweeps(studies: list[str], optimizers: list[str], batches: list[int], rules: list[str],
                copies: int, epochs: int) -> list[Sweep]:
    """Every arm is today's defaults with one thing changed (none in `defaults`), so that every
    comparison holds one change against the defaults measured in the same study."""
    planned = []
    within = lambda chosen: tuple(b for b in chosen if b in batches)  # noqa: E731 - a filter, read once
    for study in studies:
        if study == "defaults":
            planned += [Sweep("defaults", (o,), tuple(batches)) for o in optimizers]
        elif study == "lr":
            planned += [Sweep("lr", (o,), within(LR_BATCHES),
                              (f"optimizer.lr_scaling={','.join(r for r in rules if r != optimizer_defaults(o)['lr_scaling'])}",))
                        for o in optimizers]
        elif study == "warmup":
            planned += [Sweep("warmup", (o,), warmup_batches(batches, copies, epochs),
                              (f"scheduler.warmup={','.join(WARMUP_ALTERNATIVES)}",)) for o in optimizers]
        elif study == "wd":
            planned += [Sweep("wd", (o,), within(WD_BATCHES), (f"optimizer.wd_scaling={','.join(WD_ALTERNATIVES[o])}",))
                        for o in optimizers if o in WD_ALTERNATIVES]
        elif study == "large":
            partners = tuple(p for p, base in PARTNER.items() if base in optimizers)
            if partners:
                planned.append(Sweep("large", partners, within(LARGE_BATCHES)))
        elif study == "calibration":
            planned += [Sweep("calibration", (o,), within(CALIBRATION_BATCHES),
                              ("clipping.clip_during_calibration=" + ("false" if DEFAULT_CALIBRATION == "clipped" else "true"),))
                        for o in optimizers]
        else:
            raise SystemExit(f"--studies: unknown study {study!r}; allowed: {', '.join(STUDIES)}")
    return [sweep for sweep in planned if sweep.batches]


def run_sweep(sweep: Sweep, seeds: list[int], epochs: int, target: float, folder: Path, extra: list[str],
              accelerator: str) -> float:
    """Run one multirun into `folder`; its wall time in seconds."""
    return run_multirun([f"optimizer={','.join(sweep.optimizers)}", *sweep.overrides,
                         f"data.batch_size={','.join(map(str, sweep.batches))}", f"seed={','.join(map(str, seeds))}",
                         *extra, f"trainer.max_epochs={epochs}", "target.metric=val/acc", f"target.value={target}"],
                        folder, sweep.label, accelerator)


def job_of(summary: dict[str, Any]) -> dict[str, Any]:
    """One job's setting (every rule named, defaults filled in from the configs) and numbers."""
    overrides = overrides_of(summary)
    optimizer = overrides.get("optimizer", "adamw")
    defaults = optimizer_defaults(optimizer)
    target = summary.get("target") or {}
    completed = summary.get("status") == "completed"
    metrics = summary.get("metrics") or {}
    reached = bool(target.get("reached"))
    return {"optimizer": optimizer, "lr_rule": overrides.get("optimizer.lr_scaling", defaults["lr_scaling"]),
            "wd_rule": overrides.get("optimizer.wd_scaling", defaults["wd_scaling"]),
            "warmup": float(overrides.get("scheduler.warmup", DEFAULT_WARMUP)),
            "batch": int(overrides["data.batch_size"]), "seed": int(overrides.get("seed", 42)),
            "calibration": "clipped" if (summary.get("clipping") or {}).get("clip_during_calibration") else "unclipped",
            "status": summary.get("status"),
            "val_acc": metrics.get("val", {}).get("acc") if completed else None,
            "test_acc": metrics.get("test", {}).get("acc") if completed else None,
            "reached": reached, "target_s": target.get("wall_s") if reached else None,
            "target_steps": target.get("steps") if reached else None, "steps": summary.get("steps"),
            "lr": (summary.get("hyperparameters") or {}).get("lr"),
            "weight_decay": (summary.get("hyperparameters") or {}).get("weight_decay"),
            "final_loss": (summary.get("loss") or {}).get("final"), "spikes": (summary.get("loss") or {}).get("spikes")}


def read_sweep(folder: Path) -> list[dict[str, Any]]:
    jobs = []
    for summary in summaries(folder):
        try:
            jobs.append({**job_of(summary), **provenance_of(summary)})
        except KeyError:
            continue
    return jobs


#: The files a job's design is in (its rule, the study and its report), recorded in each new job.
DESIGN_FILES = ("benchmarks/batch_scaling.py", "benchmarks/batch_scaling_report.py", "trainer/measure/decision_rule.py")
KEY = ("optimizer", "lr_rule", "wd_rule", "warmup", "calibration", "batch", "seed")


def key(job: dict[str, Any]) -> tuple:
    return tuple(job[k] for k in KEY)


def todays_defaults() -> Defaults:
    """Each optimizer's rules from its config, the warmup and the calibration: what every arm but
    its one change runs with."""
    return Defaults({name: {"lr_rule": optimizer_defaults(name)["lr_scaling"], "wd_rule": optimizer_defaults(name)["wd_scaling"],
                            "warmup": DEFAULT_WARMUP, "calibration": DEFAULT_CALIBRATION}
                     for name in ("adamw", "sgd", "lamb", "lars")})


def machines(jobs: list[dict[str, Any]]) -> str:
    counts = Counter(job.get("machine", "unknown") for job in jobs)
    return ", ".join(f"{name} ({n} jobs)" for name, n in counts.items())


#: Overrides that say where a job ran or which arm it is, not the regime every job shares.
PER_JOB = ("optimizer", "data.batch_size", "seed", "optimizer.lr_scaling", "optimizer.wd_scaling", "scheduler.warmup",
           "clipping.clip_during_calibration", "run.root", "checkpointing", "progress", "trainer.accelerator")


def regime(jobs: list[dict[str, Any]]) -> str:
    """The overrides every job's command shares (the data, epochs, target): read from the jobs."""
    shared = None
    for job in jobs:
        words = {w for w in job.get("command", "").split()[2:] if "=" in w and w.split("=", 1)[0] not in PER_JOB}
        shared = words if shared is None else shared & words
    return " ".join(sorted(shared or ()))


def designs(jobs: list[dict[str, Any]]) -> str:
    """The design commits the jobs recorded, with how many jobs ran under each: '' where none did."""
    counts = Counter(f"{job['design']['commit'][:7]} of {job['design']['committed']}" for job in jobs
                     if (job.get("design") or {}).get("commit"))
    return ": " + ", ".join(f"{commit} for {n}" for commit, n in counts.items()) if counts else ""


def threads_of(jobs: list[dict[str, Any]]) -> str:
    """The compute threads the jobs recorded (`--threads`): '' where none did."""
    counts = Counter(job.get("threads", "torch's default") for job in jobs)
    if list(counts) == ["torch's default"]:
        return ""
    return "Compute threads per job: " + ", ".join(f"{t} ({n} jobs)" for t, n in counts.items()) + ". "


def header(jobs: list[dict[str, Any]], jobs_file: Path, comparisons: Path, walls: list[str]) -> list[str]:
    """What the report was written from: the jobs, their shared regime, machines and load, and the
    commands of the study that ran them."""
    studies = Counter(job.get("study_command", "not recorded") for job in jobs)
    alone = sum(1 for j in jobs if timed_alone(j))
    registered = [preregistered(j) for j in jobs]
    started = sorted(j["started"] for j in jobs if j.get("started"))
    return ["# Batch scaling: the lr and weight-decay rules, warmup, clipping and LAMB/LARS against the batch", "",
            f"Written {time.strftime('%Y-%m-%d')} from `{jobs_file.name}` alone ({len(jobs)} jobs"
            + (f", run {started[0]} to {started[-1]}" if started else "") + "). Every job: `python train.py "
            f"{regime(jobs)}` with its arm's overrides (each job's full command is in the jobs file). The regime is "
            "small: 1,257 training digits distorted into the copies above, 16 px, the default 0.29M-parameter "
            "network, the epochs above; a GPU, a larger model or more data may differ. Validation once an epoch, so the "
            "steps and time to the target are those of the first epoch end at or above it. "
            f"Machines: {machines(jobs)}; {alone} of {len(jobs)} jobs timed alone (1-minute load within the CPUs "
            "+ 0.5 at start and end); times compare only within one machine and only jobs timed alone enter them. "
            + f"Pre-registration: {registered.count(True)} of {len(jobs)} jobs ran under a design committed before they "
            f"started (`design` in each job{designs(jobs)})"
            + (f"; {registered.count(None)} predate that record (the rule of their time, trainer/measure/decision_rule.py, "
               "was committed 5 min 54 s after their first job started, with 9 jobs done). " if None in registered else ". ")
            + threads_of(jobs)
            + (f"This call's sweeps: {', '.join(walls)}. " if walls else "")
            + f"Each sweep's own comparison is in `{comparisons.name}/`.", "", "The study's commands (jobs):", "",
            *(f"- `{command}` ({n})" for command, n in studies.items()), ""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--studies", default=",".join(STUDIES), help=f"some of {', '.join(STUDIES)}")
    parser.add_argument("--optimizers", default="adamw,sgd")
    parser.add_argument("--batches", default="32,64,128,256,512,1024,2048", help="the lr study's batches")
    parser.add_argument("--rules", default="sqrt,linear,none", help="the lr rules (each optimizer's default is in `defaults`)")
    parser.add_argument("--seeds", default="1,2,3,4,5", help="as many as the decision rule's power calculation asks "
                        "(docs/practices.md, 'How a default is decided')")
    parser.add_argument("--copies", type=int, default=21, help="distortions of each training digit (42: the whole set)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.9, help="val accuracy whose time and steps are reported")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "batch_scaling_cpu.md")
    parser.add_argument("--runs", type=Path, default=None,
                        help="where the sweeps' run folders go (default: outputs/batch_scaling/DATE_TIME)")
    parser.add_argument("--collect", action="append", default=[], metavar="LABEL=FOLDER",
                        help="add the jobs of a sweep folder run earlier (its comparison kept as LABEL)")
    parser.add_argument("--study-command", default=None,
                        help="with --collect: the command that ran those sweeps, recorded with their jobs")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for every job, e.g. --set model=resnet18 (said in the report)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--quick", action="store_true", help="two batches, two rules, one seed, a tenth of the data")
    parser.add_argument("--report-only", action="store_true", help="write the report from the jobs file, training nothing")
    parser.add_argument("--threads", type=int, default=None,
                        help="each job's compute threads (OMP_NUM_THREADS, recorded in every job); default: torch's")
    args = parser.parse_args(argv)
    threads = {} if args.threads is None else {"threads": args.threads}
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by each job's torch at its start
    if args.quick:
        args.studies, args.optimizers, args.batches, args.rules, args.seeds, args.epochs, args.copies = \
            "defaults,lr", "adamw", "64,128", "sqrt,none", "1,2", 1, 2
    data = ["data=digits_expanded", f"data.copies={args.copies}", *(["data.eval_copies=1"] if args.quick else []), *args.set]
    seeds = [int(s) for s in args.seeds.split(",")]
    sweeps = [] if args.report_only else plan_sweeps(
        args.studies.split(","), args.optimizers.split(","), [int(b) for b in args.batches.split(",")],
        args.rules.split(","), args.copies, args.epochs)
    jobs_file = args.out.with_name(f"{args.out.stem}_jobs.json")
    comparisons = args.out.with_name(f"{args.out.stem}_sweeps")
    # The runs themselves stay under outputs/ (ignored by git); the jobs file and each sweep's
    # comparison.md are kept beside the results.
    runs = args.runs or REPO / "outputs" / "batch_scaling" / time.strftime("%Y-%m-%d_%H-%M-%S")
    folders = [(label, Path(folder)) for label, _, folder in (c.partition("=") for c in args.collect)]
    command = " ".join(["python benchmarks/batch_scaling.py", *(argv if argv is not None else sys.argv[1:])])
    walls, design = [], design_of(DESIGN_FILES)
    for label, folder in folders:
        ran_by = args.study_command or f"{command} (collected from {folder})"
        add_jobs(jobs_file, [{**job, "study_command": ran_by, "design": design} for job in read_sweep(folder)], key)
        keep_comparison(folder, comparisons, label)
    for sweep in sweeps:
        # Each sweep's jobs are kept as soon as it ends, so a study stopped halfway keeps what ran;
        # a sweep whose process failed keeps the jobs that wrote a summary.
        try:
            wall = run_sweep(sweep, seeds, args.epochs, args.target, runs / sweep.label, data, args.accelerator)
            walls.append(f"{sweep.label} {wall / 60:.1f} min")
        except SystemExit as failed:
            print(failed, file=sys.stderr)
            walls.append(f"{sweep.label} failed")
        add_jobs(jobs_file, [{**job, "study_command": command, "design": design, **threads} for job in read_sweep(runs / sweep.label)],
                 key)
        keep_comparison(runs / sweep.label, comparisons, sweep.label)
    jobs = load_jobs(jobs_file)
    defaults = todays_defaults()
    write_report(args.out, report(jobs, defaults, header(jobs, jobs_file, comparisons, walls)),
                 lambda path: plot(jobs, defaults, path))


if __name__ == "__main__":
    main()
