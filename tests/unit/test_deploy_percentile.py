"""The latency percentiles of `python -m trainer.deploy bench`: linear interpolation between ranks."""

import pytest

from trainer.deploy.bench import percentile


def test_percentiles_interpolate_between_ranks():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert percentile([5.0, 1.0], 50) == 3.0  # order of arrival does not matter
    with pytest.raises(ValueError):
        percentile([], 50)
