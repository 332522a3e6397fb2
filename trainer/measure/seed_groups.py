"""Seeds as a dimension of a sweep: jobs that differ only in `seed` are one setting, measured n times.

A setting is a job's overrides without its `seed=`; its rows (trainer/measure/comparison.py) become
one line of means, standard deviations (n - 1) and n, and each setting's difference from the first
gets a 95% interval (Welch's t: the spreads may differ); docs/scale-out.md ("Seeds") shows it."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

#: The numbers of a comparison row that are summarized over seeds: (Row field, column heading,
#: format of a value).
MEASURES = (("val_acc", "val acc", "{:.4f}"), ("test_acc", "test acc", "{:.4f}"),
            ("target_s", "time to target (s)", "{:.1f}"), ("samples_per_s", "samples/s", "{:,.0f}"),
            ("final_loss", "final loss", "{:.4f}"), ("peak_mib", "peak MiB", "{:.0f}"))
#: The differences shown against the first setting: what a study compares.
COMPARED = ("val_acc", "test_acc", "target_s", "samples_per_s")
CONFIDENCE = 0.95


def finite(values: Sequence[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


@dataclass(frozen=True)
class Spread:
    """n values of one number: their mean and standard deviation (None for n < 2)."""

    n: int
    mean: float | None
    sd: float | None

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Spread:
        present = finite(values)
        if not present:
            return cls(0, None, None)
        return cls(len(present), statistics.fmean(present), statistics.stdev(present) if len(present) > 1 else None)

    def text(self, pattern: str) -> str:
        if self.mean is None:
            return "-"
        if self.sd is None:
            return f"{pattern.format(self.mean)} (n={self.n})"
        return f"{pattern.format(self.mean)} ± {pattern.format(self.sd)} (n={self.n})"


@dataclass(frozen=True)
class Difference:
    """A setting's mean minus the first setting's, with its interval; None bounds where n < 2."""

    value: float
    low: float | None
    high: float | None
    #: Why there is no interval where there is none.
    why: str = "fewer than 2 seeds"

    @property
    def within_noise(self) -> bool | None:
        if self.low is None or self.high is None:
            return None
        return self.low <= 0.0 <= self.high

    def text(self, pattern: str) -> str:
        signed = "{:+" + pattern[2:] if pattern.startswith("{:") else pattern
        shown = signed.format(self.value)
        if self.low is None or self.high is None:
            return f"{shown} (no interval: {self.why})"
        verdict = "within the noise" if self.within_noise else "beyond the noise"
        return f"{shown} [{signed.format(self.low)}, {signed.format(self.high)}] {verdict}"


def welch(first: Sequence[float], other: Sequence[float]) -> tuple[float, float, float]:
    """`other`'s mean minus `first`'s, its standard error and Welch's degrees of freedom (NaN where
    neither has any spread); both need two values or more."""
    va, vb = statistics.variance(first) / len(first), statistics.variance(other) / len(other)
    value = statistics.fmean(other) - statistics.fmean(first)
    if va + vb == 0.0:
        return value, 0.0, math.nan
    df = (va + vb) ** 2 / (va**2 / (len(first) - 1) + vb**2 / (len(other) - 1))
    return value, math.sqrt(va + vb), df


def difference(first: Sequence[float], other: Sequence[float], confidence: float = CONFIDENCE) -> Difference | None:
    """`other`'s mean minus `first`'s with Welch's t interval; None when either has no value."""
    a, b = finite(first), finite(other)
    if not a or not b:
        return None
    if len(a) < 2 or len(b) < 2:
        return Difference(statistics.fmean(b) - statistics.fmean(a), None, None)
    value, se, df = welch(a, b)
    if se == 0.0:
        # Accuracy is quantized: seeds can agree exactly, and a zero-width interval would call any
        # difference "beyond the noise" on no evidence of the noise at all.
        return Difference(value, None, None, why="no spread in either setting")
    from scipy.stats import t  # scipy comes with scikit-learn; imported only for a report

    half = float(t.ppf(0.5 + confidence / 2, df)) * se
    return Difference(value, value - half, value + half)


