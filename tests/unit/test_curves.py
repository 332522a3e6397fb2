"""The run's curves: the loss record's steps (read back a window at a time, no sync per step) and
the metrics of each validation and epoch, drawn into curves.png."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from trainer.callbacks.curves import Curves, moving_average
from trainer.callbacks.loss_record import LossRecord


def fake_trainer(step: int, metrics: dict[str, float], lr: float = 0.1) -> SimpleNamespace:
    optimizer = SimpleNamespace(param_groups=[{"lr": lr}])
    return SimpleNamespace(global_step=step, current_epoch=step // 10, sanity_checking=False,
                           optimizers=[optimizer], callback_metrics={k: torch.tensor(v) for k, v in metrics.items()})


def test_losses_stay_on_the_device_until_a_window_is_full_then_everything_is_drawn(tmp_path):
    record = LossRecord(spike_window=8)
    curves = Curves(record)
    for step in range(1, 21):
        record.on_train_batch_end(fake_trainer(step, {}, lr=0.1 / step), None, {"loss": torch.tensor(3.0 / step)}, None, 0)
        if step % 10 == 0:
            trainer = fake_trainer(step, {"val/loss": 1.0 / step, "val/acc": step / 20, "train/acc_epoch": step / 25,
                                          "train/loss_step": 9.0})
            curves.on_validation_epoch_end(trainer, None)
            curves.on_train_epoch_end(trainer, None)
    assert len(record.losses) == 16 and len(record._pending) == 4  # two windows read back, four steps pending
    curves.on_validation_epoch_end(SimpleNamespace(sanity_checking=True), None)  # the sanity check is not a point
    assert [v["val/acc"] for v in curves.validations] == [0.5, 1.0]
    assert curves.epochs[0].keys() == {"epoch", "step", "train/acc"} and math.isclose(curves.epochs[0]["train/acc"], 0.4, rel_tol=1e-6)
    assert curves.write_png(tmp_path / "curves.png", title="a run") == tmp_path / "curves.png"
    assert len(record.losses) == 20 and math.isclose(record.losses[-1], 3.0 / 20, rel_tol=1e-6)
    assert record.lrs[0] == 0.1 and record.step_numbers == list(range(1, 21))
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")


def test_nothing_to_draw_before_the_first_step(tmp_path):
    assert Curves(LossRecord()).write_png(tmp_path / "curves.png") is None and not (tmp_path / "curves.png").exists()


def test_moving_average_leaves_non_finite_values_out():
    assert moving_average([1.0, 3.0, float("nan"), 5.0], 2) == [2.0, 3.0, 5.0]
    assert math.isnan(moving_average([float("inf"), float("nan")], 2)[0])
