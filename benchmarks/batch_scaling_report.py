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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from sweep_jobs import timed_alone

from trainer.infra.figures import new_figure, save_png
from trainer.measure.decision_rule import (ALPHA, MARGIN, POWER, Comparison, compare, correct, detectable_drop,
                                           holds_in_sequence, outcome, seeds_for, spread_used, swapped)
from trainer.measure.seed_groups import Spread

REFERENCE_BATCH = 64
PARTNER = {"lamb": "adamw", "lars": "sgd"}
#: The spread the seeds were sized on, before these runs: the within-arm sd of val accuracy pooled
#: over the previous study's arms at batches 32 to 1,024 (its jobs file, commit 2a22e87).
PILOT_SD = 0.0031
#: The largest family a seed count must serve: six batches against batch 64 (or an alternative's
#: two rules at three batches).
PLANNED_FAMILY = 6
#: A run that ended under this val accuracy is counted as stalled in the tables (a description: its
#: measured value enters the test; only a run that measured nothing failed).
STALLED_BELOW = 0.5
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


def outcomes(runs: list[dict[str, Any]], measure: str = "val_acc") -> dict[int, float | None]:
    """Each seed's outcome by the rule (trainer/measure/decision_rule.py): its measured accuracy,
    None where the run failed (measured nothing). A run that trained little is measured, not failed."""
    return {j["seed"]: outcome(j.get("status"), j.get(measure), j.get("final_loss")) for j in runs}


def failed(job: dict[str, Any]) -> bool:
    return outcome(job.get("status"), job.get("val_acc"), job.get("final_loss")) is None


def stalled(job: dict[str, Any]) -> bool:
    """Ended under `STALLED_BELOW` (a description in the tables, not a failure)."""
    return not failed(job) and job["val_acc"] < STALLED_BELOW


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
    reference = outcomes(arm(jobs, defaults, optimizer, REFERENCE_BATCH), measure)
    for batch in sorted({j["batch"] for j in jobs if j["optimizer"] == optimizer} - {REFERENCE_BATCH}):
        runs = arm(jobs, defaults, optimizer, batch)
        if runs:
            family.add(compare(f"{batch:,}", reference, outcomes(runs, measure)), batch)
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
                               outcomes(arm(jobs, defaults, optimizer, batch), measure),
                               outcomes(arm(jobs, defaults, optimizer, batch, **{changed: value}), measure)),
                       batch, value)
    return family.corrected()


def partner_family(jobs: list[dict[str, Any]], defaults: Defaults, optimizer: str, measure: str) -> Family:
    partner = PARTNER[optimizer]
    family = Family(f"{optimizer} against {partner}, both with their defaults", optimizer, "partner")
    for batch in sorted({j["batch"] for j in jobs if j["optimizer"] == optimizer}):
        family.add(compare(f"{batch:,}", outcomes(arm(jobs, defaults, partner, batch), measure),
                           outcomes(arm(jobs, defaults, optimizer, batch), measure)), batch, optimizer)
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
    """The largest batch from 64 up to which the defaults hold (non-inferior to batch 64 within one
    point, no more failures), by the fixed sequence 128, 256, ... ; the first batch that did not
    hold, its difference and why (None where the whole range held)."""

    optimizer: str
    holds_to: int
    next_batch: int | None
    lost: float | None
    why: str = ""
    #: The optimizer steps the runs at `next_batch` made (the same epochs are fewer steps there).
    steps: int | None = None


def limit_of(family: Family, jobs: list[dict[str, Any]], defaults: Defaults, optimizer: str) -> Limit:
    """The fixed-sequence procedure on the batches above 64, in increasing order (fixed before the
    runs: a larger batch is never expected to hold where a smaller one did not)."""
    sequence = sorted(((b, c) for c, (b, _) in zip(family.comparisons, family.where) if b > REFERENCE_BATCH),
                      key=lambda pair: pair[0])
    held = holds_in_sequence([c for _, c in sequence])
    holds_to = sequence[held - 1][0] if held else REFERENCE_BATCH
    if held == len(sequence):
        return Limit(optimizer, holds_to, None, None)
    batch, found = sequence[held]
    why = ("fails more often" if found.p_fails < ALPHA else
           "not shown to hold within one point" + (", and worse" if found.verdict == "worse" else ""))
    steps = [j["steps"] for j in arm(jobs, defaults, optimizer, batch) if j.get("steps")]
    return Limit(optimizer, holds_to, batch, -found.value, why, max(steps) if steps else None)


