"""What the framework relies on where it keeps a part of its own beside a library's, pinned so that a
library upgrade shows here first, with why the part is kept:

- `LatestAndBest` overrides ModelCheckpoint's `load_state_dict`, `on_train_epoch_end` and
  `on_validation_end`, and calls four of its private methods: their names and parameters; it skips
  `on_train_batch_end` when neither of its two attributes asks for a save inside an epoch, where
  Lightning's own saves nothing;
- `PeriodicCheckpoint` is kept because one ModelCheckpoint cannot save every N steps and every N
  minutes (Lightning refuses the two together), and because ModelCheckpoint saves at an epoch's
  last batch, where a checkpoint of an epoch cut short by limit_train_batches resumes as mid-epoch;
- the parameter groups are the framework's because timm's `param_groups_weight_decay` decides by
  shape, which exempts every weight once FSDP has flattened them into 1-D shards.
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer.groups.checkpointing import LatestAndBest
from trainer.groups.optimizer.parameters import one_dimensional, parameter_groups


@pytest.mark.parametrize("method, parameters", [
    ("_should_save_on_train_epoch_end", ["self", "trainer"]),
    ("_should_skip_saving_checkpoint", ["self", "trainer"]),
    ("_save_last_checkpoint", ["self", "trainer", "monitor_candidates"]),
    ("_monitor_candidates", ["self", "trainer"]),
    ("load_state_dict", ["self", "state_dict"]),
    ("on_train_epoch_end", ["self", "trainer", "pl_module"]),
    ("on_validation_end", ["self", "trainer", "pl_module"]),
])
def test_the_model_checkpoint_methods_latest_and_best_relies_on(method, parameters):
    assert list(inspect.signature(getattr(ModelCheckpoint, method)).parameters) == parameters
    assert issubclass(LatestAndBest, ModelCheckpoint)


def test_one_model_checkpoint_cannot_save_both_every_n_steps_and_every_n_minutes():
    with pytest.raises(MisconfigurationException, match="mutually exclusive"):
        ModelCheckpoint(every_n_train_steps=5, train_time_interval=timedelta(minutes=30))


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(16, 2)), batch_size=2)


class _SavedAt(ModelCheckpoint):
    """ModelCheckpoint, noting the batch of the epoch at which each of its saves happens."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.batch: int | None = None
        self.saved_at: list[int | None] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batch = batch_idx
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.batch = None

    def _save_checkpoint(self, trainer, filepath) -> None:
        self.saved_at.append(self.batch)


@pytest.mark.run
def test_without_every_n_train_steps_or_a_time_interval_model_checkpoint_saves_nothing_inside_an_epoch(tmp_path):
    """What lets LatestAndBest skip Lightning's per-batch hook: configured as the framework configures
    it (no step or time interval), Lightning's saves all happen outside `on_train_batch_end`, and the
    attributes the skip reads are the ones its constructor sets."""
    spy = _SavedAt(dirpath=tmp_path, save_top_k=-1, save_last=True)
    assert spy._every_n_train_steps == 0 and spy._train_time_interval is None
    L.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
              callbacks=[spy], default_root_dir=tmp_path).fit(_Tiny())
    assert spy.saved_at and set(spy.saved_at) == {None}  # each save at an epoch's end, none in a batch
    assert ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3)._every_n_train_steps == 3
    assert ModelCheckpoint(dirpath=tmp_path, train_time_interval=timedelta(minutes=1))._train_time_interval


@pytest.mark.run
def test_model_checkpoint_saves_every_n_steps_at_an_epochs_last_batch_too(tmp_path):
    """An epoch cut short by limit_train_batches to 4 batches: every 2 steps means batches 1 and 3,
    the last one included (PeriodicCheckpoint leaves it to the epoch's end: trainer/callbacks/steps.py
    `ends_epoch` says why)."""
    spy = _SavedAt(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    L.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=4, logger=False, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[spy], default_root_dir=tmp_path).fit(_Tiny())
    assert spy.saved_at[:2] == [1, 3]


def test_timms_parameter_groups_exempt_every_flattened_weight_where_the_frameworks_decide_by_name():
    timm_optim = pytest.importorskip("timm.optim")
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    names = one_dimensional(net)  # read on the plain network
    for param in net.parameters():  # what FSDP's flat shards look like to the optimizer
        param.data = param.data.flatten()
    timms = timm_optim.param_groups_weight_decay(net, weight_decay=0.1)
    decaying = [group for group in timms if group["weight_decay"] > 0]
    assert sum(len(group["params"]) for group in decaying) == 0  # every weight escapes decay
    ours = parameter_groups(net, 0.1, decay_norm_and_bias=False, no_decay_names=names)
    assert [len(group["params"]) for group in ours] == [2, 4]  # the conv and linear weights decay, as unwrapped
    assert torch.is_tensor(ours[0]["params"][0])


def test_torchmetrics_copies_sync_on_compute_into_to_sync_only_at_init_and_forward():
    """trainer/modes/lr_finder.py turns a metric's syncing off by setting both `sync_on_compute` and
    the private `_to_sync`: torchmetrics reads `_to_sync`, copied at construction and after a forward
    call only, so a metric updated with `update()` alone would still sync (and rank 0's lone range
    test under torchrun would wait for the other ranks forever)."""
    import torch
    from torchmetrics.aggregation import MeanMetric

    metric = MeanMetric()
    metric.sync_on_compute = False
    metric.update(torch.tensor(1.0))
    assert metric._to_sync is True
    metric(torch.tensor(1.0))
    assert metric._to_sync is False
