"""The run's one per-step record: the training loss and the lr of every step, from which summary.json
takes the first and last steps and the spikes, the ladder its loss columns, and curves.png its loss
and lr panels (trainer/callbacks/curves.py draws it).

The losses stay on the device and are read back in one synchronization every `spike_window` steps
(and when a summary or a checkpoint asks), not one per step. A spike is a loss above `spike_factor`
times the median of the steps before it (up to `spike_window`, at least `MIN_HISTORY`): the clipping
study's measure. The first and last steps, the spike counts and their history go into every
checkpoint, so a resumed run's record covers its whole training; the per-step series, this attempt."""

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


class LossRecord(Callback):
    def __init__(self, first_steps: int = 10, last_steps: int = 50, spike_factor: float = 3.0,
                 spike_window: int = 50) -> None:
        self.first_steps = first_steps
        self.last_steps = last_steps
        self.spike_factor = spike_factor
        self.spike_window = spike_window
        self.min_history = min(MIN_HISTORY, spike_window)  # steps a loss is judged against, at least
        #: This attempt's steps: the global step, the loss (read back a window at a time) and the lr.
        self.step_numbers: list[int] = []
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self._pending: list[torch.Tensor] = []
        self._first: list[float] = []
        self._last: deque[float] = deque(maxlen=last_steps)
        self._recent: deque[float] = deque(maxlen=spike_window)
        self.steps = 0  # steps judged for spikes, over every attempt
        self.spikes = 0
        self.first_spike: int | None = None  # the step (counted from 1) of the first spike

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        loss = step_loss(outputs)
        if loss is None:
            return
        # (Lightning hands over the loss detached and 0-d: no operation here in the usual case.)
        loss = loss.detach() if loss.requires_grad else loss
        self._pending.append(loss if loss.dim() == 0 else loss.reshape(()))
        optimizers = trainer.optimizers if trainer is not None else []
        self.step_numbers.append(int(trainer.global_step) if trainer is not None else len(self.step_numbers) + 1)
        self.lrs.append(float(optimizers[0].param_groups[0]["lr"]) if optimizers else math.nan)
        if len(self._pending) >= self.spike_window:
            self._read_pending()

    def _read_pending(self) -> None:
        """The losses still on the device, read in one synchronization; then the spikes among them,
        each judged against the median of the finite losses before it. A non-finite loss is not a
        spike (the record counts those apart) and does not enter the history."""
        if not self._pending:
            return
        values = torch.stack(self._pending).float().tolist()
        self._pending = []
        self.losses += values
        for value in values:
            if len(self._first) < self.first_steps:
                self._first.append(value)
            self._last.append(value)
            self.steps += 1
            if not math.isfinite(value):
                continue
            if len(self._recent) >= self.min_history and value > self.spike_factor * statistics.median(self._recent):
                self.spikes += 1
                if self.first_spike is None:
                    self.first_spike = self.steps
            self._recent.append(value)

    def latest(self) -> float | None:
        """The newest step's loss (a read of the device when it is still pending): for progress
        output, which asks at log steps or every few seconds, not every step."""
        if self._pending:
            return float(self._pending[-1])
        return self.losses[-1] if self.losses else None

    def series(self) -> tuple[list[int], list[float], list[float]]:
        """This attempt's steps, losses and lrs, every step read back."""
        self._read_pending()
        return self.step_numbers, self.losses, self.lrs

    def state_dict(self) -> dict[str, Any]:
        self._read_pending()
        return {"first": list(self._first), "last": list(self._last), "recent": list(self._recent),
                "steps": self.steps, "spikes": self.spikes, "first_spike": self.first_spike}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._first = [float(v) for v in state_dict.get("first", [])][: self.first_steps]
        self._last = deque((float(v) for v in state_dict.get("last", [])), maxlen=self.last_steps)
        self._recent = deque((float(v) for v in state_dict.get("recent", [])), maxlen=self.spike_window)
        self._pending = []
        self.steps = int(state_dict.get("steps", 0))
        self.spikes = int(state_dict.get("spikes", 0))
        self.first_spike = state_dict.get("first_spike")

    def summary(self) -> dict[str, Any]:
        self._read_pending()
        spikes = {"spikes": self.spikes, "first_spike": self.first_spike,
                  "spike_rule": f"loss above {self.spike_factor:g}x the median of the previous "
                                f"{self.spike_window} steps (from step {self.min_history + 1})"}
        if not self._last:
            return {"first": [], "last_steps": 0, "final": None, "mean": None, "spread": None, **spikes}
        last = list(self._last)
        finite = [v for v in last if math.isfinite(v)]
        return {
            "first": list(self._first),
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
