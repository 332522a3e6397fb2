"""The studies' decision rule (trainer/measure/decision_rule.py): the failure rule, the paired and
Welch tests, the non-inferiority test, Fisher's count of failures, Holm's correction, the fixed
sequence of a limit and the power calculation, against values computed by hand (df 2 and df 1 have
closed forms: sf(t) = (1 - t / sqrt(t^2 + 2)) / 2 and sf(t) = 1/2 - atan(t) / pi)."""

import math

import pytest
from scipy.stats import ttest_ind, ttest_rel

from trainer.measure.decision_rule import (compare, correct, detectable_drop, failed, holds_in_sequence, holm, outcome,
                                           pooled_sd, power, seeds_for, spread_used, swapped)


def by_seed(values):
    return dict(enumerate(values, start=1))


def test_the_failure_rule_counts_runs_that_measured_nothing_not_runs_that_measured_little():
    assert not failed("completed", 0.14)  # a run stalled near chance measured 0.14: a value, not a failure
    assert failed("stopped", 0.9) and failed("completed", None) and failed("completed", float("nan"))
    assert failed("completed", 0.9, final_loss=float("inf")) and not failed("completed", 0.9, final_loss=2.3)
    assert outcome("completed", 0.14) == 0.14 and outcome("stopped", 0.9) is None


def test_paired_by_seed_where_the_arms_share_seeds_with_the_hand_computed_values():
    first, other = {1: 0.90, 2: 0.92, 3: 0.94}, {1: 0.91, 2: 0.92, 3: 0.96}
    found = compare("paired", first, other)
    # differences 0.01, 0.00, 0.02: mean 0.01, sd 0.01, se 0.01/sqrt(3), df 2, t = sqrt(3)
    assert found.is_paired and found.value == pytest.approx(0.01)
    assert found.p == pytest.approx(1 - math.sqrt(3) / math.sqrt(5), abs=1e-9)  # 0.2254
    assert found.p == pytest.approx(ttest_rel([0.91, 0.92, 0.96], [0.90, 0.92, 0.94]).pvalue)
    # holds within one point: t = (0.01 + 0.01) / se = sqrt(12), p = (1 - sqrt(12/14)) / 2 = 0.0371
    assert found.p_holds == pytest.approx((1 - math.sqrt(12 / 14)) / 2, abs=1e-9)
    assert found.bound == pytest.approx(0.01 - 2.919986 * 0.01 / math.sqrt(3), abs=1e-6) and found.bound > -0.01
    assert spread_used(first, other) == pytest.approx(0.01)
    checked = correct([found])[0]
    assert checked.verdict == "holds" and checked.holds and not checked.called


def test_welch_where_the_seeds_differ_and_its_interval_holds_the_difference():
    a, b = [0.95, 0.96, 0.955, 0.962, 0.951], [0.94, 0.945, 0.938, 0.95, 0.943]
    found = compare("b vs a", by_seed(a), {s + 10: v for s, v in by_seed(b).items()})
    assert not found.is_paired
    assert found.value == pytest.approx(sum(b) / 5 - sum(a) / 5)
    assert found.p == pytest.approx(ttest_ind(b, a, equal_var=False).pvalue)
    assert found.low < found.value < found.high < 0
    assert correct([found])[0].verdict == "worse"


def test_lower_is_better_for_a_loss_and_its_margin_in_nats():
    # differences 0.005, 0.015: mean 0.01 = the margin exactly, so t = 0 and p = 1/2 (df 1)
    found = compare("loss", {0: 3.00, 1: 3.02}, {0: 3.005, 1: 3.035}, margin=0.01, higher_is_better=False)
    assert found.value == pytest.approx(0.01) and found.gain == pytest.approx(-0.01)
    assert found.p_holds == pytest.approx(0.5)
    assert found.bound > found.value  # the bound of a loss lies above its difference
    better = compare("loss", {0: 3.00, 1: 3.02}, {0: 2.99, 1: 3.00}, margin=0.01, higher_is_better=False)
    # differences -0.01, -0.02: mean -0.015, se 0.005, t = (0.015 + 0.01) / 0.005 = 5, p = 1/2 - atan(5)/pi
    assert better.p_holds == pytest.approx(0.5 - math.atan(5) / math.pi)


def test_failures_are_counted_by_fisher_s_exact_test_and_their_pairs_left_out():
    first = by_seed([0.90, 0.91, 0.92, 0.93, 0.94])
    other = {1: None, 2: None, 3: None, 4: 0.93, 5: 0.95}
    found = compare("fails", first, other)
    # all three failures in the other arm: C(5,3) / C(10,3) = 1/12
    assert found.failed == (0, 5, 3, 5) and found.p_fails == pytest.approx(1 / 12)
    assert found.value == pytest.approx(0.005)  # the pairs of seeds 4 and 5
    assert "failed 3 of 5" in found.text()
    six = compare("six", {s: 0.9 + s / 100 for s in range(6)}, {s: None for s in range(6)})
    assert six.p_fails == pytest.approx(1 / 924) and six.verdict == "worse" and not six.holds  # 1 / C(12,6)


