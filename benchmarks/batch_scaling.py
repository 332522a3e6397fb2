"""The evidence for the batch-scaling rules: what the lr rule, the weight-decay rule, the warmup and
the large-batch optimizers do to accuracy and to the time to an accuracy as the batch grows, over
seeds, on a data set where the batch matters.

Every study is a set of Hydra multiruns of `train.py` on `data=digits_expanded` (52,794 training
images at 16 px: 25 steps an epoch even at batch 2,048), each job training the same number of epochs
(the same samples seen) with validation every epoch and `target.metric=val/acc`:

- `lr`: the global batch x the lr rule (`optimizer.lr_scaling`: the optimizer's default, the other
  one, and none, which holds the lr at its value for the reference batch of 256) x the seed, for
  AdamW and SGD;
- `warmup`: the default rules at the largest batches without warmup;
- `wd`: the other weight-decay rules (`optimizer.wd_scaling`) at the smallest and largest batch;
- `large`: LAMB and LARS, with their own rules, at the largest batches, against AdamW and SGD there;
- `calibration`: the default rules with the clipping's calibration steps clipped (the clipping
  default since the clipping study) at batch 64 and the largest batch.

Every other study runs with the calibration unclipped (`clipping.clip_during_calibration=false`),
as all of them did before the clipping default changed: the rules are compared with nothing else
moving (at batch 1,024 and above a run is almost all calibration, so it is hardly clipped), and the
`calibration` study says what the clipping default does to them. Likewise the rules: every study but
`wd` runs AdamW's weight decay linear and every study but `lr` runs SGD's lr linear, the defaults
when the studies began (`STUDY_WD_RULES`, `STUDY_LR_RULES`); the lr and wd studies moved both
defaults to sqrt, and the other arms stay comparable with the jobs already measured.

Every job's numbers go into a jobs file (`<out>_jobs.json`, merged by setting and seed, so a study
run later adds to it), and the report is written from that file alone: the verdict lines (for each
optimizer the largest batch at which the default rule stays within the noise of batch 64, by Welch's
95% interval; where the default beats or loses to each alternative beyond the noise), one table per
study (final val accuracy mean ± sd and n, the runs that reached the target, and the time and steps
to it) and a plot. Each sweep's own `comparison.md` (every job, grouped over seeds) is copied to
`<out>_sweeps/`.

    python benchmarks/batch_scaling.py                                   # every study, about 2 h here
    python benchmarks/batch_scaling.py --studies warmup,large            # some studies, added to the jobs file
    python benchmarks/batch_scaling.py --report-only                     # the report from the jobs file
    python benchmarks/batch_scaling.py --quick --out /tmp/batch_scaling.md   # CI: outputs only, about 15 s

Every job is one process's run in sequence (Hydra's basic launcher): nothing else should run on
the machine meanwhile.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from omegaconf import OmegaConf  # noqa: E402 - after the repository is on the path
from sweep_jobs import (add_jobs, keep_comparison, load_jobs, machine_of, overrides_of, run_multirun,  # noqa: E402
                        summaries, write_report)

from trainer.infra.figures import new_figure, save_png  # noqa: E402
from trainer.measure.seed_groups import Spread, difference  # noqa: E402

REFERENCE_BATCH = 64  # the batch the others are held against, or the smallest measured if 64 was not
STUDIES = ("lr", "warmup", "wd", "large", "calibration")
#: The clipping calibration of every study but `calibration` (see the module docstring).
BASE_CALIBRATION = "unclipped"
CALIBRATION_OVERRIDE = {"unclipped": "clipping.clip_during_calibration=false",
                        "clipped": "clipping.clip_during_calibration=true"}
#: The optimizer each large-batch optimizer is compared with, at the same batch.
PARTNER = {"lamb": "adamw", "lars": "sgd"}
#: The weight-decay rules tried against each optimizer's default. SGD's decay is 5e-5: only the
#: linear rule moves it enough (x8 at batch 2,048) to be worth a run.
WD_ALTERNATIVES = {"adamw": ("sqrt", "none"), "sgd": ("linear",)}
#: The weight-decay rule every study but `wd` runs with: each optimizer's default when the studies
#: began. AdamW's default became sqrt after the wd study (docs/practices.md); its other studies stay
#: pinned to linear so that new runs remain comparable with the jobs already in the file.
STUDY_WD_RULES = {"adamw": "linear"}
#: The lr rule every study but `lr` runs with, likewise: SGD's default became sqrt after the lr study
#: had every rule at every batch (docs/practices.md); its warmup, weight-decay, calibration and LARS
#: arms ran (and run) with the linear rule they began with.
STUDY_LR_RULES = {"sgd": "linear"}
#: Warmup off, against the default (the lr study's own runs); --warmups adds others.
WARMUP_ALTERNATIVES = ("0",)


def optimizer_defaults(name: str) -> dict[str, Any]:
    """The optimizer's own config (conf/optimizer/NAME.yaml): its rules live there, not here."""
    return dict(OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "optimizer" / f"{name}.yaml")))


