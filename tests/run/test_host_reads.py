"""With every default on, no code makes a host read of a tensor value in a training step except at
Lightning's log steps (where the loggers read) and at the throughput meter's window ends (where it
times the window): not the framework's, and not Lightning's or torchmetrics' on the framework's
behalf (a value logged with prog_bar, which Lightning reads after every batch, would be one).
Counted by `callbacks=host_reads` over a real run of two epochs of the default digits training,
validation off, logging every 10 steps. Each read on CUDA would make the host wait for the device;
the count is the same on the CPU, where nothing waits."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_in_process
from trainer.callbacks.throughput import ThroughputMeter

pytestmark = pytest.mark.run

LOG_EVERY = 10


def test_the_defaults_read_nothing_on_the_host_per_step_beyond_log_steps(tmp_path):
    summary = run_in_process(["callbacks=host_reads", "trainer.max_epochs=2", f"trainer.log_every_n_steps={LOG_EVERY}",
                              "trainer.limit_val_batches=0", "checkpointing=off", "progress=off"], tmp_path)
    assert summary["clipping"]["mode"] == "percentile" and summary["nonfinite"]["mode"] == "skip"
    steps = summary["steps"]
    report = json.loads((tmp_path / "host_reads.json").read_text())
    reads = [r for r in report["framework_reads"] if r["step"] is not None]
    # A batch b (counted over the fit from 0) is a log step when Lightning logs after it.
    log_steps = {b for b in range(steps) if (b + 1) % LOG_EVERY == 0}
    meter = [r for r in reads if r["where"].startswith("trainer/callbacks/throughput.py")]
    per_step = [r for r in reads if r["step"] not in log_steps and r not in meter]
    assert per_step == [], f"host reads in training steps that are not log steps: {per_step}"
    library = [r for r in report["library_reads_in_steps"] if r["step"] >= 0 and r["step"] not in log_steps]
    assert library == [], f"Lightning's or torchmetrics' reads in training steps that are not log steps: {library}"
    assert len(meter) <= steps // ThroughputMeter.WINDOW_STEPS + 1  # one per timed window
    at_log_steps = [r for r in reads if r["step"] in log_steps]
    assert len(at_log_steps) <= 2 * len(log_steps)  # one batched read each (two where an epoch ends there)
    # The per-step decisions still happened: every step's norm was observed.
    assert summary["clipping"]["steps_observed"] == steps
