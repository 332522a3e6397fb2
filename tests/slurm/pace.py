"""A test's callback that makes each training step (or test batch) of a job's first attempt last a
given time (a sleep: no CPU, no change to what is computed), so that the run outlasts a SLURM time limit without
keeping two cores busy. A requeued attempt (SLURM_RESTART_COUNT > 0) trains at full speed: SLURM
may signal a requeued job early (its timing is coarse), and pacing every attempt would only add
requeues to the test's time, not test anything more."""

from __future__ import annotations

import os
import time
from typing import Any

from lightning.pytorch.callbacks import Callback


class StepPace(Callback):
    def __init__(self, seconds_per_step: float = 0.0, seconds_per_test_batch: float = 0.0) -> None:
        self.seconds_per_step = seconds_per_step
        self.seconds_per_test_batch = seconds_per_test_batch
        self.first_attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.first_attempt:
            time.sleep(self.seconds_per_step)

    def on_test_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        if self.first_attempt:
            time.sleep(self.seconds_per_test_batch)
