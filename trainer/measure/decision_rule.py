"""The accuracy studies' decision rule, as code: every study (benchmarks/batch_scaling_report.py,
clipping_study.py, lm_batch_scaling.py) calls these functions and keeps no substitute of its own;
docs/practices.md ("How a default is decided") states it in words.

- **A failed run** is one that measured nothing (`failed`): it did not complete (the non-finite
  guard stopped it), its final loss is not finite, or its outcome is missing or not finite. A run
  that completed at a low accuracy did not fail: its measured value enters the test as it is (no
  chance value is put in its place, and no arm is a mean of its survivors).
- **How failures enter**: the measured values go to a t test, the failures are counted separately
  by Fisher's exact test (one-sided: does the other arm fail more often?). Chosen over a rank test
  because the margin below is in the outcome's own units (points of accuracy, nats), which a rank
  test does not keep, and over substituting a value, which invents a number.
- **Paired by seed where arms share seeds**: where both arms ran the same seeds, the test is the
  paired t test on the per-seed differences (the seeds where both measured); otherwise Welch's.
- **Better / worse**: the two-sided p-value (Holm-adjusted within the family) below `ALPHA`.
- **Holds** (non-inferiority): the one-sided test that the other arm is worse by `margin` or more
  is rejected (its p, Holm-adjusted within the family, below `ALPHA`: the one-sided 95% bound lies
  above minus the margin) and the other arm is not called to fail more often. The margin is one
  point of accuracy (`MARGIN`) or, for a language model, `LM_MARGIN` nats per token (a 1% rise of the
  perplexity). Neither shown: *inconclusive*, never "equal".
- **A limit** ("holds to batch B") is the fixed-sequence procedure (`holds_in_sequence`): the
  batches are tested in order away from the reference, each at `ALPHA` unadjusted, and the first
  that does not hold ends the limit (this keeps the family-wise error at `ALPHA` with no correction).
- **Seeds** come from a power calculation (`seeds_for`) on the spread the test uses: the sd of
  the per-seed differences for a paired test, the within-arm sd for Welch's.
Pure functions of numbers."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

#: One point of accuracy: the non-inferiority margin, and the drop a study must be able to see.
MARGIN = 0.01
#: The language model's margin in validation loss per token (nats): exp(0.01) = a 1% higher perplexity.
LM_MARGIN = 0.01
#: The chance of catching a drop of the margin that a study is sized for.
POWER = 0.80
#: The family-wise error rate of one family of comparisons.
ALPHA = 0.05
#: Where a power calculation stops looking (a spread this large needs another design, not more seeds).
MOST_SEEDS = 50

#: An arm: each seed's measured outcome, None where the run failed (`failed`).
Arm = Mapping[int, "float | None"]


def failed(status: str | None, value: float | None, final_loss: float | None = None) -> bool:
    """The one failure rule: a run that did not complete, ended with a non-finite loss or measured
    no finite outcome. A low accuracy is a measured value, not a failure."""
    bad = lambda x: x is None or not math.isfinite(x)  # noqa: E731
    return status != "completed" or bad(value) or (final_loss is not None and not math.isfinite(final_loss))


def outcome(status: str | None, value: float | None, final_loss: float | None = None) -> float | None:
    """The run's outcome as the test reads it: its measured value, None where it failed."""
    return None if failed(status, value, final_loss) else float(value)  # type: ignore[arg-type]


def measured(arm: Arm) -> list[float]:
    return [v for v in arm.values() if v is not None]


def failures(arm: Arm) -> int:
    return sum(v is None for v in arm.values())


def paired(first: Arm, other: Arm) -> bool:
    """Whether two arms are compared seed by seed: they ran the same seeds (two or more)."""
    return len(first) > 1 and set(first) == set(other)


def differences(first: Arm, other: Arm) -> list[float]:
    """`other` minus `first` for each seed where both measured, in seed order."""
    return [other[s] - first[s] for s in sorted(first) if first[s] is not None and other.get(s) is not None]  # type: ignore[operator]


