"""The studies' decision rule (trainer/measure/decision_rule.py): the power calculation, Welch's
test, Holm's correction, and the edges a quantized accuracy and a diverged run bring."""

import math

import pytest
from scipy.stats import ttest_ind

from trainer.measure.decision_rule import (compare, correct, detectable_drop, holm, pooled_sd, power, seeds_for)


def test_power_grows_with_seeds_and_falls_with_spread_and_a_stricter_level():
    assert power(3, 0.004, 0.01) < power(6, 0.004, 0.01) < power(12, 0.004, 0.01)
    assert power(5, 0.006, 0.01) < power(5, 0.003, 0.01)
    assert power(5, 0.004, 0.01, alpha=0.05 / 6) < power(5, 0.004, 0.01, alpha=0.05)
    assert power(1, 0.004, 0.01) == 0.0


def test_three_seeds_catch_a_one_point_drop_about_half_the_time_at_the_audited_spread():
    # The audit's reading of the old studies: sd about 0.0044, three seeds, alpha 0.05.
    assert 0.4 < power(3, 0.0044, 0.01) < 0.6


def test_seeds_for_is_the_fewest_that_reach_the_power_and_grows_with_the_family():
    alone, corrected = seeds_for(0.0035), seeds_for(0.0035, family=6)
    assert power(alone, 0.0035, 0.01) >= 0.8 > power(alone - 1, 0.0035, 0.01)
    assert corrected > alone
    assert power(corrected, 0.0035, 0.01, alpha=0.05 / 6) >= 0.8
    with pytest.raises(ValueError, match="more than"):
        seeds_for(0.2)


def test_detectable_drop_inverts_power():
    drop = detectable_drop(5, 0.0035, family=6)
    assert power(5, 0.0035, drop, alpha=0.05 / 6) == pytest.approx(0.8, abs=1e-3)
    assert detectable_drop(10, 0.0035, family=6) < drop
    assert detectable_drop(1, 0.0035) == math.inf


def test_compare_matches_scipy_welch_and_its_interval_holds_the_difference():
    a, b = [0.95, 0.96, 0.955, 0.962, 0.951], [0.94, 0.945, 0.938, 0.95, 0.943]
    found = compare("b vs a", a, b)
    assert found.value == pytest.approx(sum(b) / 5 - sum(a) / 5)
    assert found.p == pytest.approx(ttest_ind(b, a, equal_var=False).pvalue)
    assert found.low < found.value < found.high < 0


def test_zero_spread_in_both_arms_is_not_decided_even_when_the_means_differ():
    found = correct([compare("quantized", [0.9102] * 3, [0.9120] * 3)])[0]
    assert found.verdict == "not decided" and not found.called
    assert "quantized" in found.text()
    # One arm with spread is a real test (the other's zero variance is fine).
    assert compare("one spread", [0.9102] * 3, [0.91, 0.92, 0.93]).p is not None


def test_non_finite_values_are_left_out_and_an_arm_without_values_compares_nothing():
    assert compare("nan", [0.9, float("nan"), 0.91], [0.92, 0.93]).value == pytest.approx(0.925 - 0.905)
    assert compare("empty", [None, float("nan")], [0.9, 0.91]) is None
    assert compare("one seed", [0.9], [0.9, 0.91]).undecided


def test_holm_adjusts_step_down_in_the_given_order():
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert holm([]) == []


def test_correct_calls_only_what_survives_the_family():
    a = [0.95, 0.951, 0.949, 0.952, 0.948]
    strong = compare("strong", a, [v - 0.02 for v in a])
    weak = compare("weak", a, [0.945, 0.953, 0.940, 0.951, 0.944])
    alone = correct([weak])[0]
    family = correct([strong, weak, *[compare(f"null {i}", a, a[::-1]) for i in range(4)]])
    assert family[0].verdict == "worse"
    assert family[1].adjusted >= alone.adjusted
    assert all(c.verdict == "within the noise" for c in family[2:])
    assert compare("raw", a, a).verdict == "uncorrected"


def test_pooled_sd_weights_each_arm_by_its_degrees_of_freedom():
    assert pooled_sd([[1.0, 3.0], [2.0, 2.0, 2.0], [5.0]]) == pytest.approx(math.sqrt(2 / 3))
    assert pooled_sd([[1.0]]) is None
