"""The accuracy studies' decision rule, written before their runs; docs/practices.md ("How a default
is decided") states it in full. Seeds per arm come from a power calculation (a drop of `MARGIN`
caught with probability `POWER` by a two-sided Welch test at Holm's strictest level, `ALPHA` / m); a
difference is called only where its Holm-adjusted p-value is below `ALPHA`; two arms without any
spread are "not decided" (accuracy is quantized, so seeds can agree exactly). Pure functions of
numbers: the studies (benchmarks/batch_scaling.py, clipping_study.py) apply them."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

from trainer.measure.seed_groups import finite, welch

#: One point of accuracy: the smallest drop a study must be able to see.
MARGIN = 0.01
#: The chance of catching a drop of MARGIN that a study is sized for.
POWER = 0.80
#: The family-wise error rate of one family of comparisons.
ALPHA = 0.05
#: Where a power calculation stops looking (a spread this large needs another design, not more seeds).
MOST_SEEDS = 50


def power(seeds: int, sd: float, drop: float = MARGIN, alpha: float = ALPHA) -> float:
    """The chance that a two-sided t test at level `alpha` calls a true difference `drop` between
    two arms of `seeds` runs each with spread `sd` (noncentral t, 2n - 2 degrees of freedom: Welch's
    test with equal spreads and n)."""
    from scipy.stats import nct, t  # scipy comes with scikit-learn; imported only for a study

    if seeds < 2:
        return 0.0
    if sd <= 0:
        return 1.0
    df = 2 * seeds - 2
    shift = drop / (sd * math.sqrt(2 / seeds))
    critical = float(t.ppf(1 - alpha / 2, df))
    return float(1 - nct.cdf(critical, df, shift) + nct.cdf(-critical, df, shift))


def seeds_for(sd: float, family: int = 1, drop: float = MARGIN, alpha: float = ALPHA, wanted: float = POWER) -> int:
    """The fewest seeds per arm (at least 2) that catch `drop` with probability `wanted` at Holm's
    strictest level in a family of `family` comparisons (`alpha` / family); ValueError past `MOST_SEEDS`."""
    level = alpha / max(family, 1)
    for seeds in range(2, MOST_SEEDS + 1):
        if power(seeds, sd, drop, level) >= wanted:
            return seeds
    raise ValueError(f"a spread of {sd:.4f} needs more than {MOST_SEEDS} seeds to catch a drop of {drop:g}")


def detectable_drop(seeds: int, sd: float, family: int = 1, alpha: float = ALPHA, wanted: float = POWER) -> float:
    """The smallest true difference that `seeds` runs per arm catch with probability `wanted` at
    Holm's strictest level (bisection on `power`): what "within the noise" rules out."""
    if seeds < 2:
        return math.inf
    level = alpha / max(family, 1)
    low, high = 0.0, max(sd, 1e-9)
    while power(seeds, sd, high, level) < wanted:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if power(seeds, sd, middle, level) < wanted else (low, middle)
    return high


def pooled_sd(groups: Sequence[Sequence[float | None]]) -> float | None:
    """The spread within arms, pooled over every arm with two or more finite values."""
    squares, degrees = 0.0, 0
    for group in groups:
        values = finite(group)
        if len(values) > 1:
            squares += statistics.variance(values) * (len(values) - 1)
            degrees += len(values) - 1
    return math.sqrt(squares / degrees) if degrees else None


@dataclass(frozen=True)
class Comparison:
    """`other` against `first`: the difference of the means, Welch's 95% interval, the raw and (once
    its family is corrected) Holm-adjusted p-value, and why nothing was called where nothing can be."""

    label: str
    value: float
    low: float | None
    high: float | None
    p: float | None
    adjusted: float | None = None
    undecided: str = ""

    @property
    def verdict(self) -> str:
        """better / worse (beyond the noise after the correction), within the noise, or not decided."""
        if self.undecided:
            return "not decided"
        if self.adjusted is None:
            return "uncorrected"
        if self.adjusted < ALPHA:
            return "better" if self.value > 0 else "worse"
        return "within the noise"

    @property
    def called(self) -> bool:
        return self.verdict in ("better", "worse")

    def text(self, pattern: str = "{:.4f}") -> str:
        signed = "{:+" + pattern[2:]
        shown = signed.format(self.value)
        if self.undecided:
            return f"{shown} (not decided: {self.undecided})"
        interval = f"[{signed.format(self.low)}, {signed.format(self.high)}]"
        adjusted = f", Holm p={self.adjusted:.3g}" if self.adjusted is not None else ""
        verdict = {"better": "beyond the noise", "worse": "beyond the noise"}.get(self.verdict, self.verdict)
        return f"{shown} {interval} p={self.p:.3g}{adjusted}: {verdict}"


def compare(label: str, first: Sequence[float | None], other: Sequence[float | None],
            confidence: float = 0.95) -> Comparison | None:
    """`other`'s mean minus `first`'s with Welch's interval and two-sided p-value; None where either
    arm has no finite value."""
    from scipy.stats import t  # see power()

    a, b = finite(first), finite(other)
    if not a or not b:
        return None
    if len(a) < 2 or len(b) < 2:
        return Comparison(label, statistics.fmean(b) - statistics.fmean(a), None, None, None,
                          undecided="fewer than 2 seeds in an arm")
    value, se, df = welch(a, b)
    if se == 0.0:
        return Comparison(label, value, None, None, None,
                          undecided="no spread in either arm (accuracy is quantized; a zero-width interval proves nothing)")
    half = float(t.ppf(0.5 + confidence / 2, df)) * se
    p = float(2 * t.sf(abs(value) / se, df))
    return Comparison(label, value, value - half, value + half, p)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the given order: sorted ascending, the i-th (from 0)
    times (m - i), made non-decreasing, capped at 1. Controls the family-wise error rate at any level."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def correct(family: Sequence[Comparison]) -> list[Comparison]:
    """The family with each decidable comparison's Holm-adjusted p-value set; the family's size m is
    the number of decidable comparisons (the undecided ones test nothing)."""
    decidable = [c for c in family if c.p is not None]
    adjusted = dict(zip((id(c) for c in decidable), holm([c.p for c in decidable])))  # type: ignore[misc]
    return [Comparison(c.label, c.value, c.low, c.high, c.p, adjusted.get(id(c)), c.undecided) for c in family]
