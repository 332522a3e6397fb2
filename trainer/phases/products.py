"""What the phases make and pass on in the run record (trainer/phases/state.py): what identify found
(`Identity`), what the config builds (`Parts`), and the Trainer with the callbacks the run reads
back (`Built`)."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from trainer.callbacks.curves import Curves
from trainer.callbacks.graceful import GracefulStop
from trainer.callbacks.logged_metrics import LoggedMetrics
from trainer.callbacks.loss_record import LossRecord
from trainer.callbacks.target import TargetWatch
from trainer.callbacks.throughput import ThroughputMeter
from trainer.data.base import DataInfo, DataModule
from trainer.groups.clipping import GradientClipping
from trainer.groups.nonfinite import NonFiniteGuard
from trainer.phases.resume import Checkpoint
from trainer.tasks.protocol import TaskDefinition


class Identity(NamedTuple):
    name: str
    resume_from: Checkpoint | None
    logger_ids: dict[str, str]
    #: The run's attempts before this one (a requeued or resumed run), and this one's record.
    earlier_attempts: list[dict[str, Any]]
    attempt: dict[str, Any]


class Parts(NamedTuple):
    """What the config names, instantiated and not yet changed by the plan."""

    datamodule: DataModule
    info: DataInfo
    net: nn.Module
    clipping: GradientClipping
    guard: NonFiniteGuard
    #: The task: the batch, the loss, the metrics and the unit (trainer/tasks/), bound to the data.
    definition: TaskDefinition
    #: Every metric the task logs, with whether higher is better (trainer.groups.task.logged_metrics).
    metrics: Mapping[str, Optional[bool]]


class Built(NamedTuple):
    """The Trainer and the callbacks the run reads back from after fitting."""

    trainer: L.Trainer
    checkpoint: ModelCheckpoint | None
    losses: LossRecord
    stopper: GracefulStop
    curves: Curves
    meter: ThroughputMeter
    logged: LoggedMetrics
    target: TargetWatch | None = None
