"""What the task logs about training, and what that costs under several processes: the step loss is
the process's own, without any collective communication inside a training step, and reaches the
loggers at the log steps (through the step log; `self.log` registers the epoch means once, at the
epoch's last batch); the epoch mean covers every step and is combined over every
process once, when the epoch ends. A second process is faked through the
metric's own synchronization hook, so the test runs in one process on the CPU."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import RecordingLogger
from trainer.callbacks.step_log import StepLog
from trainer.configuration.spec import choice_config
from trainer.groups.optimizer.build import OptimizerRecipe
from trainer.task import ClassificationTask

#: The other (fake) process's loss at every step.
OTHER_LOSS = 7.0


def make_task() -> ClassificationTask:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(1), nn.Linear(3 * 4 * 4, 10))
    return ClassificationTask(net, 10, OptimizerRecipe.for_network(net, choice_config("optimizer", "adamw"), 1e-3, 0.0),
                              choice_config("scheduler", "constant"))


class InsideTrainingBatch(Callback):
    """Whether a training batch is being processed now, and each step's loss and logged step value."""

    def __init__(self) -> None:
        self.active = False
        self.losses: list[float] = []
        self.logged_steps: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.active = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.active = False
        self.losses.append(float(outputs["loss"]))
        logged = trainer.callback_metrics.get("train/loss_step")
        self.logged_steps.append(None if logged is None else float(logged))


@pytest.mark.run
def test_the_step_loss_is_not_synchronized_and_the_epoch_mean_is(monkeypatch):
    task = make_task()
    inside = InsideTrainingBatch()
    synced_per_step, gathered = [], []

    # Lightning's path: a value logged with sync_dist=True and on_step (the default inside
    # training_step) is all-reduced at every step under DDP (on one device Lightning skips the
    # reduce, so the calls themselves are what is checked).
    original_log = L.LightningModule.log

    def recording_log(self, name, value, *args, **kwargs):
        if inside.active and kwargs.get("sync_dist") and kwargs.get("on_step", True):
            synced_per_step.append(name)
        return original_log(self, name, value, *args, **kwargs)

    monkeypatch.setattr(ClassificationTask, "log", recording_log)

    # torchmetrics' path: a second process whose loss was OTHER_LOSS at every step.
    metric = task.train_loss

    def gather_with_another_process(tensor, group=None):
        gathered.append(inside.active)
        other = metric.weight * OTHER_LOSS if tensor is metric.total else metric.weight.clone()
        return [tensor, other]

    metric.distributed_available_fn = lambda: True
    metric.dist_sync_fn = gather_with_another_process

    data = TensorDataset(torch.rand(16, 3, 4, 4), torch.randint(0, 10, (16,)))
    logger = RecordingLogger()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=logger, callbacks=[inside, StepLog([])],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=2)
    trainer.fit(task, train_dataloaders=DataLoader(data, batch_size=4, drop_last=True))

    assert len(inside.losses) == 4
    assert synced_per_step == []  # nothing all-reduced at every step
    assert gathered and not any(gathered)  # the metric synchronized, only outside the steps
    # This process's own loss in the loggers at the log steps (the 2nd and the 4th batch): the 2nd
    # through the step log, the 4th (the epoch's last) through self.log, which registers the epoch means
    # there; in the callbacks' metrics only from that last batch on.
    step_losses = [(step, m["train/loss_step"]) for step, m in logger.logged if "train/loss_step" in m]
    assert step_losses == [(1, pytest.approx(inside.losses[1])), (3, pytest.approx(inside.losses[3]))]
    assert inside.logged_steps == [None, None, None, pytest.approx(inside.losses[3])]
    own_mean = sum(inside.losses) / len(inside.losses)
    assert float(trainer.callback_metrics["train/loss_epoch"]) == pytest.approx((own_mean + OTHER_LOSS) / 2)
    assert float(trainer.callback_metrics["train/loss"]) == pytest.approx((own_mean + OTHER_LOSS) / 2)


def test_the_module_hyperparameters_stay_in_checkpoints_and_out_of_the_loggers():
    task = make_task()
    # Checkpoints carry these (plain values: they load with weights_only=True) ...
    assert dict(task.hparams) == {"task": "Classification", "unit": "samples", "num_classes": 10, "lr": 1e-3,
                                  "weight_decay": 0.0, "optimizer": "adamw", "scheduler": "constant"}
    # ... and Lightning does not hand them to the loggers: those get the resolved config (trainer/groups/logger.py).
    assert task._log_hyperparams is False


@pytest.mark.run
def test_top5_accuracy_is_logged_from_ten_classes_on(tmp_path):
    """val/acc5 and test/acc5 with 10 classes, at least the top-1 accuracy; none with 3 classes."""
    task = make_task()
    images, labels = torch.randn(32, 3, 4, 4), torch.randint(0, 10, (32,))
    loader = DataLoader(TensorDataset(images, labels), batch_size=8)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(task, loader, loader)
    assert "val/acc5" in trainer.callback_metrics
    tested = trainer.test(task, loader, verbose=False)[0]
    assert tested["test/acc5"] >= tested["test/acc"]
    linear = nn.Linear(2, 3)
    few = ClassificationTask(linear, 3, OptimizerRecipe.for_network(linear, choice_config("optimizer", "adamw"), 1e-3, 0.0),
                             choice_config("scheduler", "constant"))
    assert "acc5" not in few.metrics_of("val") and "acc5" not in few.metrics_of("test")