def standing(family: Family) -> Family:
    """The alternatives' family read from the default's side (the default against each alternative,
    Holm-corrected): where the default *holds* against an alternative, it is kept by the evidence."""
    return Family(family.name, family.optimizer, family.kind, correct([swapped(c) for c in family.comparisons]),
                  list(family.where))


def decision(family: Family) -> dict[Any, str]:
    """For each alternative value of a family: "changes the default" where it is called better at a
    batch and worse at none; else the default stays, "by the evidence" where it holds against the
    alternative at every batch, "by incumbency" where it does not."""
    outcome: dict[Any, str] = {}
    held = standing(family)
    for value in dict.fromkeys(v for _, v in family.where):
        found = [(c, b, d) for c, (b, v), d in zip(family.comparisons, family.where, held.comparisons) if v == value]
        better = [f"{b:,} ({c.value:+.4f})" for c, b, _ in found if c.verdict == "better"]
        worse = [f"{b:,} ({c.value:+.4f})" for c, b, _ in found if c.verdict == "worse"]
        open_ = [f"{b:,}" for _, b, d in found if not (d.holds or d.verdict == "better")]
        if better and not worse:
            outcome[value] = f"**changes the default**: better at {', '.join(better)}, worse nowhere"
            continue
        said = (f"better at {', '.join(better)}; " if better else "") + \
            (f"worse at {', '.join(worse)}" if worse else "called worse nowhere") + ("" if better else ", better nowhere")
        outcome[value] = (f"the default stays by incumbency ({said}; the default not shown to hold against it at "
                          f"{', '.join(open_)})" if open_ else f"the default stays by the evidence ({said}; the default "
                          "holds against it at every batch)")
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
                    "accuracy": Spread.of(list(outcomes(arm(jobs, defaults, optimizer, batch)).values())).mean,
                    "default_accuracy": Spread.of(list(outcomes(arm(jobs, defaults, PARTNER[optimizer], batch)).values())).mean}
    return {"limits": limits, "alternatives": alternatives}


# --- the text ----------------------------------------------------------------------------------


def predates_the_rule(jobs: list[dict[str, Any]]) -> bool:
    """Jobs that record no design: the study of 2026-12-03, run before the rule and re-issued by it."""
    return any(not j.get("design") for j in jobs)


def seed_range(jobs: list[dict[str, Any]]) -> str:
    seeds = sorted({j["seed"] for j in jobs})
    return f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else ", ".join(map(str, seeds))


def power_section(jobs: list[dict[str, Any]], defaults: Defaults) -> list[str]:
    planned = seeds_for(PILOT_SD, PLANNED_FAMILY)
    seeds = len({j["seed"] for j in jobs})
    lines = ["## The decision rule and its power", "",
             "The rule (trainer/measure/decision_rule.py, docs/practices.md \"How a default is decided\"): a run failed "
             "only where it measured nothing (stopped, a non-finite loss); failures are counted by Fisher's exact test and "
             "every measured val accuracy (a run that ended at 0.14 is measured at 0.14) enters the paired t test by seed "
             f"(every arm ran seeds {seed_range(jobs)}). *Better* / *worse*: the two-sided p, Holm-adjusted within the family, below "
             f"{ALPHA}. *Holds*: the one-sided {1 - ALPHA:.0%} bound of the difference above -{MARGIN} (one point) and no "
             "more failures; a limit is the fixed sequence 128, 256, ... up to the first batch that does not hold. "
             "Neither shown: *inconclusive*, which is never read as equal.",
             "", (f"The seeds were planned before the runs on the rule of the time (a two-sided Welch test catching {MARGIN} "
                  f"with {POWER:.0%} power at {ALPHA}/{PLANNED_FAMILY}, on the pilot Welch sd {PILOT_SD}): **{planned} seeds**. "
                  if predates_the_rule(jobs) else
                  "The seeds were planned by this rule's power calculation on the paired spread, in the design committed "
                  f"before the first job (its commit in every job; the calculation in benchmarks/batch_scaling.py): "
                  f"**{seeds} seeds**. ")
             + "The spread the test now uses is the sd of the per-seed differences against batch 64; at it, the margin "
             f"that {seeds} seeds show to hold with {POWER:.0%} power (a fixed-sequence step, "
             "unadjusted) and the difference they catch at Holm's strictest level of the family:", "",
             "| optimizer | batch | sd of the paired differences | margin shown to hold | difference caught |",
             "|---|---:|---:|---:|---:|"]
    for family in families(jobs, defaults):
        if family.kind != "limit":
            continue
        reference = outcomes(arm(jobs, defaults, family.optimizer, REFERENCE_BATCH))
        m = sum(c.p is not None for c in family.comparisons)
        for batch, _ in family.where:
            runs = outcomes(arm(jobs, defaults, family.optimizer, batch))
            sd, seeds = spread_used(reference, runs), min(len(reference), len(runs))
            if sd is None:
                continue
            shown = detectable_drop(seeds, sd, 1, is_paired=True, test="noninferiority")
            lines.append(f"| {family.optimizer} | {batch:,} | {sd:.4f} | {shown:.4f}"
                         + (" (the planned power holds)" if shown <= MARGIN else " (short of the planned power)")
                         + f" | {detectable_drop(seeds, sd, m, is_paired=True):.4f} |")
    return lines


