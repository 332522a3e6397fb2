"""Progress: plain lines for logs and pipes, where a live progress bar would spam the file, and
Lightning's Rich bar for a terminal, its metrics read at the log steps only."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import lightning as L
from lightning.pytorch.callbacks import Callback, RichProgressBar

from trainer.callbacks.steps import at_log_step

log = logging.getLogger("trainer.progress")


def format_metrics(metrics: dict[str, Any], keys: tuple[str, ...]) -> str:
    return "  ".join(f"{key} {float(metrics[key]):.4f}" for key in keys if key in metrics)


class PlainProgress(Callback):
    """One line per epoch, plus one every `every_s` seconds inside long epochs."""

    KEYS = ("train/loss", "train/acc", "val/loss", "val/acc")

    def __init__(self, every_s: float = 30.0, latest_loss: Callable[[], float | None] | None = None,
                 keys: Sequence[str] = KEYS) -> None:
        """`latest_loss`: the newest step's loss (trainer/callbacks/loss_record.py), asked at most
        every `every_s` seconds; `keys`: the metrics an epoch's line shows (the task's: the run
        gives them)."""
        self.keys = tuple(keys)
        self.every_s = every_s
        self.latest_loss = latest_loss
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
        loss = self.latest_loss() if self.latest_loss is not None else None
        loss_text = f"  train/loss {loss:.4f}" if loss is not None else ""
        log.info(f"epoch {trainer.current_epoch + 1}  batch {batch_idx + 1}/{trainer.num_training_batches}"
                 f"  step {trainer.global_step}{loss_text}  {now - self._fit_start:.0f}s")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_print = now = time.monotonic()
        metrics = {k.replace("_epoch", ""): v for k, v in trainer.callback_metrics.items()}
        epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else "?"
        log.info(f"epoch {trainer.current_epoch + 1}/{epochs}  step {trainer.global_step}  "
                 f"{format_metrics(metrics, self.keys)}  {now - self._fit_start:.1f}s")


class LogStepRichProgressBar(RichProgressBar):
    """Lightning's Rich bar, whose metrics (train/loss) are read at Lightning's log steps only.

    Deliberately: Lightning's bar asks for its metrics after every batch, and each ask reads the
    logged tensors on the host (`.item()`), which on a GPU makes every step wait for the device.
    Between log steps the bar shows the last values read. The step's training loss is not a logged
    value (trainer/task.py logs it once an epoch): the bar shows `latest_loss()` as train/loss_step."""

    def __init__(self, latest_loss: Callable[[], float | None] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.latest_loss = latest_loss
        self._shown: dict[str, Any] | None = None

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        if self._shown is not None and trainer.training and not at_log_step(trainer):
            return self._shown
        shown = super().get_metrics(trainer, pl_module)
        loss = self.latest_loss() if self.latest_loss is not None and trainer.training else None
        if loss is not None:
            shown["train/loss_step"] = loss
        epoch_loss = trainer.callback_metrics.get("train/loss_epoch")
        if epoch_loss is not None and "train/loss_epoch" not in shown:
            shown["train/loss_epoch"] = float(epoch_loss)
        self._shown = shown
        return shown
