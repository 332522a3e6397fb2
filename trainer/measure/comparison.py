"""The side-by-side comparison of one multirun: what each stage of an optimization ladder bought.

A ladder is one Hydra multirun whose jobs differ by config overrides only. This module reads each
job's `summary.json` and `config_resolved.yaml` back and writes `SWEEP/comparison.md` and
`SWEEP/comparison.png`; what they show, seeds grouped included, is in docs/scale-out.md ("Sweeps").
It reads files only, so it runs at the end of a sweep (`ComparisonCallback`, under `hydra.callbacks`)
or later on any sweep folder (`python -m trainer.measure.comparison SWEEP_DIR`). A job that crashed,
or never wrote its summary, shows up as such; it never stops the report."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import yaml
from hydra.experimental.callback import Callback

from trainer.configuration.diff import MISSING, changes_marked, result_overrides, same
from trainer.infra.atomic import write_text_atomic
from trainer.infra.errors import UserError, exception_line, exit_with, one_line, one_line_on_user_error
from trainer.infra.figures import new_figure, save_png
from trainer.infra.schema import ConfigGroup
from trainer.measure.seed_groups import Setting, group_by_setting, has_repeats, setting_of, table
from trainer.measure.seed_groups import markdown as settings_markdown

log = logging.getLogger("trainer")

MARKDOWN_NAME = "comparison.md"
CHART_NAME = "comparison.png"
COLUMNS = ("stage", "what it changed", "samples/s", "speed-up", "peak MiB", "final loss", "loss spread", "val acc",
           "test acc")
#: Shown after speed-up (and the time to target) when a job has an MFU.
MFU_COLUMNS = ("MFU", "MFU (bf16 peak)")
CHANGES_SHOWN = 4  # more than this does not fit a table cell; the Details section lists them all
FIRST_STAGE = "(first stage)"
NO_SUMMARY = "no summary.json"
_SWEEP_LAYOUT = "a Hydra multirun folder holding job folders named 0, 1, 2, ..."


@dataclass
class SweepJob:
    """One job folder of a sweep and what it left behind (None where a file is missing)."""

    number: int
    folder: Path
    summary: dict[str, Any] | None
    config: dict[str, Any] | None
    # Hydra's own record of the command line, for naming a job that died before its summary.
    hydra_overrides: list[str] = field(default_factory=list)
    # Why a file that exists could not be used (half-written or not a mapping).
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Row:
    """One line of the comparison table; numbers are None where the job has none to show."""

    number: int
    stage: str
    changed: str
    samples_per_s: float | None
    speedup: float | None
    peak_mib: float | None
    final_loss: float | None
    loss_spread: float | None
    val_acc: float | None
    status: str
    test_acc: float | None = None
    #: Time to the run's target (target.metric/value), seconds into training; None when the job has
    #: no target or did not reach it (`target_note` says which).
    target_s: float | None = None
    target_speedup: float | None = None
    #: True when the first job never reached the target: the speed-up is then a lower bound (its
    #: whole training time over this job's time to target).
    target_speedup_at_least: bool = False
    target_note: str = ""
    #: MFU against the precision's own peak (fp32 against the FP32 or TF32 peak, bf16 against the
    #: bf16 peak), and against the device's dense bf16 peak whatever the precision: the one scale on
    #: which stages of different precisions compare. None where unknown (a CPU, an older summary).
    mfu: float | None = None
    mfu_bf16_peak: float | None = None


# --------------------------------------------------------------------------- reading a sweep
def load_jobs(sweep_dir: Path) -> list[SweepJob]:
    """The job folders of `sweep_dir` (named 0, 1, 2, ...) in job order, with their files read."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        return []
    numbered = [(int(p.name), p) for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    return [_load_job(number, folder) for number, folder in sorted(numbered)]


def _load_job(number: int, folder: Path) -> SweepJob:
    problems: list[str] = []
    summary = _read_mapping(folder / "summary.json", json.loads, problems)
    config = _read_mapping(folder / "config_resolved.yaml", yaml.safe_load, problems)
    overrides = _read_mapping(folder / ".hydra" / "overrides.yaml", yaml.safe_load, [], mapping=False)
    return SweepJob(number, folder, summary, config,
                    hydra_overrides=[str(o) for o in overrides] if isinstance(overrides, list) else [],
                    problems=problems)


def _read_mapping(path: Path, parse: Callable[[str], Any], problems: list[str], mapping: bool = True) -> Any:
    if not path.is_file():
        return None
    try:
        value = parse(path.read_text(encoding="utf-8"))
    except Exception as ex:  # noqa: BLE001 - any unreadable file is reported, never fatal
        problems.append(f"{path.name} unreadable ({exception_line(ex)})")
        return None
    if mapping and not isinstance(value, dict):
        problems.append(f"{path.name} holds a {type(value).__name__}, not a mapping")
        return None
    return value


def job_overrides(job: SweepJob) -> list[str]:
    overrides = (job.summary or {}).get("overrides")
    return [str(o) for o in (overrides if isinstance(overrides, list) else job.hydra_overrides)]


def settings_of(rows: Sequence[Row], jobs: Sequence[SweepJob]) -> list[Setting]:
    """The sweep's settings: its jobs grouped by their overrides without the seed, each named by its
    recipe and the overrides that vary between settings (all that change the result where none
    vary)."""
    overrides = [job_overrides(j) for j in jobs]
    per_job = [dict(o.partition("=")[::2] for o in setting_of(result_overrides(x))) for x in overrides]
    varying = {key for d in per_job for key in d if len({other.get(key) for other in per_job}) > 1}
    names = []
    for job, own in zip(jobs, overrides):
        recipe = _get(job.summary, "choices", "recipe")
        setting = setting_of(result_overrides(own))
        shown = [o for o in setting if o.partition("=")[0] in varying and "recipe" not in o.partition("=")[0]]
        if not recipe and not shown:
            shown = list(setting)
        names.append(" ".join([str(recipe)] * bool(recipe) + shown) or "(defaults)")
    return group_by_setting(rows, overrides, names)


def stage_name(job: SweepJob) -> str:
    """The recipe's name when the job used one, else its overrides, else ``job N``."""
    recipe = _get(job.summary, "choices", "recipe")
    if recipe:
        return str(recipe)
    overrides = job_overrides(job) or job.hydra_overrides
    return " ".join(str(o) for o in overrides) if overrides else f"job {job.number}"


# --------------------------------------------------------------------------- config differences
def _earlier_with(jobs: Sequence[SweepJob], index: int, has: Callable[[SweepJob], Any]) -> SweepJob | None:
    """The nearest job before `index` that has something to compare against (a crashed job may not)."""
    for earlier in reversed(jobs[:index]):
        if has(earlier):
            return earlier
    return None


def _what_changed(jobs: Sequence[SweepJob], index: int) -> str:
    if index == 0:
        return FIRST_STAGE
    job = jobs[index]
    if job.config is None:
        return "(no config_resolved.yaml)"
    previous = _earlier_with(jobs, index, lambda j: j.config is not None)
    if previous is None:
        return "(no earlier config to compare)"
    changes = changes_marked(previous.config, job.config)
    if not changes:
        return "(no config change)"
    # Settings that changed value first; keys that only came or went with a group's choice (a
    # clipping mode's own options, say) are the least telling and go last.
    changes.sort(key=lambda change: (change[1] is MISSING or change[2] is MISSING, change[0]))
    items = [f"{key}={_after_text(after)}" for key, _, after in changes[:CHANGES_SHOWN]]
    if len(changes) > CHANGES_SHOWN:
        items.append(f"(+{len(changes) - CHANGES_SHOWN} more)")
    text = ", ".join(items)
    if previous is not jobs[index - 1]:
        text += f" (vs job {previous.number})"
    return text


def _after_text(value: Any) -> str:
    return "(removed)" if value is MISSING else _value_text(value)


def _value_text(value: Any, limit: int = 40) -> str:
    """Values as a person would write them in an override: ``true``, ``null``, ``0.001``, ``[1, 2]``."""
    if value is MISSING:
        return "(absent)"
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = f"{value:g}"
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(_value_text(v, limit) for v in value) + "]"
    elif isinstance(value, dict):
        text = "{" + ", ".join(f"{k}: {_value_text(v, limit)}" for k, v in value.items()) + "}"
    else:
        text = str(value)
    return _short(one_line(text), limit)


# --------------------------------------------------------------------------- the rows
def comparison_rows(jobs: Sequence[SweepJob]) -> list[Row]:
    """One row per job, in job order; speed-ups are relative to the first job's samples/s."""
    baseline = _samples_per_s(jobs[0]) if jobs else None
    rows = []
    for index, job in enumerate(jobs):
        status = _status(job)
        numbers: dict[str, Any] = dict.fromkeys(  # float or None each, Row's fields of those names
            ("samples_per_s", "speedup", "peak_mib", "final_loss", "loss_spread", "val_acc", "test_acc", "mfu",
             "mfu_bf16_peak"))
        if status == "completed":
            summary = job.summary or {}
            rate = _samples_per_s(job)
            peak = _number(_get(summary, "peak_memory", "bytes"))
            numbers.update(
                samples_per_s=rate,
                speedup=rate / baseline if rate is not None and baseline else None,
                peak_mib=peak / 2**20 if peak is not None else None,
                final_loss=_number(_get(summary, "loss", "final")),
                loss_spread=_number(_get(summary, "loss", "spread")),
                val_acc=_number(_get(summary, "metrics", "val", "acc")),
                test_acc=_number(_get(summary, "metrics", "test", "acc")),
                mfu=_number(_get(summary, "throughput", "mfu")),
                # Summaries written before the meter reported it have none: "-".
                mfu_bf16_peak=_number(_get(summary, "throughput", "mfu_bf16_peak")),
            )
        timing = _time_to_target(job, jobs[0] if jobs else None)
        changed = _what_changed(jobs, index)
        if index and _same_setting(jobs[0], job):
            # Another seed of the first setting: a ratio to it is the spread between seeds, not a
            # speed-up; the "Over seeds" table gives that spread.
            numbers["speedup"] = None
            timing = {**timing, "target_speedup": None, "target_speedup_at_least": False}
            changed = f"only the seed (the setting of job {jobs[0].number}: no speed-up between seeds)"
        rows.append(Row(number=job.number, stage=stage_name(job), changed=changed, status=status, **numbers, **timing))
    return rows


def _same_setting(first: SweepJob, job: SweepJob) -> bool:
    """Whether `job` differs from `first` only in its seed."""
    return setting_of(result_overrides(job_overrides(first))) == setting_of(result_overrides(job_overrides(job)))


def _time_to_target(job: SweepJob, first: SweepJob | None) -> dict[str, Any]:
    """The job's time to its target and its speed-up over the first job's: exact when both reached
    it, a lower bound (the first job's whole training time over this one's) when only this one did."""
    target = _get(job.summary, "target")
    if not isinstance(target, dict):
        return {}
    if not target.get("reached"):
        best = _number(target.get("best"))
        return {"target_note": f"not reached (best {best:.4g})" if best is not None else "not reached"}
    seconds = _number(target.get("wall_s"))
    first_summary = first.summary if first else None
    if bool(_get(first_summary, "target", "reached")):
        baseline = _number(_get(first_summary, "target", "wall_s"))
        return {"target_s": seconds, "target_speedup": baseline / seconds if seconds and baseline else None}
    whole = _number(_get(first_summary, "fit_time_s")) if _get(first_summary, "status") == "completed" else None
    if isinstance(_get(first_summary, "target"), dict) and whole and seconds:
        return {"target_s": seconds, "target_speedup": whole / seconds, "target_speedup_at_least": True}
    return {"target_s": seconds, "target_speedup": None}


def _status(job: SweepJob) -> str:
    if job.summary is None:
        return "unreadable summary.json" if any(p.startswith("summary.json") for p in job.problems) else NO_SUMMARY
    return str(job.summary.get("status") or "unknown status")


def _samples_per_s(job: SweepJob) -> float | None:
    if _status(job) != "completed":
        return None
    rate = _number(_get(job.summary, "throughput", "samples_per_s"))
    # A zero or non-finite rate is no measurement; dividing by it would only print nonsense.
    return rate if rate is not None and math.isfinite(rate) and rate > 0 else None


def _get(data: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _number(value: Any) -> float | None:
    """A float from summary.json, where non-finite floats are stored as the strings "nan"/"inf"."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        return float(value)
    except ValueError:  # a string that is no number
        return None


# --------------------------------------------------------------------------- Markdown
def markdown_table(rows: Sequence[Row]) -> str:
    """The comparison table alone (what the sweep prints at its end); with "time to target" and
    "speed-up to target" beside samples/s when the jobs name a target (target.metric/value), and
    "MFU" and "MFU (bf16 peak)" after them when a job has an MFU (a GPU in the peak table)."""
    targets = any(row.target_s is not None or row.target_note for row in rows)
    mfu = _has_mfu(rows)
    columns = (list(COLUMNS[:4]) + (["time to target", "speed-up to target"] if targets else [])
               + (list(MFU_COLUMNS) if mfu else []) + list(COLUMNS[4:]))
    body = []
    for row in rows:
        stage = row.stage if row.status == "completed" else f"{row.stage} ({row.status})"
        cells = [stage, row.changed, _fmt(row.samples_per_s, "{:,.0f}"), _fmt(row.speedup, "{:.2f}x")]
        if targets:
            speedup = _fmt(row.target_speedup, "> {:.2f}x" if row.target_speedup_at_least else "{:.2f}x")
            cells += [row.target_note or _fmt(row.target_s, "{:.1f} s"), speedup]
        if mfu:
            cells += [_fmt(row.mfu, "{:.1%}"), _fmt(row.mfu_bf16_peak, "{:.1%}")]
        cells += [_fmt(row.peak_mib, "{:.0f}"), _fmt(row.final_loss, "{:.4f}"), _fmt(row.loss_spread, "{:.4f}"),
                  _fmt(row.val_acc, "{:.4f}"), _fmt(row.test_acc, "{:.4f}")]
        body.append(cells)
    return "\n".join(table(columns, body, _cell))


def _has_mfu(rows: Sequence[Row]) -> bool:
    return any(row.mfu is not None or row.mfu_bf16_peak is not None for row in rows)


def to_markdown(rows: Sequence[Row], jobs: Sequence[SweepJob], settings: Sequence[Setting] | None = None) -> str:
    """The whole report: title, how the numbers were measured, the settings over seeds (`settings`,
    worked out here when not given), the table, then per-stage details."""
    sweep = jobs[0].folder.parent if jobs else Path(".")
    summaries = [j.summary for j in jobs if j.summary]
    device = next((s["device"] for s in summaries if isinstance(s.get("device"), dict)), None)
    title = f"# Stage comparison: `{sweep}`"
    if device:
        title += f" on {_device_text(device)}"
    lines = [title, ""]
    lines += _notes(rows, jobs, summaries)
    settings = settings_of(rows, jobs) if settings is None else settings
    if has_repeats(settings):
        lines += ["", "## Over seeds", "", "Jobs that differ only in `seed` are one setting: mean ± standard "
                  "deviation (n) of each number.", "", settings_markdown(settings, _cell), "", "## Every job"]
    lines += ["", markdown_table(rows), "", "## Details", ""]
    for index, row in enumerate(rows):
        lines += _details(jobs, index, row)
    return "\n".join(lines).rstrip() + "\n"


def _device_text(device: dict[str, Any]) -> str:
    name, accelerator = device.get("name"), device.get("accelerator")
    if name and accelerator:
        return f"{name} ({accelerator})"
    return str(name or accelerator or "an unknown device")


def _notes(rows: Sequence[Row], jobs: Sequence[SweepJob], summaries: list[dict[str, Any]]) -> list[str]:
    notes = []
    measured = next(((j, j.summary["throughput"]) for j in jobs
                     if j.summary and isinstance(j.summary.get("throughput"), dict)), None)
    if measured:
        job, throughput = measured
        how = "; ".join(f"{label}{throughput[key]}" for key, label in (("method", ""), ("includes", "includes "))
                        if throughput.get(key))
        if how:
            notes.append(f"Throughput: {how} (as job {job.number} reports it).")
    if rows and rows[0].samples_per_s is not None:
        notes.append(f"Speed-up is relative to the first stage (job {rows[0].number}).")
    elif rows:
        notes.append(f"No speed-up: the first stage (job {rows[0].number}) has no throughput to compare with.")
    if _has_mfu(rows):
        notes.append("MFU: against the peak of the math each job's precision runs (fp32 against the FP32 or TF32 "
                     "peak, bf16 against the bf16 peak), so it falls where a stage moves from fp32 to bf16 however "
                     "much faster it got; MFU (bf16 peak): every job against the device's dense bf16 peak, the one "
                     "scale on which stages of different precisions compare (- where a summary has none).")
    memory = next((s["peak_memory"]["what"] for s in summaries
                   if isinstance(s.get("peak_memory"), dict) and s["peak_memory"].get("what")), None)
    if memory:
        notes.append(f"Peak memory: {memory}.")
    # Ratios across different hardware measure the hardware too; say so rather than hide it.
    devices = sorted({_device_text(s["device"]) for s in summaries if isinstance(s.get("device"), dict)})
    if len(devices) > 1:
        notes.append(f"Warning: the jobs ran on different devices ({', '.join(devices)}); "
                     "speed-ups compare hardware as well as settings.")
    return [" ".join(notes)] if notes else []


def _details(jobs: Sequence[SweepJob], index: int, row: Row) -> list[str]:
    job = jobs[index]
    summary = job.summary or {}
    heading = f"### job {job.number}" + ("" if row.stage == f"job {job.number}" else f": {_cell(row.stage)}")
    lines = [heading, "", f"- status: {row.status}"]
    if summary.get("error"):
        lines.append(f"- error: {one_line(str(summary['error']))}")
    if row.status == "running":
        lines.append("- the summary still says running: the job was killed before it could finish, or is still going")
    lines += [f"- {problem}" for problem in job.problems]
    if summary.get("overrides"):
        lines.append("- overrides: " + " ".join(f"`{o}`" for o in summary["overrides"]))
    recipe = summary.get("recipe")
    if isinstance(recipe, dict) and recipe.get("name"):
        parent = f", extends `{recipe['parent']}`" if recipe.get("parent") else ""
        lines.append(f"- recipe `{recipe['name']}`{parent}")
    lines += _config_details(jobs, index)
    lines += _derived_details(jobs, index)
    throughput = summary.get("throughput")
    if not isinstance(throughput, dict):
        return lines + [""]
    if throughput.get("mfu") is not None:
        lines.append(f"- MFU {_fmt(_number(throughput['mfu']), '{:.1%}')}"
                     + (f" ({throughput['mfu_note']})" if throughput.get("mfu_note") else ""))
    one_peak, bf16_peak = _number(throughput.get("mfu_bf16_peak")), _number(throughput.get("bf16_peak_flops"))
    if one_peak is not None:
        lines.append(f"- MFU against the dense bf16 peak {one_peak:.1%}"
                     + (f" (of {bf16_peak / 1e12:,.1f} TFLOP/s)" if bf16_peak else ""))
    return lines + [""]


def _config_details(jobs: Sequence[SweepJob], index: int) -> list[str]:
    job = jobs[index]
    if index == 0:
        return ["- config: the first stage, the reference for the others"]
    if job.config is None:
        return ["- config changes: unknown (no config_resolved.yaml)"]
    previous = _earlier_with(jobs, index, lambda j: j.config is not None)
    if previous is None:
        return ["- config changes: no earlier job left a config to compare with"]
    changes = changes_marked(previous.config, job.config)
    if not changes:
        return [f"- config changes vs job {previous.number}: none"]
    return [f"- config changes vs job {previous.number}:"] + [
        f"  - `{key}`: `{_value_text(before, 80)}` -> `{_value_text(after, 80)}`" for key, before, after in changes]


def _derived_details(jobs: Sequence[SweepJob], index: int) -> list[str]:
    derived = _derived(jobs[index])
    if not derived:
        return []
    previous = _earlier_with(jobs, index, _derived) if index else None
    if previous is None:
        return ["- derived values:"] + [f"  - `{key}` = `{_value_text(value, 80)}`" + (f" ({how})" if how else "")
                                        for key, (value, how) in derived.items()]
    before = _derived(previous)
    differing = [(key, before.get(key, (MISSING, ""))[0], value, how) for key, (value, how) in derived.items()
                 if not same(before.get(key, (MISSING, ""))[0], value)]
    differing += [(key, value, MISSING, "") for key, (value, _) in before.items() if key not in derived]
    if not differing:
        return [f"- derived values: as in job {previous.number}"]
    return [f"- derived values that differ from job {previous.number}:"] + [
        f"  - `{key}`: `{_value_text(old, 80)}` -> `{_value_text(new, 80)}`" + (f" ({how})" if how else "")
        for key, old, new, how in sorted(differing, key=lambda d: d[0])]


def _derived(job: SweepJob) -> dict[str, tuple[Any, str]]:
    derived = (job.summary or {}).get("derived")
    if not isinstance(derived, dict):
        return {}
    return {str(k): (v.get("value"), one_line(str(v.get("how") or ""))) if isinstance(v, dict) else (v, "")
            for k, v in derived.items()}


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _cell(text: str) -> str:
    # A `|` would split the cell and a newline would end the table row.
    return one_line(str(text)).replace("|", "\\|") or "-"


# --------------------------------------------------------------------------- chart
def plot(rows: Sequence[Row], path: Path, settings: Sequence[Setting] = ()) -> Path:
    """Bars of samples/s per stage (annotated with the speed-up) beside bars of peak memory,
    written atomically as a PNG. Stages without a number get no bar but keep their place. With
    `settings` that repeat over seeds, one bar per setting instead: the mean samples/s and val
    accuracy, each with its standard deviation as an error bar."""
    if has_repeats(settings):
        return _plot_settings(settings, Path(path))
    positions = list(range(len(rows)))
    figure = new_figure(figsize=(12, max(2.5, 0.5 * len(rows) + 1.5)), layout="constrained")
    speed_axes, memory_axes = figure.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [3, 2]})

    def bars(axes: Any, values: list[float | None], color: str, notes: list[str], title: str) -> None:
        present = [(p, v) for p, v in zip(positions, values) if v is not None and math.isfinite(v)]
        if present:
            axes.barh([p for p, _ in present], [v for _, v in present], color=color)
        top = max((v for _, v in present), default=1.0) or 1.0
        for position, value, note in zip(positions, values, notes):
            shown = value if value is not None and math.isfinite(value) else 0.0
            if note:
                axes.text(shown + top * 0.01, position, note, va="center", fontsize=9)
        axes.set_xlim(0, top * 1.25)
        axes.set_title(title)
        axes.grid(axis="x", alpha=0.3)

    missing = [r.status if r.status != "completed" else "not measured" for r in rows]
    bars(speed_axes, [r.samples_per_s for r in rows], "tab:blue",
         [(f"{r.samples_per_s:,.0f}" + (f"  ({r.speedup:.2f}x)" if r.speedup is not None else ""))
          if r.samples_per_s is not None else missing[i] for i, r in enumerate(rows)],
         "training throughput (samples/s)")
    bars(memory_axes, [r.peak_mib for r in rows], "tab:orange",
         [f"{r.peak_mib:,.0f}" if r.peak_mib is not None else missing[i] for i, r in enumerate(rows)],
         "peak memory (MiB)")
    return _labelled(figure, speed_axes, [f"{r.number}: {r.stage}" for r in rows], Path(path))


def _plot_settings(settings: Sequence[Setting], path: Path) -> Path:
    positions = list(range(len(settings)))
    figure = new_figure(figsize=(12, max(2.5, 0.5 * len(settings) + 1.5)), layout="constrained")
    axes = figure.subplots(1, 2, sharey=True)
    for ax, measure, title, pattern in ((axes[0], "samples_per_s", "training throughput (samples/s)", "{:,.0f}"),
                                        (axes[1], "val_acc", "validation accuracy", "{:.4f}")):
        spreads = [s.spreads[measure] for s in settings]
        present = [(p, sp) for p, sp in zip(positions, spreads) if sp.mean is not None]
        if present:
            ax.barh([p for p, _ in present], [sp.mean for _, sp in present],
                    xerr=[sp.sd or 0.0 for _, sp in present], color="tab:blue", capsize=4, alpha=0.85)
        for position, spread in present:
            ax.text((spread.mean or 0.0) + (spread.sd or 0.0), position, "  " + spread.text(pattern), va="center",
                    fontsize=8)
        top = max(((sp.mean or 0.0) + (sp.sd or 0.0) for _, sp in present), default=1.0) or 1.0
        ax.set_xlim(0, top * 1.45)
        ax.set_title(f"{title}, mean ± sd over seeds")
        ax.grid(axis="x", alpha=0.3)
    return _labelled(figure, axes[0], [s.name for s in settings], path)


def _labelled(figure: Any, axes: Any, labels: list[str], path: Path) -> Path:
    """`figure` with `labels` on the shared y axis of its bars, saved to `path`."""
    axes.set_yticks(range(len(labels)), [_short(label) for label in labels])
    # Every stage keeps its slot, bar or not, with the first stage on top as in the table.
    axes.set_ylim(len(labels) - 0.5, -0.5)
    save_png(figure, path)
    return path


def _short(text: str, limit: int = 45) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- writing
def write_comparison(sweep_dir: Path) -> tuple[Path, Path, str]:
    """Write ``comparison.md`` and ``comparison.png`` into `sweep_dir`; return their paths and the Markdown."""
    markdown_path, chart_path, markdown, _, _ = _write(Path(sweep_dir))
    return markdown_path, chart_path, markdown


def _write(sweep_dir: Path) -> tuple[Path, Path, str, list[Row], list[Setting]]:
    if not sweep_dir.is_dir():
        raise UserError(str(sweep_dir), "is not a folder", _SWEEP_LAYOUT)
    jobs = load_jobs(sweep_dir)
    if not jobs:
        hint = " (it is a single run's folder: pass the multirun folder above its jobs)" \
            if (sweep_dir / "summary.json").is_file() else ""
        raise UserError(str(sweep_dir), f"holds no job folders{hint}", _SWEEP_LAYOUT)
    rows = comparison_rows(jobs)
    settings = settings_of(rows, jobs)
    markdown = to_markdown(rows, jobs, settings)
    markdown_path, chart_path = sweep_dir / MARKDOWN_NAME, sweep_dir / CHART_NAME
    write_text_atomic(markdown_path, markdown)
    plot(rows, chart_path, settings)
    return markdown_path, chart_path, markdown, rows, settings


# --------------------------------------------------------------------------- Hydra callback and CLI
class ComparisonCallback(Callback):
    """Writes the comparison when a multirun ends. Register it in the primary config:
    ``hydra: {callbacks: {comparison: {_target_: trainer.measure.comparison.ComparisonCallback}}}``"""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        try:
            mode = _get_config(config, "hydra", "mode")
            if mode is not None and str(mode).split(".")[-1] != "MULTIRUN":
                return
            markdown_path, chart_path, _, rows, settings = _write(Path(str(config.hydra.sweep.dir)))
            print(markdown_table(rows))
            if has_repeats(settings):
                print(f"\nover seeds:\n{settings_markdown(settings, _cell)}")
            print(f"comparison: {markdown_path}")
            print(f"chart:      {chart_path}")
        except Exception as ex:  # noqa: BLE001 - the jobs' own results must stay visible
            line = ex.line() if isinstance(ex, UserError) else exception_line(ex)
            log.warning("comparison report not written: %s", line)
            return
        if rows and not any(row.status == "completed" for row in rows):
            # A sweep in which no job completed is a failure for whoever ran it (a script, CI): a
            # non-zero exit after the table, which says what each job ended as.
            exit_with(f"{config.hydra.sweep.dir}: none of the {len(rows)} jobs completed (see comparison.md)")


def _get_config(config: Any, *keys: str) -> Any:
    for key in keys:
        try:
            config = config.get(key) if hasattr(config, "get") else getattr(config, key, None)
        except Exception:  # noqa: BLE001 - a missing node (OmegaConf may raise) means "not set"
            return None
        if config is None:
            return None
    return config


def main(argv: Iterable[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.measure.comparison",
        description="Compare the jobs of one multirun folder: writes comparison.md and comparison.png into it.")
    parser.add_argument("sweep_dir", type=Path, help="the multirun folder (e.g. outputs/multirun/DATE/TIME)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    with one_line_on_user_error():
        markdown_path, chart_path, markdown = write_comparison(args.sweep_dir)
    sys.stdout.write(markdown)
    print(f"\ncomparison: {markdown_path}\nchart:      {chart_path}")


if __name__ == "__main__":
    main()


GROUP = ConfigGroup("ladder", __name__, "an optimization ladder: stages of one multirun, compared", None)
