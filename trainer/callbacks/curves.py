"""Every run's loss and metric curves, drawn into its run folder as ``curves.png``.

Whatever logger a run uses (or none): the training loss per step with its moving average,
validation loss and accuracy and training accuracy per epoch, and the lr per step; a failed or
interrupted run draws what it got through. The per-step losses and lrs are the run's loss record's
(trainer/callbacks/loss_record.py); this callback keeps the epochs' metrics, and draws."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Sequence

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

from trainer.callbacks.loss_record import LossRecord
from trainer.infra.errors import exception_line
from trainer.infra.figures import new_figure, save_png

log = logging.getLogger("trainer")


class Curves(Callback):
    def __init__(self, record: LossRecord, metrics: Sequence[str] = ("val/acc", "train/acc")) -> None:
        """`metrics`: what the middle panel draws per epoch (the task's headline metric, validation
        then training: the run gives them; none: the panel says the task logs only losses)."""
        self.record = record
        self.metrics = tuple(metrics)
        #: One entry per validation: {"epoch", "step", "val/loss", "val/acc", ...}
        self.validations: list[dict[str, float]] = []
        #: One entry per training epoch: {"epoch", "step", "train/acc", "train/loss"} where logged
        self.epochs: list[dict[str, float]] = []

    # -- recording --------------------------------------------------------------------------------
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._record(self.validations, trainer, "val/")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record(self.epochs, trainer, "train/")

    @staticmethod
    def _record(entries: list[dict[str, float]], trainer: L.Trainer, prefix: str) -> None:
        """The epoch's metrics under `prefix`, as logged on epoch (a value only logged on step left out)."""
        numbers = (torch.Tensor, float, int)
        entry = {name.removesuffix("_epoch"): float(value) if isinstance(value, numbers) else math.nan
                 for name, value in trainer.callback_metrics.items()
                 if name.startswith(prefix) and not name.endswith("_step")}
        if entry:
            entries.append({"epoch": float(trainer.current_epoch), "step": float(trainer.global_step), **entry})

    # -- drawing ----------------------------------------------------------------------------------
    def try_write_png(self, path: Path, title: str = "") -> Path | None:
        """`write_png`, with a failure to draw as a warning: a plot must not cost a run its summary."""
        try:
            return self.write_png(path, title)
        except Exception as ex:  # noqa: BLE001 - see the docstring
            log.warning("could not draw %s: %s", path.name, exception_line(ex))
            return None

    def write_png(self, path: Path, title: str = "") -> Path | None:
        """Draw the curves; None when there is nothing to draw (no training step ran)."""
        steps, losses, lrs = self.record.series()
        if not losses:
            return None
        # matplotlib only when drawing (about 0.5 s to import): a diagnosis never draws curves.
        from matplotlib.ticker import MaxNLocator

        # Fixed margins, not layout="constrained": every run draws this figure, and the constrained
        # layout's measuring pass doubled its cost (0.54 s against 0.30 s a figure, warm, on 2 cores).
        figure = new_figure(figsize=(13, 3.8))
        figure.subplots_adjust(left=0.05, right=0.985, bottom=0.13, top=0.84 if title else 0.9, wspace=0.2)
        loss_axes, metric_axes, lr_axes = figure.subplots(1, 3)

        loss_axes.plot(steps, losses, color="#9ecae1", linewidth=0.8, label="per step")
        window = max(1, min(50, len(losses) // 10))
        if window > 1:
            loss_axes.plot(steps[window - 1:], moving_average(losses, window), color="#08519c",
                           linewidth=1.6, label=f"mean of {window}")
        validated = [(entry["step"], entry["val/loss"]) for entry in self.validations if "val/loss" in entry]
        if validated:
            loss_axes.plot(*zip(*validated), "o", color="#e6550d", markersize=4, label="validation")
        finite = [v for v in losses if math.isfinite(v) and v > 0]
        if finite and max(finite) / min(finite) > 50:
            loss_axes.set_yscale("log")
        loss_axes.set(title="loss", xlabel="step")
        loss_axes.legend(fontsize=8)
        loss_axes.grid(alpha=0.3)

        for name in self.metrics:
            source, colour = (self.validations, "#e6550d") if name.startswith("val/") else (self.epochs, "#08519c")
            points = [(entry["epoch"] + 1, entry[name]) for entry in source if name in entry]
            if points:
                metric_axes.plot(*zip(*points), "o-", color=colour, markersize=3, label=name)
        shown = self.metrics[0].split("/", 1)[1] if self.metrics else "no metric besides the loss"
        metric_axes.set(title=f"{shown} per epoch", xlabel="epoch")
        metric_axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        if metric_axes.lines:
            metric_axes.legend(fontsize=8)
        metric_axes.grid(alpha=0.3)

        lr_axes.plot(steps, lrs, color="#31a354")
        lr_axes.set(title="learning rate", xlabel="step")
        lr_axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        lr_axes.grid(alpha=0.3)
        if title:
            figure.suptitle(title, fontsize=10)

        return save_png(figure, path)


def moving_average(values: list[float], window: int) -> list[float]:
    """Mean of each run of `window` values (NaN and Inf left out of the mean)."""
    array = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(array)
    sums = np.concatenate([[0.0], np.cumsum(np.where(finite, array, 0.0))])
    counts = np.concatenate([[0], np.cumsum(finite)])
    window_sums = sums[window:] - sums[:-window]
    window_counts = counts[window:] - counts[:-window]
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(window_counts > 0, window_sums / np.maximum(window_counts, 1), np.nan)
    return means.tolist()
