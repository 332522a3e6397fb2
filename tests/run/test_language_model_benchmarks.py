"""The language model's benchmarks in their quick modes, as CI runs them.

benchmarks/lm_batch_scaling.py: two lr rules at two token batches (512 and 1,024), one seed, three
steps each, end with the verdict lines (no interval from one seed, so nothing called beyond the
noise), a row per batch and rule with the lr each rule gave, the plot and the jobs file (with each
sweep's command, start, duration and machine) the report is written from again."""

from __future__ import annotations

import json

import pytest

from tests.forked_jobs import fork_study_jobs
from tests.helpers import benchmark


@pytest.mark.run
def test_the_quick_language_model_study_writes_its_verdicts_table_jobs_and_plot(tmp_path, monkeypatch):
    fork_study_jobs(monkeypatch)
    study = benchmark("lm_batch_scaling")
    out = tmp_path / "lm.md"
    study.main(["--quick", "--out", str(out)])
    text = out.read_text()
    assert "- sqrt (default), against 1,024 tokens: 512: " in text and "fewer than 2 seeds" in text
    assert "- sqrt against linear: better at no batch; worse at no batch; holds (within 0.01 nats) at no batch" in text
    assert "Hypothesis, not a finding" in text
    # lr 3e-3 at 1,024 tokens: sqrt gives 0.00212 at 512 tokens, linear 0.0015; both 0.003 at 1,024
    for row in ("| 512 | sqrt | 0.00212 |", "| 512 | linear | 0.0015 |", "| 1,024 | sqrt | 0.003 |"):
        assert row in text, text
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    jobs = json.loads((tmp_path / "lm_jobs.json").read_text())
    assert sorted((j["rule"], j["tokens"]) for j in jobs) == [("linear", 512), ("linear", 1024), ("sqrt", 512),
                                                               ("sqrt", 1024)]
    assert all(j["status"] == "completed" and j["val_loss"] > 0 and j["sweep"]["command"].startswith("python train.py -m")
               and j["sweep"]["started"] and j["sweep"]["sweep_s"] > 0 and j["machine"] for j in jobs)
    # each job's own provenance: the command that reruns it alone, its times and the load beside it
    assert all(j["command"].startswith("python train.py ") and j["started"] <= j["ended"] and j["duration_s"] > 0
               and isinstance(j["beside_load"], bool) for j in jobs)
    assert all(j["design"]["files"] == ["benchmarks/lm_batch_scaling.py", "trainer/measure/decision_rule.py"] for j in jobs)
    out.unlink()
    study.main(["--report-only", "--out", str(out)])
    assert "| 512 | linear | 0.0015 |" in out.read_text()


@pytest.mark.run
def test_the_quick_input_side_benchmark_writes_its_table(tmp_path):
    """benchmarks/text_pipeline.py --quick: the loader's tokens/s per core, packed and bucketed, and
    the step's, with the cores it takes to feed the step."""
    out = tmp_path / "text_pipeline.md"
    benchmark("text_pipeline").main(["--quick", "--out", str(out)])
    text = out.read_text()
    assert "| loader, packed |" in text and "| loader, bucketed |" in text and "| the step consumes |" in text
    assert "python benchmarks/text_pipeline.py" in text and "interleaved rounds" in text
