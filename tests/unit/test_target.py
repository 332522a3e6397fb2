"""target.metric/value (trainer/callbacks/target.py): the first validation that reaches the target
records the time, steps, samples and epoch; a loss is reached from above; a resumed run keeps the
record and its elapsed time; a half-given or a test-split target is one line."""

from types import SimpleNamespace

import pytest
import torch

from trainer.callbacks.target import TargetWatch
from trainer.configuration.spec import TargetConfig
from trainer.infra.errors import UserError


def _validate(watch: TargetWatch, value: float, step: int, epoch: int) -> None:
    trainer = SimpleNamespace(sanity_checking=False, callback_metrics={watch.metric: torch.tensor(value)},
                              global_step=step, current_epoch=epoch)
    watch.on_validation_end(trainer, None)


def test_the_first_validation_at_the_target_is_recorded_once():
    watch = TargetWatch("val/acc", 0.9, "auto", global_batch=64)
    watch.on_train_start(None, None)
    for value, step, epoch in ((0.5, 10, 0), (0.92, 20, 1), (0.95, 30, 2)):
        _validate(watch, value, step, epoch)
    summary = watch.summary()
    assert summary["reached"] and summary["steps"] == 20 and summary["samples"] == 1280 and summary["epoch"] == 1
    assert summary["value"] == 0.9 and summary["value_reached"] == pytest.approx(0.92) and summary["best"] == pytest.approx(0.95)
    assert watch.line().startswith("target val/acc >= 0.9: reached at step 20 (epoch 1)")


def test_a_loss_target_is_reached_from_above_and_a_miss_says_its_best():
    watch = TargetWatch("val/loss", 0.1, "auto", global_batch=8)
    watch.on_train_start(None, None)
    _validate(watch, 0.3, 5, 0)
    _validate(watch, 0.2, 10, 1)
    assert watch.mode == "min" and not watch.summary()["reached"]
    assert watch.line() == "target val/loss <= 0.1: not reached (best 0.2)"


def test_a_resumed_run_keeps_the_record_and_the_time_already_spent():
    watch = TargetWatch("val/acc", 0.9, "max", global_batch=64)
    watch.load_state_dict({"reached": None, "best": 0.8, "elapsed_s": 100.0})
    watch.on_train_start(None, None)
    _validate(watch, 0.91, 50, 4)
    assert watch.summary()["wall_s"] >= 100.0 and watch.state_dict()["elapsed_s"] >= 100.0


@pytest.mark.parametrize("config,says", [
    (TargetConfig(metric="val/acc", value=None, mode="auto"), "target.value: missing"),
    (TargetConfig(metric=None, value=0.9, mode="auto"), "target.metric: missing"),
    (TargetConfig(metric="test/acc", value=0.9, mode="auto"), "target.metric: 'test/acc' is not a metric measured while training"),
])
def test_a_target_it_cannot_watch_is_one_line(config, says):
    with pytest.raises(UserError) as caught:
        config.check()
    assert caught.value.line().startswith(says)