def family_lines(family: Family, secondary: Family | None) -> list[str]:
    lines = [f"- **{family.name}** (m={sum(c.p is not None for c in family.comparisons)}): "
             + "; ".join(f"{c.label}: {c.text()}" for c in family.comparisons)]
    if secondary is not None:
        lines.append("  - test accuracy, a second look: "
                     + "; ".join(f"{c.label}: {c.value:+.4f} {c.verdict}" for c in secondary.comparisons))
    return lines


#: The verdicts of the 2026-12-03 report (Welch, runs under 0.5 at chance, "within the noise" read
#: as "holds") that the rule of issue 51 may change: (what it said, what to compare it with now).
#: Historical text, listed in the report and CHANGELOG.md.
BEFORE = {
    ("limit", "adamw"): "AdamW's defaults held to batch 128 (worse at 256: -0.0057, Holm p 0.046)",
    ("limit", "sgd"): "SGD's defaults held to batch 256 (-0.0069 there, Holm p 0.054: read as holding)",
    ("lr_rule", "adamw"): "for AdamW, no lr rule better than sqrt: the default stays",
    ("lr_rule", "sgd"): "for SGD, linear within the noise of sqrt everywhere and none worse at 512: the default stays",
    ("wd_rule", "adamw"): "AdamW's weight-decay rules: not decided (every arm within the noise at 2,048)",
    ("wd_rule", "sgd"): "SGD's linear weight decay: not decided (within the noise at 2,048)",
    ("warmup", "adamw"): "AdamW, warmup off within the noise of 5% at 64, 128 and 256: the default stays",
    ("warmup", "sgd"): "SGD, warmup off within the noise of 5% at 64, 128 and 256: the default stays",
    ("calibration", "adamw"): "AdamW, the calibration unclipped: not decided (within the noise at 2,048)",
    ("calibration", "sgd"): "SGD, the calibration unclipped: not decided (within the noise at 2,048)",
    ("partner", "lars"): "LARS better than SGD at 1,024 (+0.0239, Holm p 0.004)",
    ("partner", "lamb"): "LAMB within the noise of AdamW at 1,024 and 2,048",
}


def limit_text(limit: Limit) -> str:
    steps = f" ({limit.steps} steps)" if limit.steps else ""
    beyond = (f"; at {limit.next_batch:,}{steps} it lost {limit.lost:.4f} against batch "
              f"{REFERENCE_BATCH} ({limit.why})"
              if limit.next_batch else "; held over the whole range")
    return f"today's defaults hold to batch {limit.holds_to:,}{beyond}"


