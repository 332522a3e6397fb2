"""The batch-scaling study's report, written from its jobs file alone by the decision rule of
docs/practices.md ("How a default is decided", trainer/measure/decision_rule.py).

Every arm is today's defaults with at most one thing changed. The comparisons fall into families,
each corrected by Holm's procedure on its own:

- per optimizer, **its batch limit**: the defaults at each batch against batch 64;
- per optimizer, **each alternative setting** (the lr rules, the weight-decay rules, warmup off, the
  calibration unclipped): against the defaults at the same batch, every batch it ran at;
- **LAMB against AdamW, LARS against SGD**, at the batches both ran.

The primary measure is the final val accuracy; test accuracy is shown beside it with its own
correction (a second look, not a second vote). What the rule concludes (`findings`) is what the
start-up warnings quote (trainer/groups/optimizer/scaling.py, checked by tests/unit/test_scaling.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from sweep_jobs import timed_alone

from trainer.infra.figures import new_figure, save_png
from trainer.measure.decision_rule import (ALPHA, MARGIN, POWER, Comparison, compare, correct, detectable_drop,
                                           pooled_sd, seeds_for)
from trainer.measure.seed_groups import Spread

REFERENCE_BATCH = 64
PARTNER = {"lamb": "adamw", "lars": "sgd"}
#: The spread the seeds were sized on, before these runs: the within-arm sd of val accuracy pooled
#: over the previous study's arms at batches 32 to 1,024 (its jobs file, commit 2a22e87).
PILOT_SD = 0.0031
#: The largest family a seed count must serve: six batches against batch 64 (or an alternative's
#: two rules at three batches).
PLANNED_FAMILY = 6
#: A run below this val accuracy after training has diverged, whatever its loss (chance is 0.1).
DIVERGED_BELOW = 0.5
#: What an alternative setting is called in the report, by the job field it changes.
CHANGES = {"lr_rule": "lr rule", "wd_rule": "weight-decay rule", "warmup": "warmup",
           "calibration": "clipping calibration"}


@dataclass(frozen=True)
class Defaults:
    """Each optimizer's settings today: its lr and weight-decay rules, the warmup and calibration."""

    rules: dict[str, dict[str, Any]]

    def of(self, optimizer: str) -> dict[str, Any]:
        return self.rules[optimizer]


def arm(jobs: list[dict[str, Any]], defaults: Defaults, optimizer: str, batch: int | None,
        **changed: Any) -> list[dict[str, Any]]:
    """The jobs of `optimizer` at `batch` (None: at any) with today's defaults, except what
    `changed` sets."""
    wanted = {**defaults.of(optimizer), **changed}
    return [j for j in jobs if j["optimizer"] == optimizer and batch in (None, j["batch"])
            and all(j[k] == v for k, v in wanted.items())]


def diverged(job: dict[str, Any]) -> bool:
    """Stopped (the non-finite guard, or any failure), a non-finite final loss, or under DIVERGED_BELOW
    (a run that never trained, as the shortest runs at the largest batches, is counted so too)."""
    loss = job.get("final_loss")
    return (job.get("status") != "completed" or loss is None or not math.isfinite(loss)
            or job.get("val_acc") is None or job["val_acc"] < DIVERGED_BELOW)


def accuracies(runs: list[dict[str, Any]], measure: str = "val_acc") -> list[float | None]:
    """The arm's accuracies; a diverged run counts at chance (0.1) rather than disappearing."""
    return [0.1 if diverged(j) else j[measure] for j in runs]


@dataclass
class Family:
    """Comparisons decided together (Holm within the family)."""

    name: str
    optimizer: str
    #: "limit" (batches against batch 64), a field of `CHANGES` (an alternative setting), or "partner".
    kind: str
    comparisons: list[Comparison] = field(default_factory=list)
    #: Where each comparison was made: (batch, the other arm's value of the changed field).
    where: list[tuple[int, Any]] = field(default_factory=list)

    def add(self, found: Comparison | None, batch: int, value: Any = None) -> None:
        if found is not None:
            self.comparisons.append(found)
            self.where.append((batch, value))

    def corrected(self) -> Family:
        return Family(self.name, self.optimizer, self.kind, correct(self.comparisons), list(self.where))


def limit_family(jobs: list[dict[str, Any]], defaults: Defaults, optimizer: str, measure: str) -> Family:
    family = Family(f"{optimizer}: the defaults at each batch against batch {REFERENCE_BATCH}", optimizer, "limit")
    reference = accuracies(arm(jobs, defaults, optimizer, REFERENCE_BATCH), measure)
    for batch in sorted({j["batch"] for j in jobs if j["optimizer"] == optimizer} - {REFERENCE_BATCH}):
        runs = arm(jobs, defaults, optimizer, batch)
        if runs:
            family.add(compare(f"{batch:,}", reference, accuracies(runs, measure)), batch)
    return family.corrected()


