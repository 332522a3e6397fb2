"""The batch-scaling rules for lr and weight decay: sqrt, linear and none above and below the
reference batch, the derivation line printed at start ("lr 0.1 at batch 256 -> 0.2 at batch
1024 (sqrt rule, x2)"), and unknown rules or non-positive batches refused."""

import json
import math

import pytest

from tests.helpers import REPO, benchmark
from trainer.groups.optimizer.scaling import (MEASURED_ALTERNATIVES, MEASURED_LIMITS, REGIME, STUDY, MeasuredAlternative,
                                              MeasuredLimit, measured_warnings, scale, scale_factor)


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


def test_a_batch_beyond_a_measured_limit_is_warned_with_the_limit_the_regime_and_the_study(monkeypatch):
    limit = MeasuredLimit(holds_to=512, next_batch=1024, lost=0.023, better_rule="none", better_at=2048, better_by=0.03)
    monkeypatch.setitem(MEASURED_LIMITS, ("sgd", "linear"), limit)
    assert measured_warnings("sgd", "linear", 512) == []
    [warning] = [w for w in measured_warnings("sgd", "linear", 1024) if "measured to hold" in w]
    assert "up to batch 512" in warning and "at 1,024 val accuracy fell 0.023" in warning
    assert REGIME in warning and "a GPU, a larger model or more data may differ" in warning and STUDY in warning
    assert "or optimizer.lr_scaling=none (+0.030 at 2,048)" in warning
    assert "within one point of batch 64" in warning and "short step budget" in warning
    assert not any("measured to hold" in w for w in measured_warnings("sgd", "none", 4096))  # no limit for that rule


def test_a_large_batch_optimizer_called_better_is_suggested_from_its_batch_on(monkeypatch):
    monkeypatch.setitem(MEASURED_ALTERNATIVES, "adamw", MeasuredAlternative("lamb", batch=2048, accuracy=0.93,
                                                                         default_accuracy=0.90))
    assert not any("consider" in w for w in measured_warnings("adamw", "none", 1024))
    [warning] = [w for w in measured_warnings("adamw", "none", 2048) if "consider" in w]
    assert "optimizer=lamb" in warning and "0.930 where adamw reached 0.900" in warning and REGIME in warning


def test_the_measured_figures_are_what_the_rule_finds_in_the_study_s_jobs():
    """MEASURED_LIMITS and MEASURED_ALTERNATIVES are the decision rule's findings on the committed jobs
    file (benchmarks/batch_scaling_report.findings), recomputed here: a limit for each optimizer
    whose defaults stopped holding inside the range, none where they held; an alternative only where
    it was called better."""
    report, study = benchmark("batch_scaling_report"), benchmark("batch_scaling")
    jobs = json.loads((REPO / STUDY).with_name("batch_scaling_cpu_jobs.json").read_text())
    defaults = study.todays_defaults()
    found = report.findings(jobs, defaults)
    for optimizer, limit in found["limits"].items():
        measured = MEASURED_LIMITS.get((optimizer, defaults.of(optimizer)["lr_rule"]))
        if limit.next_batch is None:
            assert measured is None, optimizer
        else:
            assert (measured.holds_to, measured.next_batch) == (limit.holds_to, limit.next_batch), optimizer
            assert measured.lost == pytest.approx(limit.lost, abs=5e-4), optimizer
            assert measured.next_steps == limit.steps, optimizer
    assert set(MEASURED_ALTERNATIVES) == set(found["alternatives"])
    for optimizer, alternative in found["alternatives"].items():
        measured = MEASURED_ALTERNATIVES[optimizer]
        assert (measured.optimizer, measured.batch) == (alternative["optimizer"], alternative["batch"])
        assert measured.accuracy == pytest.approx(alternative["accuracy"], abs=5e-4)
        assert measured.default_accuracy == pytest.approx(alternative["default_accuracy"], abs=5e-4)