def spread_used(first: Arm, other: Arm) -> float | None:
    """The spread the test uses: the sd of the per-seed differences (paired) or the within-arm sd
    pooled over both arms (Welch's); None with fewer than two values."""
    if paired(first, other):
        diffs = differences(first, other)
        return statistics.stdev(diffs) if len(diffs) > 1 else None
    return pooled_sd([measured(first), measured(other)])


def pooled_sd(groups: Sequence[Sequence[float | None]]) -> float | None:
    """The spread within arms, pooled over every arm with two or more finite values."""
    squares, degrees = 0.0, 0
    for group in groups:
        values = [v for v in group if v is not None and math.isfinite(v)]
        if len(values) > 1:
            squares += statistics.variance(values) * (len(values) - 1)
            degrees += len(values) - 1
    return math.sqrt(squares / degrees) if degrees else None


def _degrees_and_shift(seeds: int, sd: float, drop: float, is_paired: bool) -> tuple[int, float]:
    if is_paired:
        return seeds - 1, drop / (sd / math.sqrt(seeds))
    return 2 * seeds - 2, drop / (sd * math.sqrt(2 / seeds))


def power(seeds: int, sd: float, drop: float = MARGIN, alpha: float = ALPHA, is_paired: bool = False,
          test: str = "difference") -> float:
    """The chance of a call with `seeds` runs an arm on the test's spread `sd` (noncentral t):
    `difference`: a two-sided test at `alpha` calls a true difference `drop`; `noninferiority`: with
    no true difference, the one-sided test at `alpha` shows the arm holds within a margin `drop`."""
    from scipy.stats import nct, t  # scipy comes with scikit-learn; imported only for a study

    if seeds < 2:
        return 0.0
    if sd <= 0:
        return 1.0
    df, shift = _degrees_and_shift(seeds, sd, drop, is_paired)
    if test == "noninferiority":
        return float(1 - nct.cdf(float(t.ppf(1 - alpha, df)), df, shift))
    critical = float(t.ppf(1 - alpha / 2, df))
    return float(1 - nct.cdf(critical, df, shift) + nct.cdf(-critical, df, shift))


def seeds_for(sd: float, family: int = 1, drop: float = MARGIN, alpha: float = ALPHA, wanted: float = POWER,
              is_paired: bool = False, test: str = "difference") -> int:
    """The fewest seeds an arm (at least 2) whose test reaches `wanted` power at Holm's strictest
    level in a family of `family` (`alpha` / family); ValueError past `MOST_SEEDS`."""
    level = alpha / max(family, 1)
    for seeds in range(2, MOST_SEEDS + 1):
        if power(seeds, sd, drop, level, is_paired, test) >= wanted:
            return seeds
    raise ValueError(f"a spread of {sd:.4f} needs more than {MOST_SEEDS} seeds for a margin of {drop:g}")


def detectable_drop(seeds: int, sd: float, family: int = 1, alpha: float = ALPHA, wanted: float = POWER,
                    is_paired: bool = False, test: str = "difference") -> float:
    """The smallest difference (or margin, for `noninferiority`) that `seeds` runs an arm reach with
    probability `wanted` at Holm's strictest level (bisection on `power`)."""
    if seeds < 2:
        return math.inf
    level = alpha / max(family, 1)
    low, high = 0.0, max(sd, 1e-9)
    while power(seeds, sd, high, level, is_paired, test) < wanted:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if power(seeds, sd, middle, level, is_paired, test) < wanted else (low, middle)
    return high


