"""What a training step hands the callbacks: its loss, whether it ended on an optimizer step, and
whether that step is a log step."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import RunningStage


def step_loss(outputs: Any) -> torch.Tensor | None:
    """The loss of a training step as Lightning passes it to ``on_train_batch_end``."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return loss if isinstance(loss, torch.Tensor) else None


def at_log_step(trainer: L.Trainer) -> bool:
    """Whether this training step is one of Lightning's log steps (every `trainer.log_every_n_steps`
    stepped batches, and when the fit is stopping): the place for a callback's own reads of device
    values and for logging a step's values. Lightning's own rule (its logger connector's
    `should_update_logs`), right from the training step to the step's `on_train_batch_end`.

    Deliberately not Lightning's property while training: it finds the running loop through
    `trainer.training` (a string-folding enum comparison) and `_active_loop`, about 3.5 us of host
    time, and several callbacks ask at every step. The fit loop's case reads the same rule directly
    (tests/unit/test_lean_lightning.py holds the two equal)."""
    every = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by its logger connector
    if every and trainer.state.stage is RunningStage.TRAINING:
        # `+ 1` as Lightning has it: a step is counted as stepped from its start
        return (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % every == 0 or trainer.should_stop
    return bool(trainer._logger_connector.should_update_logs)


class StepBoundary(Callback):
    """For callbacks that may only act where an optimizer step ended: under gradient accumulation
    the other batches leave summed gradients that no checkpoint holds."""

    _step_before = -1

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._step_before = int(trainer.global_step)

    def ended_on_optimizer_step(self, trainer: L.Trainer) -> bool:
        return int(trainer.global_step) != self._step_before

    @staticmethod
    def ends_epoch(trainer: L.Trainer, batch_idx: int) -> bool:
        """The epoch's last training batch (`limit_train_batches` counted). A checkpoint written
        there is not what it seems when `limit_train_batches` cut the epoch short: the loader was not
        exhausted, and Lightning resumes it as mid-epoch and trains it again. The epoch end writes one."""
        return batch_idx + 1 >= trainer.num_training_batches