def base_lr_rule(optimizer: str) -> str:
    """The lr rule of every study but `lr` (`STUDY_LR_RULES`, else the optimizer's default)."""
    return STUDY_LR_RULES.get(optimizer) or optimizer_defaults(optimizer)["lr_scaling"]


def base_wd_rule(optimizer: str) -> str:
    """The weight-decay rule of every study but `wd` (`STUDY_WD_RULES`, else the optimizer's default)."""
    return STUDY_WD_RULES.get(optimizer) or optimizer_defaults(optimizer)["wd_scaling"]


DEFAULT_WARMUP = float(OmegaConf.load(REPO / "conf" / "scheduler" / "warmup_cosine.yaml").warmup)


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


def plan_sweeps(studies: list[str], optimizers: list[str], batches: list[int], rules: list[str],
                large: list[int], warmups: tuple[str, ...] = WARMUP_ALTERNATIVES,
                wd_rules: dict[str, tuple[str, ...]] | None = None) -> list[Sweep]:
    planned = []
    edges = tuple(sorted({min(batches), max(batches)}))
    for study in studies:
        if study == "calibration":
            planned += [Sweep("calibration", (o,), tuple(sorted({REFERENCE_BATCH, max(large)})),
                              (CALIBRATION_OVERRIDE["clipped"],)) for o in optimizers]
        elif study == "lr":
            planned += [Sweep("lr", (o,), tuple(batches), (f"optimizer.lr_scaling={','.join(rules)}",)) for o in optimizers]
        elif study == "warmup":
            planned += [Sweep(f"warmup-{'-'.join(warmups)}", (o,), tuple(large), (f"scheduler.warmup={','.join(warmups)}",))
                        for o in optimizers]
        elif study == "wd":
            wd = wd_rules or WD_ALTERNATIVES
            planned += [Sweep("wd", (o,), edges, (f"optimizer.wd_scaling={','.join(wd[o])}",))
                        for o in optimizers if o in wd]
        elif study == "large":
            partners = tuple(p for p, base in PARTNER.items() if base in optimizers)
            if partners:
                planned.append(Sweep("large", partners, tuple(large)))
        else:
            raise SystemExit(f"--studies: unknown study {study!r}; allowed: {', '.join(STUDIES)}")
    return [Sweep(sweep.study, sweep.optimizers, sweep.batches, (*sweep.overrides, *_pinned(sweep))) for sweep in planned]


