"""``target.metric=val/acc target.value=0.98``: time to accuracy, as MLPerf measures training.

The metric is compared with the target after every validation and at the end of every training
epoch (for train metrics); what summary.json then records is in docs/config.md (below the top-level
keys). A resumed run carries on from the checkpoint's record and its elapsed training time."""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import lightning as L


#: Metrics that are better when smaller (target.mode=auto reads the name).
SMALLER_IS_BETTER = ("loss", "perplexity", "error", "mse", "mae")


def auto_mode(metric: str) -> str:
    """min for a loss, a perplexity or an error; max otherwise (accuracy and the like)."""
    return "min" if any(word in metric for word in SMALLER_IS_BETTER) else "max"


class TargetWatch(L.Callback):
    def __init__(self, metric: str, value: float, mode: str, global_batch: int, unit: str = "samples",
                 units_per_sample: int = 1) -> None:
        self.metric, self.value, self.global_batch = metric, float(value), global_batch
        self.unit, self.units_per_sample = unit, units_per_sample
        self.mode = mode if mode != "auto" else auto_mode(metric)
        self.reached: Optional[dict[str, Any]] = None
        self.best: Optional[float] = None
        self._elapsed_before = 0.0  # training seconds of earlier attempts (a resumed run)
        self._started: Optional[float] = None

    @property
    def state_key(self) -> str:
        return f"TargetWatch[{self.metric}]"

    def describe(self) -> str:
        return f"{self.metric} {'>=' if self.mode == 'max' else '<='} {self.value:g}"

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and self.metric.startswith("val/"):
            self._check(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.metric.startswith("train/"):
            self._check(trainer)

    def _check(self, trainer: L.Trainer) -> None:
        found = trainer.callback_metrics.get(self.metric)
        value = float(found) if found is not None else math.nan
        if math.isnan(value):
            return
        better = max if self.mode == "max" else min
        self.best = value if self.best is None else better(self.best, value)
        hit = value >= self.value if self.mode == "max" else value <= self.value
        if hit and self.reached is None:
            self.reached = {"wall_s": self.elapsed(), "steps": trainer.global_step,
                            "samples": trainer.global_step * self.global_batch, "epoch": trainer.current_epoch,
                            "value": value}
            if self.unit != "samples":
                self.reached[self.unit] = trainer.global_step * self.global_batch * self.units_per_sample

    def elapsed(self) -> float:
        running = time.perf_counter() - self._started if self._started is not None else 0.0
        return self._elapsed_before + running

    def summary(self) -> dict[str, Any]:
        record: dict[str, Any] = {"metric": self.metric, "value": self.value, "mode": self.mode,
                                  "reached": self.reached is not None, "best": self.best}
        if self.reached is not None:
            record.update(self.reached | {"value_reached": self.reached["value"]}, value=self.value)
        return record

    def line(self) -> str:
        if self.reached is None:
            best = f"best {self.best:.4g}" if self.best is not None else "never evaluated"
            return f"target {self.describe()}: not reached ({best})"
        r = self.reached
        units = f" ({r[self.unit]:,} {self.unit})" if self.unit in r else ""
        return (f"target {self.describe()}: reached at step {r['steps']} (epoch {r['epoch']}), {r['wall_s']:.1f} s "
                f"into training, {r['samples']:,} samples{units} ({self.metric} {r['value']:.4g})")

    def state_dict(self) -> dict[str, Any]:
        return {"reached": self.reached, "best": self.best, "elapsed_s": self.elapsed()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reached, self.best = state.get("reached"), state.get("best")
        self._elapsed_before = float(state.get("elapsed_s", 0.0))
