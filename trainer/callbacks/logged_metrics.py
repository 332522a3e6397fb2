"""The metrics the run has logged so far travel with every checkpoint.

Lightning keeps `trainer.callback_metrics` in memory only. A run killed after its last training
step resumes from a checkpoint whose loops say training is over: the resumed fit logs nothing, yet
the run's record must say what training reached. Every checkpoint therefore carries the logged
values as they stood (a fit's last one is written after the last validation and the epoch's
training metrics), and `final` merges this attempt's over them."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


class LoggedMetrics(Callback):
    def __init__(self) -> None:
        self._trainer: L.Trainer | None = None
        #: The values of the checkpoint this run resumed from ({} for a fresh run).
        self.restored: dict[str, float] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return {"metrics": self.final(self._trainer) if self._trainer is not None else dict(self.restored)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.restored = {str(k): float(v) for k, v in state_dict.get("metrics", {}).items()}

    def final(self, trainer: L.Trainer) -> dict[str, float]:
        """What the run has logged, earlier attempts included: this attempt's values over those of
        the checkpoint it resumed from."""
        return {**self.restored, **_floats(dict(trainer.callback_metrics))}


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[str(name)] = float(value)
    return out
