"""benchmarks/shard_pipeline.py at its smallest (64 photos, one round), as CI runs it: the four
pipelines, the folder, local shards and the S3 server's first and cached epochs, each get a row
with a rate and a time to the first batch, and the command that made it."""

from __future__ import annotations

import os
import re

import pytest

from tests.helpers import benchmark

pytest.importorskip("litdata")
pytest.importorskip("moto")


@pytest.mark.run
def test_the_smallest_run_times_all_four_pipelines(tmp_path):
    def store_settings() -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k.startswith("AWS_") or k == "SSL_CERT_FILE"}

    before = store_settings()
    out = tmp_path / "shard_pipeline.md"
    benchmark("shard_pipeline").main(["--images", "64", "--rounds", "1", "--out", str(out)])
    text = out.read_text()
    for name in ("folder", "shards, local", "shards, S3, first epoch", "shards, S3, cached"):
        row = re.search(rf"^\| {re.escape(name)} \| ([\d,]+) .*\| ([\d.]+) \(", text, re.MULTILINE)
        assert row and float(row.group(1).replace(",", "")) > 0 and float(row.group(2)) > 0, (name, text)
    assert "`python benchmarks/shard_pipeline.py" in text
    assert store_settings() == before  # the server's AWS settings do not outlive the benchmark
