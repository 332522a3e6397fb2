"""The LightningModule: classification loss, torchmetrics accuracy, optimizer and schedule."""

from __future__ import annotations

import logging
from typing import Any, cast

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torch.profiler import record_function
from torchmetrics.aggregation import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from trainer.groups.optimizer.build import OptimizerRecipe
from trainer.groups.regularization import BatchMixing, RegularizationConfig, dominant_labels
from trainer.groups.scheduler import SchedulerConfig, build_scheduler, describe
from trainer.measure.profile import BACKWARD_RANGE, FORWARD_RANGE

log = logging.getLogger("trainer")


def classification_loss(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """The task's loss (also what the memory plan measures with). In fp32 whatever the autocast
    dtype: log-softmax of half logits loses precision. `targets`: integer labels, or class
    probabilities (N x classes) from mixup/cutmix; smoothing applies to both."""
    return F.cross_entropy(logits.float(), targets, label_smoothing=label_smoothing)


#: Top-5 accuracy, as ImageNet recipes report it, from this many classes on (below, it says little).
TOP5_MIN_CLASSES = 10


class ClassificationTask(L.LightningModule):
    #: Whether fitting logs the schedule's line (a measurement's own copy of the task does not).
    announces_schedule = True

    def __init__(
        self,
        net: nn.Module,
        num_classes: int,
        optimizer: OptimizerRecipe,
        scheduler: SchedulerConfig,
        channels_last: bool = False,
        regularization: RegularizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.net = net.to(memory_format=torch.channels_last) if channels_last else net
        # Which parameters are exempt from weight decay, and each one's lr scale, were decided on the
        # plain network (the recipe): under FSDP the optimizer is built after sharding has flattened them.
        self.optimizer_recipe = optimizer
        self.scheduler_cfg = scheduler
        #: The schedule as fit made it, over the optimizer steps Lightning counted (summary.json's).
        self.schedule: dict[str, Any] | None = None
        self.channels_last = channels_last
        # Label smoothing shapes the training loss only: validation and test losses stay the plain
        # cross-entropy, comparable between runs with and without it (as timm reports them).
        self.label_smoothing = regularization.label_smoothing if regularization else 0.0
        self.mixing = BatchMixing(regularization, num_classes) if regularization else None
        # Plain values only, so a checkpoint's hyper-parameters load without unpickling classes; logger=False:
        # the loggers get the whole resolved config and the plan instead (trainer.groups.logger.run_hyperparameters).
        self.save_hyperparameters({"num_classes": num_classes, "lr": optimizer.lr, "weight_decay": optimizer.weight_decay,
                                   "optimizer": optimizer.cfg.name, "scheduler": scheduler.name}, logger=False)
        # The training loss as a metric: each step's value is this process's own, and the epoch mean is
        # combined over all processes once (`self.log(..., sync_dist=True)` would all-reduce every step).
        # "disable": no NaN check (a host sync per step); a non-finite step makes the epoch mean
        # non-finite, as it should. Unweighted: training batches are all one size (drop_last).
        self.train_loss = MeanMetric(nan_strategy="disable")
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")
        top5 = num_classes >= TOP5_MIN_CLASSES
        self.val_acc5 = MulticlassAccuracy(num_classes, top_k=5, average="micro") if top5 else None
        self.test_acc5 = MulticlassAccuracy(num_classes, top_k=5, average="micro") if top5 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.net(x)

    def evaluation_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The evaluation loss: plain cross-entropy."""
        return classification_loss(logits, labels)

    def training_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return classification_loss(logits, targets, self.label_smoothing)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        if self.mixing is not None and self.mixing.active:
            images, labels = self.mixing(images, labels)
        # Named ranges for profile=true (trainer/measure/profile.py): Lightning runs this step and the
        # backward inside the optimizer's step (its closure), so without them everything would be
        # the optimizer's. A range costs about a microsecond when no profiler records.
        with record_function(FORWARD_RANGE):
            logits = self(images)
            loss = self.training_loss(logits, labels)
        # A mixed batch's accuracy counts the class its target weighs most.
        self.train_acc(logits.detach(), dominant_labels(labels))
        n = labels.shape[0]
        # train/loss_step: this process's loss (rank 0's in the loggers, unsynced); train/loss_epoch
        # and train/loss at the epoch's end: the mean over all steps of all processes.
        self.train_loss(loss.detach())
        self.log("train/loss", self.train_loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=n)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, batch_size=n)
        return loss

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
            for name, metric in (("train_loss", self.train_loss), ("train_acc", self.train_acc))}

    def _per_process(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self.trainer.world_size == 1:
            return [tensor.detach().cpu()]
        return list(self.trainer.strategy.all_gather(tensor.detach()).cpu().unbind(0))

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(self.TRAIN_METRICS_KEY)
        rank, processes = self.trainer.global_rank, self.trainer.world_size
        for name, record in (saved or {}).items():
            metric = getattr(self, name)
            if any(len(parts) != processes for parts in record["states"].values()):
                continue  # written by another number of processes: the epoch's mean starts afresh
            for key, parts in record["states"].items():
                setattr(metric, key, parts[rank].to(metric.device))
            metric._update_count = int(record["updates"])
            metric._computed = None

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        with record_function(BACKWARD_RANGE):
            super().backward(loss, *args, **kwargs)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_acc, self.val_acc5)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_acc, self.test_acc5)

    def _evaluate(self, batch: Any, split: str, metric: MulticlassAccuracy,
                  top5: MulticlassAccuracy | None = None) -> None:
        images, labels = batch
        logits = self(images)
        n = labels.shape[0]
        self.log(f"{split}/loss", self.evaluation_loss(logits, labels), on_epoch=True, batch_size=n, sync_dist=True)
        metric(logits, labels)
        self.log(f"{split}/acc", metric, on_epoch=True, prog_bar=True, batch_size=n)
        if top5 is not None:
            top5(logits, labels)
            self.log(f"{split}/acc5", top5, on_epoch=True, batch_size=n)

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
