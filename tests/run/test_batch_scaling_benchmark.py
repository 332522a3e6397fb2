"""benchmarks/batch_scaling.py --quick, as CI runs it: one AdamW sweep over two batches (64, 128), two lr rules
and one seed on a tenth of the expanded digits ends with the verdict lines, a table row per batch
and rule with the lr each rule gave, the plot, and the sweep's own comparison beside them."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.run


def test_the_quick_study_writes_its_verdicts_table_and_plot(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import batch_scaling
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    out = tmp_path / "batch_scaling.md"
    batch_scaling.main(["--quick", "--out", str(out), "--runs", str(tmp_path / "runs")])
    text = out.read_text()
    # one seed: a difference but no interval, so nothing is called beyond the noise
    assert "- adamw, sqrt rule, val accuracy against batch 64: 128: " in text and "fewer than 2 seeds" in text
    assert "- adamw, sqrt against none: beyond the noise better at no batch; worse at no batch" in text
    # the sqrt rule moves AdamW's 0.004 at batch 256 to 0.002 at 64 and 0.00283 at 128; none keeps it
    for row in ("| 64 | sqrt (default) | 0.002 |", "| 128 | sqrt (default) | 0.00283 |", "| 128 | none | 0.004 |"):
        assert row in text, text
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    assert "## Over seeds" not in (tmp_path / "batch_scaling_adamw_comparison.md").read_text()  # one seed: per job