@dataclass(frozen=True)
class Comparison:
    """`other` against `first`: the difference of the means (the mean per-seed difference where
    paired) in the outcome's units, its two-sided 95% interval and p-value, the one-sided
    non-inferiority bound and p-value for `margin`, the failures of each arm and Fisher's one-sided
    p that `other` fails more; the adjusted p-values once its family is corrected."""

    label: str
    value: float
    low: float | None
    high: float | None
    p: float | None
    bound: float | None = None
    p_holds: float | None = None
    failed: tuple[int, int, int, int] = (0, 0, 0, 0)  # first's failures, runs; other's failures, runs
    p_fails: float = 1.0
    margin: float = MARGIN
    higher_is_better: bool = True
    is_paired: bool = False
    adjusted: float | None = None
    adjusted_holds: float | None = None
    adjusted_fails: float | None = None
    undecided: str = ""
    se: float | None = None
    df: float | None = None

    @property
    def gain(self) -> float:
        """The difference signed so that positive is better."""
        return self.value if self.higher_is_better else -self.value

    @property
    def fails_more(self) -> bool:
        return (self.p_fails if self.adjusted_fails is None else self.adjusted_fails) < ALPHA

    @property
    def verdict(self) -> str:
        """better / worse (two-sided, adjusted), else holds (non-inferior within the margin),
        else inconclusive; not decided where no test can be made."""
        if self.fails_more:
            return "worse"
        if self.undecided:
            return "not decided"
        if self.adjusted is None:
            return "uncorrected"
        if self.adjusted < ALPHA:
            return "better" if self.gain > 0 else "worse"
        return "holds" if self.holds else "inconclusive"

    @property
    def holds(self) -> bool:
        """Non-inferior within the margin (adjusted where corrected) and not failing more often."""
        p = self.p_holds if self.adjusted_holds is None else self.adjusted_holds
        return p is not None and p < ALPHA and not self.fails_more

    @property
    def holds_unadjusted(self) -> bool:
        """Non-inferior at `ALPHA` unadjusted, failing no more often (unadjusted): a fixed-sequence step."""
        return self.p_holds is not None and self.p_holds < ALPHA and self.p_fails >= ALPHA

    @property
    def called(self) -> bool:
        return self.verdict in ("better", "worse")

    def text(self, pattern: str = "{:.4f}") -> str:
        signed = "{:+" + pattern[2:]
        shown = signed.format(self.value) + (" paired" if self.is_paired else "")
        fails = (f"; failed {self.failed[2]} of {self.failed[3]} against {self.failed[0]} of {self.failed[1]} "
                 f"(Fisher p={self.p_fails:.3g})" if self.failed[0] or self.failed[2] else "")
        if self.undecided:
            return f"{shown} (not decided: {self.undecided}){fails}"
        adjusted = f", Holm p={self.adjusted:.3g}" if self.adjusted is not None else ""
        side = ">" if self.higher_is_better else "<"
        edge = -self.margin if self.higher_is_better else self.margin
        return (f"{shown} [{signed.format(self.low)}, {signed.format(self.high)}] p={self.p:.3g}{adjusted}; "
                f"one-sided bound {signed.format(self.bound)} {side} {signed.format(edge)}? p={self.p_holds:.3g}"
                + (f" (Holm {self.adjusted_holds:.3g})" if self.adjusted_holds is not None else "")
                + f"{fails}: {self.verdict}" + (" (within the margin: holds)" if self.verdict == "worse" and self.holds else ""))


def _fisher(first: Arm, other: Arm) -> tuple[tuple[int, int, int, int], float]:
    from scipy.stats import fisher_exact

    counts = (failures(first), len(first), failures(other), len(other))
    if not counts[2]:
        return counts, 1.0
    table = [[counts[2], counts[3] - counts[2]], [counts[0], counts[1] - counts[0]]]
    return counts, float(fisher_exact(table, alternative="greater")[1])


def _estimate(first: Arm, other: Arm) -> tuple[float, float, float, bool] | str:
    """The difference, its standard error and degrees of freedom, and whether paired; or why none."""
    if paired(first, other):
        diffs = differences(first, other)
        if len(diffs) < 2:
            return "fewer than 2 seeds measured in both arms"
        se = statistics.stdev(diffs) / math.sqrt(len(diffs))
        return statistics.fmean(diffs), se, float(len(diffs) - 1), True
    a, b = measured(first), measured(other)
    if len(a) < 2 or len(b) < 2:
        return "fewer than 2 seeds measured in an arm"
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / ((va ** 2 / (len(a) - 1) if va else 0) + (vb ** 2 / (len(b) - 1) if vb else 0) or math.inf)
    return statistics.fmean(b) - statistics.fmean(a), se, df, False


