"""benchmarks/clipping_study.py --quick, as CI runs it: the fragile and the stable setting, clipping off and
percentile, one seed, one epoch of a 2-copy set. Each job's spikes, clipped share and divergence come
from its own summary.json; the report has verdicts, a table per setting and a plot."""

from __future__ import annotations

import json

import pytest

from tests.helpers import benchmark

pytestmark = pytest.mark.run


def test_the_quick_study_writes_its_verdicts_tables_jobs_and_plot(tmp_path):
    clipping_study = benchmark("clipping_study")
    out = tmp_path / "clipping.md"
    clipping_study.main(["--quick", "--out", str(out), "--runs", str(tmp_path / "runs")])
    text = out.read_text()
    assert "- fragile, percentile against off: val acc " in text and "fewer than 2 seeds" in text
    assert "### fragile" in text and "### stable" in text and "| percentile (default) |" in text
    jobs = {(j["setting"], j["arm"]): j for j in json.loads((tmp_path / "clipping_jobs.json").read_text())}
    assert set(jobs) == {("fragile", "off"), ("fragile", "percentile"), ("stable", "off"), ("stable", "percentile")}
    # SGD's 0.8 at batch 256, moved to batch 64 by its linear rule, in the fragile setting only
    assert jobs["fragile", "off"]["lr"] == pytest.approx(0.2) and jobs["stable", "off"]["lr"] == pytest.approx(0.002)
    for job in jobs.values():
        assert isinstance(job["spikes"], int) and isinstance(job["diverged"], bool)
        assert job["clipped_share"] == 0.0  # off never clips; percentile is still calibrating (100 steps)
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
