"""On CUDA the framework's per-step work waits for nothing: the percentile clipping and the
non-finite guard run N steps of a small network (fused AdamW, the CUDA default, and foreach AdamW
with capturable step counts) under `torch.cuda.set_sync_debug_mode("error")`, which raises at any
synchronizing call (`.item()`, a blocking copy to or from the host), with NaN steps and spikes
injected; the decisions are then read once and checked. Also the whole default run's host reads
per step on CUDA, counted (`callbacks=host_reads`)."""

from __future__ import annotations

import contextlib
import json
from typing import Iterator

import pytest
import torch

from tests.gpu.common import GPU, guarded_steps
from tests.helpers import run_in_process

pytestmark = [*GPU]


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Any synchronizing CUDA call raises inside."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("kernel", [{"fused": True}, {"foreach": True, "capturable": True}], ids=["fused", "foreach"])
def test_clipping_and_guard_steps_do_not_synchronize(tmp_path, kernel):
    # The optimizer's state and the callbacks' device buffers are made in the first steps (allowed to copy).
    steps = guarded_steps(torch.device("cuda", torch.cuda.current_device()), kernel, tmp_path, watch=no_sync)
    assert steps.guard.summary()["skipped_at"] == [7, 13]  # the NaN steps 5 and 11 after the first 2
    assert steps.clipping.summary()["steps_clipped"] >= 1 and steps.clipping.nonfinite_steps == 2
    assert all(torch.isfinite(p).all() for p in steps.module.parameters())


def test_the_default_run_reads_nothing_per_step_on_cuda(tmp_path):
    summary = run_in_process(["callbacks=host_reads", "trainer.max_epochs=2", "trainer.log_every_n_steps=10",
                              "trainer.limit_val_batches=0", "checkpointing=off", "progress=off"], tmp_path)
    report = json.loads((tmp_path / "host_reads.json").read_text())
    log_steps = {b for b in range(summary["steps"]) if (b + 1) % 10 == 0}
    per_step = [r for r in report["framework_reads"] if r["step"] is not None and r["step"] not in log_steps
                and not r["where"].startswith("trainer/callbacks/throughput.py")]
    assert per_step == [], per_step