def compare(label: str, first: Arm, other: Arm, margin: float = MARGIN, higher_is_better: bool = True,
            confidence: float = 0.95) -> Comparison | None:
    """`other` against `first` (each seed -> its outcome, None for a failed run) by the rule; None
    where neither arm has a run."""
    from scipy.stats import t  # see power()

    if not first or not other:
        return None
    counts, p_fails = _fisher(first, other)
    found = _estimate(first, other)
    if isinstance(found, str) or found[1] == 0.0:
        a, b = measured(first), measured(other)
        value = statistics.fmean(b) - statistics.fmean(a) if a and b else math.nan
        why = found if isinstance(found, str) else \
            "no spread (accuracy is quantized; a zero-width interval proves nothing)"
        return Comparison(label, value, None, None, None, failed=counts, p_fails=p_fails, margin=margin,
                          higher_is_better=higher_is_better, undecided=why)
    value, se, df, is_paired = found
    half = float(t.ppf(0.5 + confidence / 2, df)) * se
    sign = 1.0 if higher_is_better else -1.0
    # Non-inferiority: H0 "worse by the margin or more" (sign * value <= -margin), one-sided.
    p_holds = float(t.sf((sign * value + margin) / se, df))
    bound = value - sign * float(t.ppf(confidence, df)) * se
    return Comparison(label, value, value - half, value + half, float(2 * t.sf(abs(value) / se, df)), bound,
                      p_holds, counts, p_fails, margin, higher_is_better, is_paired, se=se, df=df)


def swapped(found: Comparison, confidence: float = 0.95) -> Comparison:
    """The same comparison read the other way (`first` against `other`): the negated difference, and
    whether `first` holds against `other` within the margin; uncorrected."""
    from scipy.stats import fisher_exact, t  # see power()

    a_failed, a_runs, b_failed, b_runs = found.failed
    p_fails = float(fisher_exact([[a_failed, a_runs - a_failed], [b_failed, b_runs - b_failed]],
                                 alternative="greater")[1]) if a_failed else 1.0
    base = replace(found, value=-found.value, failed=(b_failed, b_runs, a_failed, a_runs), p_fails=p_fails,
                   adjusted=None, adjusted_holds=None, adjusted_fails=None)
    if found.se is None or found.df is None or found.low is None or found.high is None:
        return replace(base, low=None, high=None, bound=None, p_holds=None)
    sign = 1.0 if found.higher_is_better else -1.0
    return replace(base, low=-found.high, high=-found.low, bound=-found.value - sign * float(t.ppf(confidence, found.df)) * found.se,
                   p_holds=float(t.sf((-sign * found.value + found.margin) / found.se, found.df)))


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
    """The family with Holm-adjusted p-values set for each of its three questions (different,
    holds, fails more); m is the number of comparisons that test it."""
    def adjust(p_of: Callable[[Comparison], float | None]) -> dict[int, float]:
        found = {i: p_of(c) for i, c in enumerate(family)}
        tested = [i for i, p in found.items() if p is not None]
        return dict(zip(tested, holm([float(found[i]) for i in tested])))  # type: ignore[arg-type]
    different, holds, fails = adjust(lambda c: c.p), adjust(lambda c: c.p_holds), adjust(lambda c: c.p_fails)
    return [replace(c, adjusted=different.get(i), adjusted_holds=holds.get(i), adjusted_fails=fails.get(i))
            for i, c in enumerate(family)]


def holds_in_sequence(ordered: Sequence[Comparison]) -> int:
    """The fixed-sequence procedure: how many of `ordered` (tested in that order, each unadjusted at
    `ALPHA`) hold before the first that does not. The order must be fixed before the data."""
    for index, found in enumerate(ordered):
        if not found.holds_unadjusted:
            return index
    return len(ordered)
