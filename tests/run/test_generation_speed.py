"""benchmarks/generation_speed.py --quick: the cached and uncached generations side by side give the
same tokens (the script refuses otherwise), and the results file names the machine, the command,
both rates and their ratio."""

from __future__ import annotations

import json

import pytest

from tests.helpers import benchmark

pytestmark = pytest.mark.run


def test_the_quick_comparison_writes_both_rates_and_their_ratio(tmp_path):
    generation_speed = benchmark("generation_speed")
    out = tmp_path / "generation.md"
    assert generation_speed.main(["--quick", "--out", str(out)]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    (result,) = record["results"].values()
    assert result["new_tokens"] == 24 and len(result["runs"]["cache"]) == len(result["runs"]["no cache"]) == 1
    assert all(rate > 0 for rates in result["runs"].values() for rate in rates) and result["ratios"][0] > 0
    text = out.read_text()
    assert record["command"].startswith("python benchmarks/generation_speed.py --quick") and "tokens/s" in text
    assert record["machine"] and record["started"] and "| ratio, paired by round |" in text
