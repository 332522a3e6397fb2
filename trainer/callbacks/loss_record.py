"""The training loss of the first and the last steps, for the run's record and the ladder's table.

The losses stay on the device as detached tensors until training ends, so recording them costs no
synchronization per step. They go into every checkpoint (as numbers), so a resumed run's record
covers its whole training, not only the last attempt's.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from trainer.callbacks.steps import step_loss


class LossRecord(Callback):
    def __init__(self, first_steps: int = 10, last_steps: int = 50) -> None:
        self.first_steps = first_steps
        self.last_steps = last_steps
        self._first: list[torch.Tensor | float] = []
        self._last: deque[torch.Tensor | float] = deque(maxlen=last_steps)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        loss = step_loss(outputs)
        if loss is None:
            return
        loss = loss.detach()
        if len(self._first) < self.first_steps:
            self._first.append(loss)
        self._last.append(loss)

    def state_dict(self) -> dict[str, Any]:
        return {"first": [float(v) for v in self._first], "last": [float(v) for v in self._last]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._first = [float(v) for v in state_dict.get("first", [])][: self.first_steps]
        self._last = deque((float(v) for v in state_dict.get("last", [])), maxlen=self.last_steps)

    def summary(self) -> dict[str, Any]:
        if not self._last:
            return {"first": [], "last_steps": 0, "final": None, "mean": None, "spread": None}
        last = [float(v) for v in self._last]
        finite = [v for v in last if math.isfinite(v)]
        return {
            "first": [float(v) for v in self._first],
            "last_steps": len(last),
            "final": last[-1],
            "mean": statistics.fmean(finite) if finite else None,
            # Standard deviation over the last steps: how noisy training still is at the end.
            "spread": statistics.pstdev(finite) if len(finite) > 1 else 0.0,
            "min": min(finite) if finite else None,
            "max": max(finite) if finite else None,
            "non_finite": len(last) - len(finite),
        }