def _pinned(sweep: Sweep) -> tuple[str, ...]:
    """What a sweep fixes to the studies' base: the calibration (but in `calibration`), the
    weight-decay rule (but in `wd`), the lr rule (but in `lr`, which names its rules)."""
    pins = () if sweep.study == "calibration" else (CALIBRATION_OVERRIDE[BASE_CALIBRATION],)
    if sweep.study != "wd" and len(sweep.optimizers) == 1 and sweep.optimizers[0] in STUDY_WD_RULES:
        pins += (f"optimizer.wd_scaling={STUDY_WD_RULES[sweep.optimizers[0]]}",)
    if sweep.study != "lr" and len(sweep.optimizers) == 1 and sweep.optimizers[0] in STUDY_LR_RULES:
        pins += (f"optimizer.lr_scaling={STUDY_LR_RULES[sweep.optimizers[0]]}",)
    return pins


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
    # A job that names no lr rule ran with its optimizer's default of the time: the studies' base.
    return {"optimizer": optimizer, "lr_rule": overrides.get("optimizer.lr_scaling", base_lr_rule(optimizer)),
            "wd_rule": overrides.get("optimizer.wd_scaling", defaults["wd_scaling"]),
            "warmup": float(overrides.get("scheduler.warmup", DEFAULT_WARMUP)),
            "batch": int(overrides["data.batch_size"]), "seed": int(overrides.get("seed", 42)),
            # summaries from before the setting existed recorded their calibration unclipped
            "calibration": "clipped" if (summary.get("clipping") or {}).get("clip_during_calibration") else "unclipped",
            "status": summary.get("status"),
            "val_acc": metrics.get("val", {}).get("acc") if completed else None,
            "test_acc": metrics.get("test", {}).get("acc") if completed else None,
            "reached": reached, "target_s": target.get("wall_s") if reached else None,
            "target_steps": target.get("steps") if reached else None, "steps": summary.get("steps"),
            "lr": (summary.get("hyperparameters") or {}).get("lr"),
            "weight_decay": (summary.get("hyperparameters") or {}).get("weight_decay")}


def read_sweep(folder: Path) -> list[dict[str, Any]]:
    jobs = []
    for summary in summaries(folder):
        try:
            jobs.append({**job_of(summary), "machine": machine_of(summary)})
        except KeyError:
            continue
    return jobs


KEY = ("optimizer", "lr_rule", "wd_rule", "warmup", "calibration", "batch", "seed")


def key(job: dict[str, Any]) -> tuple:
    return tuple(job[k] for k in KEY)


# --- the report -------------------------------------------------------------------------------


def is_default(job: dict[str, Any], *, but: str = "") -> bool:
    """The job uses the studies' base rules (each optimizer's default when the studies began), the
    default warmup and the base calibration, except for the setting named in `but`."""
    return ((but == "lr_rule" or job["lr_rule"] == base_lr_rule(job["optimizer"]))
            and (but == "wd_rule" or job["wd_rule"] == base_wd_rule(job["optimizer"]))
            and (but == "warmup" or job["warmup"] == DEFAULT_WARMUP)
            and (but == "calibration" or job["calibration"] == BASE_CALIBRATION))


def selected_jobs(jobs: list[dict[str, Any]], optimizer: str, batch: int, but: str = "",
                  value: Any = None) -> list[dict[str, Any]]:
    """The jobs of `optimizer` at `batch` with default rules and warmup, `but` set to `value`."""
    return [j for j in jobs if j["optimizer"] == optimizer and j["batch"] == batch
            and is_default(j, but=but) and (not but or j[but] == value)]


def select(jobs: list[dict[str, Any]], optimizer: str, batch: int, but: str = "", value: Any = None) -> list[float]:
    """Their final val accuracies."""
    return [j["val_acc"] for j in selected_jobs(jobs, optimizer, batch, but, value)]


def short_machine(name: str) -> str:
    """"Intel(R) Xeon(R) Processor" -> "Xeon": enough to tell the machines of one study apart."""
    words = [w for w in name.replace("(R)", "").replace("(TM)", "").split()
             if w not in ("Intel", "AMD", "Processor", "CPU", "NVIDIA")]
    return " ".join(words) or name


def row(batch: int, arm: str, runs: list[dict[str, Any]]) -> str:
    lr = runs[0]["lr"]
    reached = sum(j["reached"] for j in runs)
    machines = ", ".join(sorted({short_machine(j.get("machine", "?")) for j in runs}))
    return (f"| {batch:,} | {arm} | {lr:.3g} | {Spread.of([j['val_acc'] for j in runs]).text('{:.4f}')} | "
            f"{reached} of {len(runs)} | {Spread.of([j['target_steps'] for j in runs]).text('{:.0f}')} | "
            f"{Spread.of([j['target_s'] for j in runs]).text('{:.1f}')} | {machines} |")


