"""The training loss of the first and the last steps, and its spikes, for the run's record and the
ladder's table.

The losses stay on the device as detached tensors, read back in one synchronization every
`spike_window` steps (to count spikes) and at the end, so recording them costs no synchronization
per step. A spike is a step whose loss is above `spike_factor` times the median of the steps before
it (up to `spike_window` of them, at least `MIN_HISTORY`): the measure the clipping study reports.
Everything goes into every checkpoint (as numbers), so a resumed run's record covers its whole
training, not only the last attempt's.
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

MIN_HISTORY = 10  # steps before the first one that can count as a spike


def _numbers(values: list[torch.Tensor | float]) -> list[float]:
    """Losses as floats, with one device synchronization for all the tensors among them."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if len(tensors) == len(values) and tensors:
        return torch.stack([t.float().reshape(()) for t in tensors]).tolist()
    return [float(v) for v in values]


class LossRecord(Callback):
    def __init__(self, first_steps: int = 10, last_steps: int = 50, spike_factor: float = 3.0,
                 spike_window: int = 50) -> None:
        self.first_steps = first_steps
        self.last_steps = last_steps
        self.spike_factor = spike_factor
        self.spike_window = spike_window
        self.min_history = min(MIN_HISTORY, spike_window)  # steps a loss is judged against, at least
        self._first: list[torch.Tensor | float] = []
        self._last: deque[torch.Tensor | float] = deque(maxlen=last_steps)
        self._pending: list[torch.Tensor | float] = []
        self._recent: deque[float] = deque(maxlen=spike_window)
        self.steps = 0  # steps judged for spikes
        self.spikes = 0
        self.first_spike: int | None = None  # the step (counted from 1) of the first spike

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        loss = step_loss(outputs)
        if loss is None:
            return
        loss = loss.detach()
        if len(self._first) < self.first_steps:
            self._first.append(loss)
        self._last.append(loss)
        self._pending.append(loss)
        if len(self._pending) >= self.spike_window:
            self._judge_pending()

    def _judge_pending(self) -> None:
        """Count the spikes among the losses not yet judged, each against the median of the finite
        losses before it. A non-finite loss is not a spike (the record counts those apart) and does
        not enter the history."""
        for value in _numbers(self._pending):
            self.steps += 1
            if not math.isfinite(value):
                continue
            if len(self._recent) >= self.min_history and value > self.spike_factor * statistics.median(self._recent):
                self.spikes += 1
                if self.first_spike is None:
                    self.first_spike = self.steps
            self._recent.append(value)
        self._pending = []

    def state_dict(self) -> dict[str, Any]:
        self._judge_pending()
        return {"first": [float(v) for v in self._first], "last": [float(v) for v in self._last],
                "recent": list(self._recent), "steps": self.steps, "spikes": self.spikes,
                "first_spike": self.first_spike}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        first: list[torch.Tensor | float] = [float(v) for v in state_dict.get("first", [])]
        self._first = first[: self.first_steps]
        self._last = deque((float(v) for v in state_dict.get("last", [])), maxlen=self.last_steps)
        self._recent = deque((float(v) for v in state_dict.get("recent", [])), maxlen=self.spike_window)
        self._pending = []
        self.steps = int(state_dict.get("steps", 0))
        self.spikes = int(state_dict.get("spikes", 0))
        self.first_spike = state_dict.get("first_spike")

    def summary(self) -> dict[str, Any]:
        self._judge_pending()
        spikes = {"spikes": self.spikes, "first_spike": self.first_spike,
                  "spike_rule": f"loss above {self.spike_factor:g}x the median of the previous "
                                f"{self.spike_window} steps (from step {self.min_history + 1})"}
        if not self._last:
            return {"first": [], "last_steps": 0, "final": None, "mean": None, "spread": None, **spikes}
        last = _numbers(list(self._last))
        finite = [v for v in last if math.isfinite(v)]
        return {
            "first": _numbers(self._first) if self._first else [],
            "last_steps": len(last),
            "final": last[-1],
            "mean": statistics.fmean(finite) if finite else None,
            # Standard deviation over the last steps: how noisy training still is at the end.
            "spread": statistics.pstdev(finite) if len(finite) > 1 else 0.0,
            "min": min(finite) if finite else None,
            "max": max(finite) if finite else None,
            "non_finite": len(last) - len(finite),
            **spikes,
        }