def test_zero_spread_is_not_decided_and_too_few_seeds_neither():
    found = correct([compare("quantized", by_seed([0.9102] * 3), by_seed([0.9120] * 3))])[0]
    assert found.verdict == "not decided" and not found.called and "quantized" in found.text()
    assert compare("one seed", {1: 0.9}, {1: 0.9}).undecided
    assert compare("empty", {}, {1: 0.9}) is None


def test_holm_adjusts_step_down_in_the_given_order():
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert holm([]) == []


def test_correct_adjusts_each_question_within_the_family():
    a = by_seed([0.95, 0.951, 0.949, 0.952, 0.948])
    strong = compare("strong", a, {s: v - 0.02 + e for (s, v), e in zip(a.items(), (1e-3, -1e-3, 2e-3, 0, -2e-3))})
    null = compare("null", a, by_seed([0.951, 0.949, 0.952, 0.948, 0.95]))
    family = correct([strong, null])
    assert family[0].verdict == "worse"
    assert family[1].adjusted == pytest.approx(min(1.0, 2 * null.p) if null.p > strong.p else null.p)
    assert family[1].adjusted_holds == pytest.approx(holm([strong.p_holds, null.p_holds])[1])
    assert family[1].verdict == "holds"
    assert null.verdict == "uncorrected"


def test_a_limit_is_the_fixed_sequence_up_to_the_first_step_that_does_not_hold():
    a = by_seed([0.95, 0.951, 0.949, 0.952, 0.948])
    noise = (1e-3, -1e-3, 2e-3, 0, -2e-3)
    steps = [compare(str(d), a, {s: v - d + e for (s, v), e in zip(a.items(), noise)}) for d in (0.0, 0.001, 0.03, 0.0)]
    assert holds_in_sequence(steps) == 2  # the third (3 points down) ends it; the fourth is never tested
    assert holds_in_sequence([]) == 0


def test_power_on_the_spread_the_test_uses():
    assert power(3, 0.004, 0.01) < power(6, 0.004, 0.01) < power(12, 0.004, 0.01)
    assert power(5, 0.004, 0.01, alpha=0.05 / 6) < power(5, 0.004, 0.01)
    assert power(1, 0.004, 0.01) == 0.0 and power(3, 0.0, 0.01) == 1.0
    # The audit's reading of the old studies: sd 0.0044, three seeds, alpha 0.05, about half.
    assert 0.4 < power(3, 0.0044, 0.01) < 0.6
    # Paired with the same sd of differences as Welch's within-arm sd: fewer degrees of freedom, a
    # smaller standard error (sd/sqrt(n) against sd*sqrt(2/n)): more power.
    assert power(5, 0.004, 0.01, is_paired=True) > power(5, 0.004, 0.01)
    # Non-inferiority at a margin of one sd of the mean difference is the one-sided test's power.
    assert power(50, 0.001, 0.01, test="noninferiority") == pytest.approx(1.0)
    assert power(5, 0.01, 0.01, test="noninferiority") < power(5, 0.01, 0.01, alpha=0.10)


def test_seeds_for_and_detectable_drop_invert_the_power():
    alone, corrected = seeds_for(0.0035), seeds_for(0.0035, family=6)
    assert power(alone, 0.0035, 0.01) >= 0.8 > power(alone - 1, 0.0035, 0.01)
    assert corrected > alone
    held = seeds_for(0.005, family=3, is_paired=True, test="noninferiority")
    assert power(held, 0.005, 0.01, 0.05 / 3, True, "noninferiority") >= 0.8 > power(held - 1, 0.005, 0.01, 0.05 / 3, True,
                                                                                        "noninferiority")
    with pytest.raises(ValueError, match="more than"):
        seeds_for(0.2)
    drop = detectable_drop(5, 0.0035, family=6)
    assert power(5, 0.0035, drop, alpha=0.05 / 6) == pytest.approx(0.8, abs=1e-3)
    assert detectable_drop(1, 0.0035) == math.inf


def test_pooled_sd_weights_each_arm_by_its_degrees_of_freedom():
    assert pooled_sd([[1.0, 3.0], [2.0, 2.0, 2.0], [5.0]]) == pytest.approx(math.sqrt(2 / 3))
    assert pooled_sd([[1.0]]) is None


def test_swapped_reads_the_same_runs_the_other_way():
    first, other = {1: 0.90, 2: 0.92, 3: 0.94}, {1: 0.91, 2: 0.92, 3: 0.96}
    there, back = compare("there", first, other), compare("back", other, first)
    read = swapped(there)
    assert read.value == pytest.approx(back.value) and read.p == pytest.approx(back.p)
    assert (read.low, read.high) == pytest.approx((back.low, back.high))
    assert read.p_holds == pytest.approx(back.p_holds) and read.bound == pytest.approx(back.bound)
    # -0.01 mean: t = (-0.01 + 0.01) / se = 0, p = 1/2: the first arm is not shown to hold
    assert read.p_holds == pytest.approx(0.5)
    fails = compare("fails", {1: None, 2: 0.9, 3: 0.91}, {1: 0.9, 2: 0.91, 3: 0.92})
    assert swapped(fails).failed == (0, 3, 1, 3) and swapped(fails).p_fails == pytest.approx(0.5)
