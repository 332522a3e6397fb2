"""A training step's own values, written to the loggers at Lightning's log steps in one host read.

Deliberately not `LightningModule.log` for a value that only the loggers read (the clipping's norm,
the non-finite guard's count, the throughput meter's rate): each call costs about 0.4 ms of host time
here (Lightning's result bookkeeping; benchmarks/host_overhead.py), and Lightning then reads each
logged tensor on the host separately. Such values take the route of Lightning's `LearningRateMonitor`:
at each log step (`trainer.callbacks.steps.at_log_step`) `StepLog` reads the step's loss and its
sources' latest values in one read (`trainer.infra.on_device.read_together`) and hands them to each
logger with Lightning's own step number. Between log steps, and with no logger, it never reads.

A source is any object with `logged_values() -> Mapping[str, Tensor | float]`: its values of the
step just taken, computed only when asked."""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from trainer.callbacks.steps import at_log_step, step_loss
from trainer.infra.on_device import read_together

#: The step's loss, under the name Lightning gives a value logged on_step and on_epoch.
STEP_LOSS = "train/loss_step"


class LogSource(Protocol):
    def logged_values(self) -> Mapping[str, torch.Tensor | float]: ...


class StepLog(Callback):
    """Writes its sources' values to the loggers at Lightning's log steps (see the module docstring).
    Put after its sources among the callbacks: their `on_train_batch_end` runs first."""

    def __init__(self, sources: Sequence[LogSource]) -> None:
        self.sources = list(sources)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not trainer.loggers or not trainer.is_global_zero or not at_log_step(trainer):
            return  # (Lightning's loggers write on rank 0 only)
        values: dict[str, torch.Tensor | float] = {}
        loss = step_loss(outputs)
        if loss is not None and not getattr(pl_module, "step_loss_logged", False):
            values[STEP_LOSS] = loss  # this process's loss of the step (Lightning hands it over detached)
        for source in self.sources:
            values.update(source.logged_values())
        if not values:
            return
        tensors = {name: value for name, value in values.items() if isinstance(value, torch.Tensor)}
        read = read_together(tensors) if tensors else {}
        metrics = {name: (read[name][0] if name in read else float(value)) for name, value in values.items()}
        step = trainer.fit_loop.epoch_loop._batches_that_stepped  # the step Lightning logs this batch's values at
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