#: Steps to the target first: they compare across machines; the seconds only within one.
HEADER = ["| batch | {arm} | lr | val acc (mean ± sd, n) | reached | steps to target | time to target (s) | machine |",
          "|---:|---|---:|---:|---:|---:|---:|---|"]


def lr_table(optimizer: str, jobs: list[dict[str, Any]]) -> list[str]:
    default = optimizer_defaults(optimizer)["lr_scaling"]
    mine = [j for j in jobs if j["optimizer"] == optimizer and is_default(j, but="lr_rule")]
    lines = [f"### {optimizer}: the lr rule (default: {default})", "", HEADER[0].format(arm="lr rule"), HEADER[1]]
    for batch in sorted({j["batch"] for j in mine}):
        for rule in (default, *sorted({j["lr_rule"] for j in mine} - {default})):
            runs = selected_jobs(jobs, optimizer, batch, "lr_rule", rule)
            if runs:
                lines.append(row(batch, rule + (" (default)" if rule == default else ""), runs))
    return lines


def lr_verdicts(optimizer: str, jobs: list[dict[str, Any]]) -> list[str]:
    """For the default rule, and for the studies' base rule where it differs (SGD's linear): each
    batch's difference from batch 64 under the rule, with its interval; the largest batch up to
    which every difference is within the noise (or positive); and where the rule is beyond the noise
    better or worse than the others."""
    default = optimizer_defaults(optimizer)["lr_scaling"]
    batches = sorted({j["batch"] for j in jobs if j["optimizer"] == optimizer})
    if not batches:
        return []
    lines = []
    for rule in dict.fromkeys((default, base_lr_rule(optimizer))):
        lines += _rule_verdicts(optimizer, rule, jobs, batches)
    return lines


def _rule_verdicts(optimizer: str, rule: str, jobs: list[dict[str, Any]], batches: list[int]) -> list[str]:
    base = REFERENCE_BATCH if REFERENCE_BATCH in batches else batches[0]
    reference = select(jobs, optimizer, base, "lr_rule", rule)
    lines = []
    if reference:
        shown = []
        for batch in (b for b in batches if b != base):
            found = difference(reference, select(jobs, optimizer, batch, "lr_rule", rule))
            if found is not None:
                shown.append(f"{batch:,}: {found.text('{:.4f}')}")
        holding = largest_holding(reference, jobs, optimizer, rule, [b for b in batches if b > base])
        lines.append(f"- {optimizer}, {rule} rule, val accuracy against batch {base}: " + "; ".join(shown))
        if not any(b > base for b in batches):
            lines.append(f"- {optimizer}, {rule} rule: no batch above {base} was measured")
        elif holding:
            lines.append(f"- {optimizer}, {rule} rule: within the noise of batch {base} (or above it) "
                         f"up to batch {holding:,}")
        else:
            lines.append(f"- {optimizer}, {rule} rule: beyond the noise below batch {base} from the next batch on")
    others = sorted({j["lr_rule"] for j in jobs if j["optimizer"] == optimizer and is_default(j, but="lr_rule")} - {rule})
    for other in others:
        lines.append(f"- {optimizer}, {rule} against {other}: "
                     + better_worse(jobs, optimizer, batches, "lr_rule", rule, other))
    return lines


def better_worse(jobs: list[dict[str, Any]], optimizer: str, batches: list[int], but: str, default: Any,
                 other: Any) -> str:
    better, worse, measured = [], [], 0
    for batch in batches:
        found = difference(select(jobs, optimizer, batch, but, other), select(jobs, optimizer, batch, but, default))
        if found is None:
            continue
        measured += 1
        if found.within_noise is False:
            (better if found.value > 0 else worse).append(f"{batch:,} ({found.value:+.4f})")
    if not measured:
        return "not measured"
    return (f"beyond the noise better at {', '.join(better) or 'no batch'}; worse at {', '.join(worse) or 'no batch'}; "
            "within it elsewhere")