def verdict_lines(jobs: list[dict[str, Any]], defaults: Defaults, primary: list[Family]) -> dict[tuple[str, str], str]:
    """What the rule concludes, by (kind, optimizer): the limits, each alternative's decision and
    where LAMB or LARS is better."""
    found, said = findings(jobs, defaults, primary), {}
    for limit in found["limits"].values():
        said[("limit", limit.optimizer)] = f"**{limit.optimizer}, {limit_text(limit)}**"
    for family in primary:
        if family.kind in CHANGES:
            said[(family.kind, family.optimizer)] = "; ".join(
                f"{'' if family.kind == 'warmup' else CHANGES[family.kind] + ' '}{_value(family.kind, value)}: {outcome}" for value, outcome in decision(family).items())
        elif family.kind == "partner":
            called = [f"{b:,}: {c.verdict} ({c.value:+.4f})" for c, (b, _) in zip(family.comparisons, family.where)]
            said[("partner", family.optimizer)] = f"{family.optimizer} against {PARTNER[family.optimizer]}: {'; '.join(called)}"
    return said


def verdicts(jobs: list[dict[str, Any]], defaults: Defaults) -> list[str]:
    primary, secondary = families(jobs, defaults), families(jobs, defaults, "test_acc")
    said = verdict_lines(jobs, defaults, primary)
    second = findings(jobs, defaults, secondary)["limits"]
    lines = ["## Verdicts", ""]
    for (kind, optimizer), text in said.items():
        lines.append(f"- {optimizer}: {text}" if kind != "limit" else f"- {text}")
        if kind == "limit" and optimizer in second:
            lines.append(f"  - test accuracy from the same runs, a second look: {limit_text(second[optimizer])}")
    if predates_the_rule(jobs):  # the jobs of 2026-12-03, whose report this rule re-issued
        lines += ["", "### What the rule of issue 51 changed (the same jobs; the 2026-12-03 report said)", ""]
        lines += [f"- {BEFORE[k]}; now: {said[k]}" for k in BEFORE if k in said]
    lines += ["", "### Every comparison, by family (val accuracy; paired t by seed, 95% interval, raw and Holm-adjusted "
              "p; the one-sided non-inferiority bound and p)", ""]
    by_name = {f.name: f for f in secondary}
    for family in primary:
        lines += family_lines(family, by_name.get(family.name))
    return lines


def arm_row(batch: int, name: str, runs: list[dict[str, Any]]) -> str:
    alone = [j for j in runs if timed_alone(j)]
    spikes = sum(1 for j in runs if (j.get("spikes") or 0) > 0)
    return (f"| {batch:,} | {name} | {runs[0]['lr']:.3g} | {runs[0]['weight_decay']:.3g} | "
            f"{Spread.of(list(outcomes(runs).values())).text('{:.4f}')} | "
            f"{Spread.of(list(outcomes(runs, 'test_acc').values())).text('{:.4f}')} | "
            f"{sum(failed(j) for j in runs)} of {len(runs)} | {sum(stalled(j) for j in runs)} of {len(runs)} | {spikes} | "
            f"{sum(j['reached'] for j in runs)} of {len(runs)} | {Spread.of([j['target_steps'] for j in runs]).text('{:.0f}')} | "
            f"{Spread.of([j['target_s'] for j in alone]).text('{:.1f}')} ({len(alone)} timed alone) |")


TABLE_HEADER = ["| batch | arm | lr | weight decay | val acc, every run (mean ± sd, n) | test acc | failed | stalled (under 0.5) "
                "| runs with a loss spike | reached target | steps to target | time to target (s) |",
                "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]


def tables(jobs: list[dict[str, Any]], defaults: Defaults) -> list[str]:
    lines = ["## Tables", "", "Accuracies over every run that measured one (failed: measured nothing; stalled: ended "
             f"under {STALLED_BELOW}, counted and kept in the mean); times only from runs timed alone (no other load on "
             "the machine).", ""]
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
                        name = _value(changed, value) if changed == "warmup" else f"{CHANGES[changed]} {_value(changed, value)}"
                        lines.append(arm_row(batch, name, runs))
        lines.append("")
    return lines


def report(jobs: list[dict[str, Any]], defaults: Defaults, header: list[str]) -> list[str]:
    return [*header, *power_section(jobs, defaults), "", *verdicts(jobs, defaults), "", *tables(jobs, defaults)]


def plot(jobs: list[dict[str, Any]], defaults: Defaults, path: Path) -> None:
    """Final val accuracy against the batch, mean ± sd over every measured run: a panel
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
            points = [(b, Spread.of(list(outcomes(runs_at(b)).values())))
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
