"""The batch-scaling rules for lr and weight decay: sqrt, linear and none above and below the
reference batch, the derivation line printed at start ("lr 0.1 at batch 256 -> 0.2 at batch
1024 (sqrt rule, x2)"), and unknown rules or non-positive batches refused."""

import math
import re

import pytest

from tests.helpers import REPO
from trainer.groups.optimizer.scaling import (MEASURED_ALTERNATIVES, MEASURED_LIMITS, STUDY, measured_warnings, scale,
                                              scale_factor)


@pytest.mark.parametrize("rule, expected", [("sqrt", 2.0), ("linear", 4.0), ("none", 1.0)])
def test_rules_at_four_times_the_reference_batch(rule, expected):
    assert scale_factor(rule, 1024, 256) == pytest.approx(expected)


def test_smaller_batches_scale_down():
    assert scale_factor("sqrt", 64, 256) == pytest.approx(0.5)
    assert scale_factor("linear", 64, 256) == pytest.approx(0.25)


def test_scale_says_how():
    lr = scale("lr", 0.1, "sqrt", 1024, 256)
    assert lr.value == pytest.approx(0.2)
    assert lr.how == "lr 0.1 at batch 256 -> 0.2 at batch 1024 (sqrt rule, x2)"
    wd = scale("weight_decay", 0.05, "none", 1024, 256)
    assert wd.value == 0.05 and "no batch scaling" in wd.how


def test_bad_rule_or_batch():
    with pytest.raises(ValueError):
        scale_factor("cubic", 64, 256)
    with pytest.raises(ValueError):
        scale_factor("sqrt", 0, 256)
    assert math.isclose(scale_factor("sqrt", 256, 256), 1.0)


def test_a_batch_beyond_the_measured_limit_of_a_rule_is_warned_with_the_limit():
    limit = MEASURED_LIMITS["sgd", "linear"]
    assert measured_warnings("sgd", "linear", limit.holds_to) == []
    [warning] = measured_warnings("sgd", "linear", limit.holds_to * 2)
    assert f"up to batch {limit.holds_to:,}" in warning and f"at {limit.next_batch:,}" in warning
    assert "benchmarks/results/batch_scaling_cpu.md" in warning
    assert f"or optimizer.lr_scaling={limit.better_rule} ({limit.better_by:+.3f} at {limit.better_at:,})" in warning
    assert measured_warnings("sgd", "none", limit.holds_to * 2) == []  # no limit measured for that rule


def test_a_batch_where_a_large_batch_optimizer_did_better_suggests_it():
    alternative = MEASURED_ALTERNATIVES["adamw"]
    assert not any("consider" in w for w in measured_warnings("adamw", "none", alternative.batch // 2))
    [warning] = [w for w in measured_warnings("adamw", "none", alternative.batch) if "consider" in w]
    assert f"optimizer={alternative.optimizer}" in warning and f"{alternative.accuracy:.3f}" in warning
    assert measured_warnings("adamw", "linear", 1024) == []  # neither a limit nor LAMB's lead measured there
    # LARS beat SGD's old linear default, not its sqrt one: no suggestion for SGD
    assert not any("consider" in w for w in measured_warnings("sgd", "sqrt", 2048))


def test_sgd_s_default_sqrt_rule_is_warned_beyond_where_it_held():
    limit = MEASURED_LIMITS["sgd", "sqrt"]
    assert measured_warnings("sgd", "sqrt", limit.holds_to) == []
    [warning] = measured_warnings("sgd", "sqrt", limit.next_batch)
    assert f"up to batch {limit.holds_to:,}" in warning and "or optimizer.lr_scaling" not in warning


def test_adamw_beyond_its_measured_limit_is_told_the_limit_and_lamb():
    limit, alternative = MEASURED_LIMITS["adamw", "sqrt"], MEASURED_ALTERNATIVES["adamw"]
    assert measured_warnings("adamw", "sqrt", limit.holds_to) == []
    limit_warning, lamb_warning = measured_warnings("adamw", "sqrt", limit.next_batch)
    assert f"up to batch {limit.holds_to:,}" in limit_warning and "or optimizer.lr_scaling" not in limit_warning
    assert "optimizer=lamb" in lamb_warning and f"{alternative.default_accuracy:.3f}" in lamb_warning


def _verdict(study: str, start: str) -> str:
    return re.search(re.escape(start) + "(.*)", study).group(1)


def _difference_at(verdict: str, batch: int) -> float:
    """The difference a verdict line gives at `batch`, where it is beyond the noise."""
    return float(re.search(rf"(?:^|; ){batch:,}: ([-+]\d\.\d+) \[[^]]+\] beyond the noise", verdict).group(1))


def test_the_measured_figures_are_the_study_s_own_verdicts():
    """Each limit and alternative quotes the committed study: the largest batch it says the rule
    holds to and the next batch's difference from batch 64; the alternative's difference from the
    default optimizer at its batch, beyond the noise. A rule without a limit held over the whole range."""
    study = (REPO / STUDY).read_text()
    for (optimizer, rule), limit in MEASURED_LIMITS.items():
        assert f"- {optimizer}, {rule} rule: within the noise of batch 64 (or above it) up to batch {limit.holds_to:,}\n" in study
        against_64 = _verdict(study, f"- {optimizer}, {rule} rule, val accuracy against batch 64: ")
        assert _difference_at(against_64, limit.next_batch) == pytest.approx(-limit.lost, abs=5e-4), (optimizer, rule)
        if limit.better_rule:
            against_better = _verdict(study, f"- {optimizer}, {rule} against {limit.better_rule}: ")
            worse = re.search(rf"worse at [^;]*\b{limit.better_at:,} \(([-+]\d\.\d+)\)", against_better).group(1)
            assert float(worse) == pytest.approx(-limit.better_by, abs=5e-4), (optimizer, rule)
    for optimizer, alternative in MEASURED_ALTERNATIVES.items():
        against = _verdict(study, f"- {alternative.optimizer} against {optimizer} (")
        against = against.split("val accuracy: ", 1)[1]
        assert _difference_at(against, alternative.batch) == pytest.approx(
            alternative.accuracy - alternative.default_accuracy, abs=1e-3), optimizer