def largest_holding(reference: list[float], jobs: list[dict[str, Any]], optimizer: str, rule: str,
                    batches: list[int]) -> int | None:
    """The largest of `batches` (those above the reference, in order) such that at it and every one
    before it, the difference from the reference is within the noise or positive."""
    largest = None
    for batch in batches:
        found = difference(reference, select(jobs, optimizer, batch, "lr_rule", rule))
        if found is None or (found.within_noise is False and found.value < 0):
            break
        largest = batch
    return largest


def base_of(but: str, optimizer: str) -> Any:
    """What a variant of `but` is held against: the default warmup or wd rule, the study's calibration."""
    if but == "warmup":
        return DEFAULT_WARMUP
    return BASE_CALIBRATION if but == "calibration" else base_wd_rule(optimizer)


def base_name(but: str, optimizer: str) -> str:
    """What the base of a variant is: the default, or the other studies' setting where it is not."""
    if but == "calibration" or (but == "wd_rule" and base_wd_rule(optimizer) != optimizer_defaults(optimizer)["wd_scaling"]):
        return "the other studies' runs"
    return "the default"


def variant_section(title: str, but: str, jobs: list[dict[str, Any]], optimizers: list[str],
                    name: callable) -> tuple[list[str], list[str]]:
    """The table and verdicts of one setting (`but`: warmup, wd_rule or calibration) changed from its
    base, at the batches where it was changed, each against the base there."""
    table, verdicts = [f"### {title}", "", HEADER[0].format(arm="setting"), HEADER[1]], []
    for optimizer in optimizers:
        default = base_of(but, optimizer)
        base = base_name(but, optimizer)
        others = sorted({j[but] for j in jobs if j["optimizer"] == optimizer and is_default(j, but=but)} - {default})
        batches = sorted({j["batch"] for j in jobs if j["optimizer"] == optimizer and j[but] in others})
        for batch in batches:
            for value in (default, *others):
                runs = selected_jobs(jobs, optimizer, batch, but, value)
                if runs:
                    label = f" ({base.removeprefix('the ')})" if value == default else ""
                    table.append(row(batch, f"{optimizer}, {name(value)}{label}", runs))
        for value in others:
            verdicts.append(f"- {optimizer}, {name(value)} against {name(default)} ({base}), val accuracy: "
                            + differences(jobs, optimizer, batches, but, default, value))
    return table, verdicts


def differences(jobs: list[dict[str, Any]], optimizer: str, batches: list[int], but: str, default: Any,
                other: Any) -> str:
    """`other`'s mean minus the default's at each batch where both ran, with the interval."""
    shown = []
    for batch in batches:
        found = difference(select(jobs, optimizer, batch, but, default), select(jobs, optimizer, batch, but, other))
        if found is not None:
            shown.append(f"{batch:,}: {found.text('{:.4f}')}")
    return "; ".join(shown) or "not measured"


