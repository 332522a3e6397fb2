"""The batch-scaling rules for lr and weight decay: sqrt, linear and none above and below the
reference batch, the derivation line printed at start ("lr 0.1 at batch 256 -> 0.2 at batch
1024 (sqrt rule, x2)"), and unknown rules or non-positive batches refused."""

import math

import pytest

from trainer.scaling import scale, scale_factor


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
