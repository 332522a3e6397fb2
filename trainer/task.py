"""The LightningModule: drives a task definition (trainer/tasks/: the batch, the loss, the metrics,
the unit a batch is counted in) with the optimizer and schedule the plan made. The same module
trains every task; what differs between tasks is the definition's."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Mapping, Optional, cast

import lightning as L
import torch
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torch.profiler import record_function
from torchmetrics import Metric

from trainer.groups.optimizer.build import OptimizerRecipe
from trainer.groups.regularization import RegularizationConfig
from trainer.groups.scheduler import SchedulerConfig, build_scheduler, describe
from trainer.groups.task import SPLITS, give_regularization
from trainer.measure.profile import BACKWARD_RANGE, FORWARD_RANGE
from trainer.tasks.classification import Classification, classification_loss
from trainer.tasks.metrics import WeightedMean
from trainer.tasks.protocol import TaskDefinition

__all__ = ["TrainingTask", "ClassificationTask", "classification_loss"]

log = logging.getLogger("trainer")


class TrainingTask(L.LightningModule):
    #: Whether fitting logs the schedule's line (a measurement's own copy of the task does not).
    announces_schedule = True

    def __init__(self, net: nn.Module, definition: TaskDefinition, optimizer: OptimizerRecipe,
                 scheduler: SchedulerConfig, channels_last: bool = False) -> None:
        super().__init__()
        self.net = net.to(memory_format=torch.channels_last) if channels_last else net
        self.definition = definition
        # Which parameters are exempt from weight decay, and each one's lr scale, were decided on the
        # plain network (the recipe): under FSDP the optimizer is built after sharding has flattened them.
        self.optimizer_recipe = optimizer
        self.scheduler_cfg = scheduler
        #: The schedule as fit made it, over the optimizer steps Lightning counted (summary.json's).
        self.schedule: dict[str, Any] | None = None
        self.channels_last = channels_last
        # Plain values only, so a checkpoint's hyper-parameters load without unpickling classes; logger=False:
        # the loggers get the whole resolved config and the plan instead (trainer.groups.logger.run_hyperparameters).
        self.save_hyperparameters({**definition.hyperparameters(), "lr": optimizer.lr,
                                   "weight_decay": optimizer.weight_decay, "optimizer": optimizer.cfg.name,
                                   "scheduler": scheduler.name}, logger=False)
        # The training loss as a metric: each step's value is this process's own, and the epoch mean is
        # combined over all processes once (`self.log(..., sync_dist=True)` would all-reduce every step).
        # No NaN check (a host sync per step): a non-finite step makes the epoch mean non-finite, as it
        # should. Unweighted: training batches are all one size (drop_last).
        self.train_loss = WeightedMean()
        self._epoch_unregistered = True
        self._register_first = False
        self._epoch_length: Optional[tuple[float, int]] = None  # the epoch's batches and the fit's max_steps
        #: Whether this step's train/loss_step went through `self.log` (else the step log writes it).
        self.step_loss_logged = False
        # Evaluation losses weighted by the units of each batch: the epoch's value is the mean over every
        # sample (token) of every process. ModuleDicts move with the module; keyed "val_split" and so on,
        # as a module cannot hold a child named "train".
        self.eval_losses = nn.ModuleDict({_key(split): WeightedMean() for split in SPLITS[1:]})
        self.split_metrics = nn.ModuleDict({_key(split): nn.ModuleDict(dict(definition.metrics(split)))
                                            for split in SPLITS})
        self.loss_metrics = nn.ModuleDict({_key(split): nn.ModuleDict(dict(definition.metrics_from_loss()))
                                           for split in SPLITS[1:]})
        # The training metrics again as a plain dict (not registered twice), for every step's lookup.
        self._train_metrics: dict[str, Metric] = dict(cast(Mapping[str, Metric], self.split_metrics[_key("train")]))

    def metrics_of(self, split: str) -> Mapping[str, Metric]:
        """The task's metrics of a split ("train", "val", "test")."""
        if split == "train":
            return self._train_metrics
        return cast(Mapping[str, Metric], self.split_metrics[_key(split)])

    def forward(self, x: Any) -> Any:
        if self.channels_last and isinstance(x, torch.Tensor) and x.ndim == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.net(x)

    def evaluation_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """The evaluation loss: the task's plain loss."""
        return self.definition.loss(outputs, targets, training=False)

    def training_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        return self.definition.loss(outputs, targets, training=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        definition = self.definition
        batch = definition.training_batch(batch)
        # Named ranges for profile=true (trainer/measure/profile.py) while a profiler records:
        # Lightning runs this step and the backward inside the optimizer's step (its closure), so
        # without them everything would be the optimizer's. With none recording, not even a range.
        with _named_range(FORWARD_RANGE):
            outputs = definition.forward(self, batch)
            targets = definition.targets(batch)
            loss = self.training_loss(outputs, targets)
        metrics = self.metrics_of("train")
        definition.update_metrics(metrics, outputs, targets)
        self._log_training(loss, metrics, _samples(targets), batch_idx)
        return loss

    def _log_training(self, loss: torch.Tensor, metrics: Mapping[str, Metric], n: int, batch_idx: int) -> None:
        """The loss into its epoch mean every step, and `self.log` once per epoch, at its last batch: what
        registers the epoch means (train/loss_epoch, train/loss) and that step's train/loss_step. Not every
        step: a `self.log` call costs about 0.2 ms of host time, and Lightning walks every logged value after
        each later batch (benchmarks/host_overhead.py). The other steps' losses reach the loggers through
        the step log (trainer/callbacks/step_log.py), this process's own, unsynced."""
        self.train_loss.add_step(loss)
        if self.step_loss_logged:
            self.step_loss_logged = False
        if not self._epoch_unregistered or not self._registers_at(batch_idx):
            return
        self._epoch_unregistered = False
        self.step_loss_logged = True
        self.train_loss.keep_batch_value(loss)  # this step's value, for its train/loss_step
        # Not prog_bar: Lightning reads every progress-bar value on the host after every batch, a
        # wait on the device each step; the bar shows the loss it reads at log steps instead
        # (trainer/callbacks/progress.py).
        self.log("train/loss", self.train_loss, on_step=True, on_epoch=True, batch_size=n)
        for name, metric in metrics.items():
            self.log(f"train/{name}", metric, on_step=False, on_epoch=True, batch_size=n)

    def _registers_at(self, batch_idx: int) -> bool:
        """Whether this batch registers the epoch means: the epoch's last batch where it is known
        (its batches counted, or the fit's last step by max_steps), else the epoch's first (a
        stream of unknown length, or a time limit that may end the epoch at any batch)."""
        trainer = self.trainer
        batches, max_steps = self._epoch_length or (trainer.num_training_batches, trainer.max_steps)
        if self._register_first or batches == float("inf"):
            return True
        return batch_idx + 1 >= batches or 0 < max_steps <= trainer.global_step + 1

    def on_train_epoch_start(self) -> None:
        self._epoch_unregistered = True
        self._register_first = any(isinstance(c, Timer) for c in getattr(self.trainer, "callbacks", []))
        # Read once an epoch: `_registers_at` asks at every step until the epoch registers.
        self._epoch_length = (self.trainer.num_training_batches, self.trainer.max_steps)

    # The training metrics' running states go into every checkpoint written inside an epoch, one entry
    # per process, so a run resumed mid-epoch ends that epoch with the mean over all of its batches
    # (Lightning saves neither the metrics' states nor its own running means). A checkpoint written
    # at an epoch's end holds none: the next epoch starts afresh either way.
    TRAIN_METRICS_KEY = "train_metric_states"

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        progress = self.trainer.fit_loop.epoch_progress.current
        processed = progress.processed  # type: ignore[attr-defined]  # a _ProcessedTracker, typed as its base
        if processed > progress.completed:  # saved at the epoch's end
            return
        # Every process writes its part: all of them save together (a collective). Both metrics'
        # states are tensors (torchmetrics types a state as a tensor or a list of them).
        checkpoint[self.TRAIN_METRICS_KEY] = {
            name: {"updates": int(metric._update_count),
                   "states": {k: self._per_process(cast(torch.Tensor, v)) for k, v in metric.metric_state.items()}}
            for name, metric in self._training_metrics().items()}

    def _training_metrics(self) -> dict[str, Metric]:
        """The metrics whose running states a mid-epoch checkpoint keeps, by a stable name."""
        metrics = self.metrics_of("train")
        return {"train_loss": self.train_loss, **{f"train_{name}": metric for name, metric in metrics.items()}}

    def _per_process(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self.trainer.world_size == 1:
            return [tensor.detach().cpu()]
        return list(self.trainer.strategy.all_gather(tensor.detach()).cpu().unbind(0))

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(self.TRAIN_METRICS_KEY)
        rank, processes = self.trainer.global_rank, self.trainer.world_size
        metrics = self._training_metrics()
        for name, record in (saved or {}).items():
            metric = metrics.get(name)
            # Written by another task's metrics, another kind of metric (an older version's) or another
            # number of processes: the epoch's mean starts afresh.
            if (metric is None or set(record["states"]) != set(metric.metric_state)
                    or any(len(parts) != processes for parts in record["states"].values())):
                continue
            for key, parts in record["states"].items():
                setattr(metric, key, parts[rank].to(metric.device))
            metric._update_count = int(record["updates"])
            metric._computed = None

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        with _named_range(BACKWARD_RANGE):
            super().backward(loss, *args, **kwargs)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _evaluate(self, batch: Any, split: str) -> None:
        definition = self.definition
        outputs = definition.forward(self, batch)
        targets = definition.targets(batch)
        n = _samples(targets)
        loss = self.evaluation_loss(outputs, targets)
        units = definition.units_in(batch)
        weight = units if isinstance(units, torch.Tensor) else float(units)
        eval_loss = cast(WeightedMean, self.eval_losses[_key(split)])
        eval_loss.update(loss.detach(), weight)
        self.log(f"{split}/loss", eval_loss, on_epoch=True, batch_size=n)
        for name, metric in cast(Mapping[str, Metric], self.loss_metrics[_key(split)]).items():
            metric.update(loss.detach(), weight)
            self.log(f"{split}/{name}", metric, on_epoch=True, batch_size=n)
        metrics = self.metrics_of(split)
        definition.update_metrics(metrics, outputs, targets)
        for index, (name, metric) in enumerate(metrics.items()):
            self.log(f"{split}/{name}", metric, on_epoch=True, prog_bar=index == 0, batch_size=n)

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_recipe.build(self.net)
        # The run's length is Lightning's count, made here once the loaders are set up; the start-up
        # plan could only name the schedule's shape, so this line gives it in steps.
        steps = int(self.trainer.estimated_stepping_batches)
        scheduler = build_scheduler(optimizer, self.scheduler_cfg, steps)
        self.schedule = {"name": self.scheduler_cfg.name, "optimizer_steps": steps,
                         "how": describe(self.scheduler_cfg, self.optimizer_recipe.lr, steps, self.optimizer_recipe.cfg)}
        if self.announces_schedule:
            _announce(self.schedule)
        # The loggers' lr curves (LearningRateMonitor, trainer/groups/logger.py): train/lr, with /pg1 (decaying
        # weights) and /pg2 (norm weights and biases) when there are two groups, whatever the scheduler.
        return {"optimizer": optimizer, "lr_scheduler": {**scheduler, "name": "train/lr"}}


@rank_zero_only
def _announce(schedule: dict[str, Any]) -> None:
    log.info("scheduler %s: %s", schedule["name"], schedule["how"])


def _named_range(name: str) -> Any:
    """A profiler range named `name` while a profiler records (torch.profiler, emit_nvtx), else nothing."""
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def _key(split: str) -> str:
    return f"{split}_split"


def _samples(targets: Any) -> int:
    """The samples of a batch (its first dimension), what Lightning weighs logged values with."""
    return int(targets.shape[0]) if isinstance(targets, torch.Tensor) else 1


class ClassificationTask(TrainingTask):
    """The classification task as one object (tests, notebooks): `TrainingTask` with the
    `Classification` definition bound to `num_classes`."""

    def __init__(self, net: nn.Module, num_classes: int, optimizer: OptimizerRecipe, scheduler: SchedulerConfig,
                 channels_last: bool = False, regularization: RegularizationConfig | None = None) -> None:
        definition = Classification()
        definition.num_classes = num_classes
        if regularization is not None:
            give_regularization(definition, regularization, num_classes)
        super().__init__(net, definition, optimizer, scheduler, channels_last)