def alternative_family(jobs: list[dict[str, Any]], defaults: Defaults, optimizer: str, changed: str,
                       measure: str) -> Family:
    default = defaults.of(optimizer)[changed]
    family = Family(f"{optimizer}: the {CHANGES[changed]} against its default ({_value(changed, default)})",
                    optimizer, changed)
    others = sorted({j[changed] for j in jobs if j["optimizer"] == optimizer} - {default}, key=str)
    for value in others:
        for batch in sorted({j["batch"] for j in arm(jobs, defaults, optimizer, None, **{changed: value})}):
            family.add(compare(f"{_value(changed, value)} at {batch:,}",
                               accuracies(arm(jobs, defaults, optimizer, batch), measure),
                               accuracies(arm(jobs, defaults, optimizer, batch, **{changed: value}), measure)),
                       batch, value)
    return family.corrected()


def partner_family(jobs: list[dict[str, Any]], defaults: Defaults, optimizer: str, measure: str) -> Family:
    partner = PARTNER[optimizer]
    family = Family(f"{optimizer} against {partner}, both with their defaults", optimizer, "partner")
    for batch in sorted({j["batch"] for j in jobs if j["optimizer"] == optimizer}):
        family.add(compare(f"{batch:,}", accuracies(arm(jobs, defaults, partner, batch), measure),
                           accuracies(arm(jobs, defaults, optimizer, batch), measure)), batch, optimizer)
    return family.corrected()


def _value(changed: str, value: Any) -> str:
    return f"warmup {value:g}" if changed == "warmup" else str(value)


def families(jobs: list[dict[str, Any]], defaults: Defaults, measure: str = "val_acc") -> list[Family]:
    found = []
    for optimizer in (o for o in ("adamw", "sgd") if any(j["optimizer"] == o for j in jobs)):
        found.append(limit_family(jobs, defaults, optimizer, measure))
        for changed in CHANGES:
            if any(j[changed] != defaults.of(optimizer)[changed] for j in jobs if j["optimizer"] == optimizer):
                found.append(alternative_family(jobs, defaults, optimizer, changed, measure))
    for optimizer in (o for o in PARTNER if any(j["optimizer"] == o for j in jobs)):
        found.append(partner_family(jobs, defaults, optimizer, measure))
    return [f for f in found if f.comparisons]


# --- what the rule concludes ----------------------------------------------------------------


@dataclass(frozen=True)
class Limit:
    """The largest batch from 64 up to which the defaults are not called worse than batch 64 and no
    run diverged; the next batch measured and its difference (None where the whole range held)."""

    optimizer: str
    holds_to: int
    next_batch: int | None
    lost: float | None


def limit_of(family: Family, jobs: list[dict[str, Any]], defaults: Defaults, optimizer: str) -> Limit:
    holds_to = REFERENCE_BATCH
    for found, (batch, _) in sorted(zip(family.comparisons, family.where), key=lambda pair: pair[1][0]):
        if batch < REFERENCE_BATCH:
            continue
        if found.verdict == "worse" or any(diverged(j) for j in arm(jobs, defaults, optimizer, batch)):
            return Limit(optimizer, holds_to, batch, -found.value)
        holds_to = batch
    return Limit(optimizer, holds_to, None, None)


def decision(family: Family) -> dict[Any, str]:
    """For each alternative value of a family: "changes the default" where it is called better at a
    batch and worse at none, else "keeps the default" (with where it was better or worse)."""
    outcome: dict[Any, str] = {}
    for value in dict.fromkeys(v for _, v in family.where):
        found = [(c, b) for c, (b, v) in zip(family.comparisons, family.where) if v == value]
        better = [f"{b:,} ({c.value:+.4f})" for c, b in found if c.verdict == "better"]
        worse = [f"{b:,} ({c.value:+.4f})" for c, b in found if c.verdict == "worse"]
        if better and not worse:
            outcome[value] = f"**changes the default**: better at {', '.join(better)}, worse nowhere"
        else:
            outcome[value] = ("keeps the default: " + (f"better at {', '.join(better)}; " if better else "")
                              + (f"worse at {', '.join(worse)}" if worse else "called worse nowhere")
                              + ("" if better else ", better nowhere"))
    return outcome