def setting_of(overrides: Sequence[str]) -> tuple[str, ...]:
    """What a job sets apart from its seed: its overrides without ``seed=``, in order."""
    return tuple(o for o in overrides if o.split("=", 1)[0].lstrip("+~") != "seed")


def seed_of(overrides: Sequence[str]) -> str | None:
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+~") == "seed":
            return value
    return None


@dataclass(frozen=True)
class Setting:
    """One setting of a sweep: its jobs (the comparison's rows) and the spread of each number."""

    name: str
    rows: tuple[Any, ...]
    seeds: tuple[str, ...]
    spreads: dict[str, Spread]

    @property
    def completed(self) -> int:
        return sum(1 for r in self.rows if r.status == "completed")

    def values(self, measure: str) -> list[float]:
        return [getattr(r, measure) for r in self.rows if getattr(r, measure) is not None]


def group_by_setting(rows: Sequence[Any], overrides: Sequence[Sequence[str]], names: Sequence[str]) -> list[Setting]:
    """The rows grouped by setting, in the order each setting first appears; `overrides[i]` and
    `names[i]` belong to `rows[i]` (a name is the setting's stage name without its seed)."""
    order: dict[tuple[str, ...], list[int]] = {}
    for index, job_overrides in enumerate(overrides):
        order.setdefault(setting_of(job_overrides), []).append(index)
    settings = []
    for indices in order.values():
        members = tuple(rows[i] for i in indices)
        seeds = tuple(s for s in (seed_of(overrides[i]) for i in indices) if s is not None)
        spreads = {measure: Spread.of([getattr(r, measure) for r in members]) for measure, _, _ in MEASURES}
        settings.append(Setting(names[indices[0]], members, seeds, spreads))
    return settings


def has_repeats(settings: Sequence[Setting]) -> bool:
    """Whether any setting ran more than once (else the per-job table says it all)."""
    return any(len(s.rows) > 1 for s in settings)


def table(columns: Sequence[str], rows: Iterable[Sequence[str]], cell: Callable[[str], str],
          text_columns: int = 2) -> list[str]:
    """A Markdown table's lines: the first `text_columns` columns left-aligned, the numbers after
    them right-aligned; `cell` escapes each cell of `rows`."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * text_columns + "---:|" * (len(columns) - text_columns),
            *("| " + " | ".join(cell(c) for c in cells) + " |" for cells in rows)]


def markdown(settings: Sequence[Setting], cell: Callable[[str], str]) -> str:
    """The settings table (mean ± sd (n) of each number) and the differences from the first
    setting with their intervals; `cell` escapes a table cell."""
    measures = [m for m in MEASURES if any(s.spreads[m[0]].n for s in settings)]
    lines = table(["setting", "seeds", "completed", *(heading for _, heading, _ in measures)],
                  ([s.name, ", ".join(s.seeds) or "-", f"{s.completed} of {len(s.rows)}",
                    *(s.spreads[m].text(pattern) for m, _, pattern in measures)] for s in settings), cell)
    compared = [m for m in measures if m[0] in COMPARED]
    if len(settings) < 2 or not compared:
        return "\n".join(lines)
    first = settings[0]
    rows = []
    for setting in settings[1:]:
        found = [(difference(first.values(m), setting.values(m)), pattern) for m, _, pattern in compared]
        rows.append([setting.name, *(d.text(pattern) if d is not None else "-" for d, pattern in found)])
    lines += ["", f"Difference from the first setting ({cell(first.name)}), mean and {CONFIDENCE:.0%} interval "
              "(Welch's t); within the noise where the interval holds 0:", "",
              *table(["setting", *(heading for _, heading, _ in compared)], rows, cell, text_columns=1)]
    return "\n".join(lines)