def large_section(jobs: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    table, verdicts = ["### LAMB and LARS against AdamW and SGD (the studies' base rules)", "",
                       HEADER[0].format(arm="optimizer"), HEADER[1]], []
    for optimizer, partner in PARTNER.items():
        batches = sorted({j["batch"] for j in jobs if j["optimizer"] == optimizer})
        shown = []
        for batch in batches:
            for name in (partner, optimizer):
                runs = selected_jobs(jobs, name, batch)
                if runs:
                    table.append(row(batch, f"{name} ({base_lr_rule(name)})", runs))
            found = difference(select(jobs, partner, batch), select(jobs, optimizer, batch))
            if found is not None:
                shown.append(f"{batch:,}: {found.text('{:.4f}')}")
        if shown:
            verdicts.append(f"- {optimizer} against {partner} ({base_lr_rule(partner)} rule), val accuracy: "
                            + "; ".join(shown))
    return table, verdicts


def report(jobs: list[dict[str, Any]], header: list[str]) -> list[str]:
    optimizers = [o for o in ("adamw", "sgd") if any(j["optimizer"] == o for j in jobs)]
    verdicts, tables = [], []
    for optimizer in optimizers:
        verdicts += lr_verdicts(optimizer, jobs)
        tables += lr_table(optimizer, jobs) + [""]
    for title, but, name in (
            ("Warmup at the largest batches (fraction of all steps)", "warmup", lambda v: f"warmup {v:g}"),
            ("The weight-decay rule", "wd_rule", lambda v: f"wd {v}"),
            ("The clipping calibration: clipped (the clipping default) against unclipped (every other study)",
             "calibration", lambda v: f"calibration {v}")):
        table, found = variant_section(title, but, jobs, optimizers, name)
        if found:
            tables += table + [""]
            verdicts += found
    table, found = large_section(jobs)
    if found:
        tables += table + [""]
        verdicts += found
    return header + ["## Verdicts", "", *verdicts, "", "## Tables", "", *tables]


def plot(jobs: list[dict[str, Any]], path: Path) -> None:
    """Final val accuracy and steps to the target against the batch, mean ± sd over seeds: one panel
    per optimizer, a line per lr rule, and the warmup, weight-decay and large-batch optimizer arms
    dashed on their base optimizer's panel."""
    optimizers = [o for o in ("adamw", "sgd") if any(j["optimizer"] == o for j in jobs)]
    figure = new_figure(figsize=(6.5 * max(len(optimizers), 1), 8), layout="constrained")
    axes = figure.subplots(2, max(len(optimizers), 1), squeeze=False)
    for column, optimizer in enumerate(optimizers):
        series = {}
        for job in jobs:
            if job["optimizer"] == optimizer and is_default(job, but="lr_rule"):
                default = job["lr_rule"] == optimizer_defaults(optimizer)["lr_scaling"]
                series.setdefault((job["lr_rule"] + (" (default)" if default else ""), "-"), []).append(job)
            elif job["optimizer"] == optimizer and not is_default(job, but="lr_rule"):
                changed = (f"wd {job['wd_rule']}" if job["wd_rule"] != base_wd_rule(optimizer)
                           else f"calibration {job['calibration']}" if job["calibration"] != BASE_CALIBRATION
                           else f"warmup {job['warmup']:g}")
                series.setdefault((changed, "--"), []).append(job)
            elif PARTNER.get(job["optimizer"]) == optimizer and is_default(job):
                series.setdefault((job["optimizer"], "--"), []).append(job)
        for row_index, (measure, label) in enumerate((("val_acc", "final val accuracy"),
                                                      ("target_steps", "steps to target"))):
            ax = axes[row_index][column]
            for (name, style), members in sorted(series.items()):
                batches = sorted({j["batch"] for j in members})
                points = [(b, Spread.of([j[measure] for j in members if j["batch"] == b])) for b in batches]
                points = [(b, s) for b, s in points if s.mean is not None]
                if points:
                    ax.errorbar([b for b, _ in points], [s.mean for _, s in points], yerr=[s.sd or 0 for _, s in points],
                                marker="o", capsize=3, linestyle=style, label=name)
            ax.set_xscale("log", base=2)
            if measure == "target_steps":
                ax.set_yscale("log")
            ax.set(xlabel="global batch", ylabel=label, title=f"{optimizer}: {label}, mean ± sd over seeds")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
    save_png(figure, path)


def machines(jobs: list[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for job in jobs:
        counts[job.get("machine", "unknown")] = counts.get(job.get("machine", "unknown"), 0) + 1
    return ", ".join(f"{name} ({n} jobs)" for name, n in counts.items())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--studies", default=",".join(STUDIES), help=f"some of {', '.join(STUDIES)}")
    parser.add_argument("--optimizers", default="adamw,sgd")
    parser.add_argument("--batches", default="32,64,128,256,512,1024,2048", help="the lr study's batches")
    parser.add_argument("--large", default="1024,2048", help="the batches of the warmup and large-optimizer studies")
    parser.add_argument("--rules", default="sqrt,linear,none")
    parser.add_argument("--warmups", default=",".join(WARMUP_ALTERNATIVES),
                        help="the warmup study's fractions, against the default")
    parser.add_argument("--wd-rules", default=None,
                        help="the wd study's rules for every optimizer, e.g. sqrt (default: the alternatives to each "
                             "optimizer's own rule)")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.9, help="val accuracy whose time and steps are reported")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "batch_scaling_cpu.md")
    parser.add_argument("--runs", type=Path, default=None,
                        help="where the sweeps' run folders go (default: outputs/batch_scaling/DATE_TIME)")
    parser.add_argument("--collect", action="append", default=[], metavar="LABEL=FOLDER",
                        help="add the jobs of a sweep folder run earlier (its comparison kept as LABEL)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for every job, e.g. --set model=resnet18 (said in the report)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--quick", action="store_true", help="two batches, two rules, one seed, a tenth of the data")
    parser.add_argument("--report-only", action="store_true", help="write the report from the jobs file, training nothing")
    args = parser.parse_args(argv)
    data = ["data=digits_expanded", *args.set]
    if args.quick:
        args.studies, args.optimizers, args.batches, args.rules, args.seeds, args.epochs = \
            "lr", "adamw", "64,128", "sqrt,none", "1", 1
        data += ["data.copies=2", "data.eval_copies=1"]
    seeds = [int(s) for s in args.seeds.split(",")]
    sweeps = [] if args.report_only else plan_sweeps(
        args.studies.split(","), args.optimizers.split(","), [int(b) for b in args.batches.split(",")],
        args.rules.split(","), [int(b) for b in args.large.split(",")], tuple(args.warmups.split(",")),
        {o: tuple(args.wd_rules.split(",")) for o in args.optimizers.split(",")} if args.wd_rules else None)
    jobs_file = args.out.with_name(f"{args.out.stem}_jobs.json")
    comparisons = args.out.with_name(f"{args.out.stem}_sweeps")
    # The runs themselves stay under outputs/ (ignored by git); the jobs file and each sweep's
    # comparison.md are kept beside the results.
    runs = args.runs or REPO / "outputs" / "batch_scaling" / time.strftime("%Y-%m-%d_%H-%M-%S")
    folders = [(label, Path(folder)) for label, _, folder in (c.partition("=") for c in args.collect)]
    walls = []
    for sweep in sweeps:
        wall = run_sweep(sweep, seeds, args.epochs, args.target, runs / sweep.label, data, args.accelerator)
        walls.append(f"{sweep.label} {wall / 60:.1f} min")
        folders.append((sweep.label, runs / sweep.label))
    for label, folder in folders:
        add_jobs(jobs_file, read_sweep(folder), key)
        keep_comparison(folder, comparisons, label)
    jobs = load_jobs(jobs_file)
    command = " ".join(["python benchmarks/batch_scaling.py", *(argv if argv is not None else sys.argv[1:])])
    header = ["# Batch scaling: the lr and weight-decay rules, warmup and LAMB/LARS against the batch", "",
              f"Written {time.strftime('%Y-%m-%d')} from {jobs_file.name} ({len(jobs)} jobs): "
              f"`data=digits_expanded` ({'a tenth of it, --quick' if args.quick else '52,794 training images'}), "
              f"{'`' + ' '.join(args.set) + '`' if args.set else 'the default network, 16 px'}, "
              f"{args.epochs} epoch(s) at every batch, target val acc {args.target}, "
              "validation once an epoch (so the time and steps to the target are those of the first epoch end at "
              "or above it). Differences are Welch's 95% intervals over the seeds; within the noise where the "
              "interval holds 0. "
              + f"Machines: {machines(jobs)}; times compare only within one machine. "
              + (f"This call's sweeps: {', '.join(walls)}. " if walls else "")
              + f"Each sweep's own comparison is in `{comparisons.name}/`.", "", f"`{command}`", ""]
    lines = report(jobs, header)
    write_report(args.out, lines, lambda path: plot(jobs, path))


if __name__ == "__main__":
    main()
