"""Plain progress lines for logs and pipes, where a live progress bar would spam the file."""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

log = logging.getLogger("trainer.progress")


def format_metrics(metrics: dict[str, Any], keys: tuple[str, ...]) -> str:
    parts = []
    for key in keys:
        if key in metrics:
            value = float(metrics[key])
            parts.append(f"{key} {value:.4f}")
    return "  ".join(parts)


class PlainProgress(Callback):
    """One line per epoch, plus one every `every_s` seconds inside long epochs."""

    KEYS = ("train/loss", "train/acc", "val/loss", "val/acc")

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s = every_s
        self._last_print = 0.0
        self._fit_start = 0.0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._fit_start = self._last_print = time.monotonic()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        now = time.monotonic()
        if now - self._last_print < self.every_s:
            return
        self._last_print = now
        total = trainer.num_training_batches
        loss = trainer.callback_metrics.get("train/loss_step")
        loss_text = f"  train/loss {float(loss):.4f}" if loss is not None else ""
        log.info(f"epoch {trainer.current_epoch + 1}  batch {batch_idx + 1}/{total}"
                 f"  step {trainer.global_step}{loss_text}  {now - self._fit_start:.0f}s")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_print = now = time.monotonic()
        metrics = {k.replace("_epoch", ""): v for k, v in trainer.callback_metrics.items()}
        epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else "?"
        log.info(f"epoch {trainer.current_epoch + 1}/{epochs}  step {trainer.global_step}  "
                 f"{format_metrics(metrics, self.KEYS)}  {now - self._fit_start:.1f}s")