def findings(jobs: list[dict[str, Any]], defaults: Defaults, primary: list[Family] | None = None) -> dict[str, Any]:
    """The limits of each optimizer's defaults and where LAMB or LARS did better, by the rule
    (from `primary`, the val-accuracy families, where they are at hand)."""
    limits, alternatives = {}, {}
    for family in families(jobs, defaults) if primary is None else primary:
        optimizer = family.optimizer
        if family.kind == "limit":
            limits[optimizer] = limit_of(family, jobs, defaults, optimizer)
        elif family.kind == "partner":
            better = [(b, c) for c, (b, _) in zip(family.comparisons, family.where) if c.verdict == "better"]
            if better:
                batch, found = better[0]
                alternatives[PARTNER[optimizer]] = {
                    "optimizer": optimizer, "batch": batch, "by": found.value,
                    "accuracy": Spread.of(accuracies(arm(jobs, defaults, optimizer, batch))).mean,
                    "default_accuracy": Spread.of(accuracies(arm(jobs, defaults, PARTNER[optimizer], batch))).mean}
    return {"limits": limits, "alternatives": alternatives}


# --- the text ----------------------------------------------------------------------------------


def power_section(jobs: list[dict[str, Any]], defaults: Defaults) -> list[str]:
    arms: dict[tuple, list[dict[str, Any]]] = {}
    for job in jobs:
        arms.setdefault(tuple(job[k] for k in ("optimizer", "lr_rule", "wd_rule", "warmup", "calibration", "batch")),
                        []).append(job)
    planned = seeds_for(PILOT_SD, PLANNED_FAMILY)
    lines = ["## The decision rule and its power", "",
             f"Fixed before the runs (docs/practices.md, \"How a default is decided\"): a difference is called where "
             f"its Holm-adjusted p-value (Welch's test) is below {ALPHA} within its family; the seeds are the fewest that "
             f"catch a drop of {MARGIN} with probability {POWER:.0%} at the strictest Holm level of a family of "
             f"{PLANNED_FAMILY} ({ALPHA}/{PLANNED_FAMILY}), on the pilot spread sd {PILOT_SD}: **{planned} seeds**. "
             f"A run that diverged or never trained (stopped, a non-finite loss, or val acc under {DIVERGED_BELOW}) counts "
             "at chance (0.1) in its arm and ends a batch limit; arms without any spread are not decided."]
    seeds = sorted({len(runs) for runs in arms.values()})
    if not seeds:
        return lines
    lines += ["", f"Seeds an arm: {', '.join(map(str, seeds))}. The within-arm sd measured here (runs that trained), "
              f"pooled, and the drop that {min(seeds)} seeds an arm catch with probability {POWER:.0%} in a family of "
              f"{PLANNED_FAMILY}:", "", "| batches | arms | pooled sd | drop caught |", "|---|---:|---:|---:|"]
    for name, chosen in (("every batch", lambda b: True), ("up to 512", lambda b: b <= 512),
                         ("1,024", lambda b: b == 1024), ("2,048", lambda b: b == 2048)):
        groups = [[j["val_acc"] for j in runs if not diverged(j)] for key, runs in arms.items() if chosen(key[-1])]
        measured = pooled_sd(groups)
        if measured is not None:
            drop = detectable_drop(min(seeds), measured, PLANNED_FAMILY)
            lines.append(f"| {name} | {len(groups)} | {measured:.4f} | {drop:.4f}"
                         + (" (the planned power holds)" if drop <= MARGIN else " (short of the planned power)") + " |")
    return lines


def family_lines(family: Family, secondary: Family | None) -> list[str]:
    lines = [f"- **{family.name}** (m={sum(c.p is not None for c in family.comparisons)}): "
             + "; ".join(f"{c.label}: {c.text()}" for c in family.comparisons)]
    if secondary is not None:
        lines.append("  - test accuracy, a second look: "
                     + "; ".join(f"{c.label}: {c.value:+.4f} {c.verdict}" for c in secondary.comparisons))
    return lines


def verdicts(jobs: list[dict[str, Any]], defaults: Defaults) -> list[str]:
    primary, secondary = families(jobs, defaults), {f.name: f for f in families(jobs, defaults, "test_acc")}
    found = findings(jobs, defaults, primary)
    lines = ["## Verdicts", ""]
    for limit in found["limits"].values():
        beyond = (f"; at {limit.next_batch:,} it lost {limit.lost:.4f} against batch {REFERENCE_BATCH} "
                  "(worse beyond the noise, or a run diverged)" if limit.next_batch else "; held over the whole range")
        lines.append(f"- **{limit.optimizer}, today's defaults hold to batch {limit.holds_to:,}**{beyond}")
    for family in primary:
        if family.kind in CHANGES:
            for value, outcome in decision(family).items():
                lines.append(f"- {family.optimizer}, {CHANGES[family.kind]} {_value(family.kind, value)}: {outcome}")
    for optimizer, alternative in found["alternatives"].items():
        lines.append(f"- {alternative['optimizer']} is better than {optimizer} at {alternative['batch']:,} "
                     f"({alternative['by']:+.4f})")
    lines += ["", "### Every comparison, by family (val accuracy; Welch's 95% interval, raw and Holm-adjusted p)", ""]
    for family in primary:
        lines += family_lines(family, secondary.get(family.name))
    return lines


def arm_row(batch: int, name: str, runs: list[dict[str, Any]]) -> str:
    alone = [j for j in runs if timed_alone(j)]
    failed = sum(diverged(j) for j in runs)
    spikes = sum(1 for j in runs if (j.get("spikes") or 0) > 0)
    fine = [j for j in runs if not diverged(j)]
    return (f"| {batch:,} | {name} | {runs[0]['lr']:.3g} | {runs[0]['weight_decay']:.3g} | "
            f"{Spread.of([j['val_acc'] for j in fine]).text('{:.4f}')} | {Spread.of([j['test_acc'] for j in fine]).text('{:.4f}')} | "
            f"{failed} of {len(runs)} | {spikes} | {sum(j['reached'] for j in runs)} of {len(runs)} | "
            f"{Spread.of([j['target_steps'] for j in runs]).text('{:.0f}')} | "
            f"{Spread.of([j['target_s'] for j in alone]).text('{:.1f}')} ({len(alone)} timed alone) |")


TABLE_HEADER = ["| batch | arm | lr | weight decay | val acc (mean ± sd, n) | test acc | diverged | runs with a loss spike "
                "| reached target | steps to target | time to target (s) |",
                "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]


def tables(jobs: list[dict[str, Any]], defaults: Defaults) -> list[str]:
    lines = ["## Tables", "", "Accuracies over the runs that did not diverge (the diverged column counts the others); "
             "times only from runs timed alone (no other load on the machine).", ""]
    for optimizer in (o for o in ("adamw", "sgd", "lamb", "lars") if any(j["optimizer"] == o for j in jobs)):
        rules = defaults.of(optimizer)
        lines += [f"### {optimizer} (defaults: lr {rules['lr_rule']}, weight decay {rules['wd_rule']}, "
                  f"warmup {rules['warmup']:g}, calibration {rules['calibration']})", "", *TABLE_HEADER]
        mine = [j for j in jobs if j["optimizer"] == optimizer]
        for batch in sorted({j["batch"] for j in mine}):
            runs = arm(jobs, defaults, optimizer, batch)
            if runs:
                lines.append(arm_row(batch, "defaults", runs))
            for changed in CHANGES:
                for value in sorted({j[changed] for j in mine if j["batch"] == batch} - {rules[changed]}, key=str):
                    runs = arm(jobs, defaults, optimizer, batch, **{changed: value})
                    if runs:
                        lines.append(arm_row(batch, f"{CHANGES[changed]} {_value(changed, value)}", runs))
        lines.append("")
    return lines


def report(jobs: list[dict[str, Any]], defaults: Defaults, header: list[str]) -> list[str]:
    return [*header, *power_section(jobs, defaults), "", *verdicts(jobs, defaults), "", *tables(jobs, defaults)]


def plot(jobs: list[dict[str, Any]], defaults: Defaults, path: Path) -> None:
    """Final val accuracy against the batch, mean ± sd over the runs that did not diverge: a panel
    per optimizer, the defaults solid, each changed setting and the large-batch partner dashed."""
    optimizers = [o for o in ("adamw", "sgd") if any(j["optimizer"] == o for j in jobs)]
    figure = new_figure(figsize=(6.5 * max(len(optimizers), 1), 4.5), layout="constrained")
    axes = figure.subplots(1, max(len(optimizers), 1), squeeze=False)[0]
    for ax, optimizer in zip(axes, optimizers):
        series: dict[tuple[str, str], Callable[[int], list[dict[str, Any]]]] = {
            ("defaults", "-"): lambda b, o=optimizer: arm(jobs, defaults, o, b)}
        for changed in CHANGES:
            for value in sorted({j[changed] for j in jobs if j["optimizer"] == optimizer} - {defaults.of(optimizer)[changed]}, key=str):
                series[(f"{CHANGES[changed]} {_value(changed, value)}", "--")] = \
                    lambda b, o=optimizer, c=changed, v=value: arm(jobs, defaults, o, b, **{c: v})
        for partner, base in PARTNER.items():
            if base == optimizer:
                series[(partner, ":")] = lambda b, p=partner: arm(jobs, defaults, p, b)
        for (name, style), runs_at in series.items():
            points = [(b, Spread.of([j["val_acc"] for j in runs_at(b) if not diverged(j)]))
                      for b in sorted({j["batch"] for j in jobs})]
            points = [(b, s) for b, s in points if s.mean is not None]
            if points:
                ax.errorbar([b for b, _ in points], [s.mean for _, s in points], yerr=[s.sd or 0 for _, s in points],
                            marker="o", capsize=3, linestyle=style, label=name)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="global batch", ylabel="final val accuracy", title=f"{optimizer}: mean ± sd over seeds")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    save_png(figure, path)
