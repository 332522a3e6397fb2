"""The `callbacks` group (conf/callbacks/, trainer/groups/callbacks.py) when the config is
validated and the callbacks built: each entry is checked against its constructor (a wrong key is one
line naming `callbacks.<name>.<key>` with the allowed keys, also for the keys EMA hands on to torch's
AveragedModel); a callback the framework sets itself is refused with a pointer to the group that
sets it; what is built must be a Lightning callback; and a weight-averaging callback's average is
what the test after fit measures (Lightning 2.6 alone would test the checkpoint's raw weights)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, EMAWeightAveraging, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

import trainer.callbacks
from tests.helpers import ON_CPU, compose
from trainer.callbacks.steps import StepBoundary
from trainer.configuration.spec import validate
from trainer.groups.task import logged_metrics
from trainer.groups.callbacks import ADDED_BY_CONFIG, AveragedWeightsUnderTest, EMAHorizonCheck, build_callbacks
from trainer.groups.clipping import GradientClipping
from trainer.infra.errors import UserError


class TeamClipping(GradientClipping):
    """A team's variant of the framework's clipping: a second clipper would fight the group's."""


class TeamBoundary(StepBoundary):
    """A team's callback built on the framework's reusable step-boundary base."""


def not_a_callback() -> dict:
    return {}


def refusal(*overrides: str) -> UserError:
    with pytest.raises(UserError) as caught:
        validate(compose([*ON_CPU, *overrides]))
    return caught.value


def test_the_ready_choices_validate_in_the_order_composed():
    spec = validate(compose([*ON_CPU, "callbacks=[early_stopping,ema,device_stats]"]))
    assert list(spec.callbacks) == ["early_stopping", "ema", "device_stats", "utilisation"]
    assert spec.callbacks["early_stopping"]["monitor"] == "val/loss"


def test_a_teams_callback_is_added_by_its_target():
    target = "tests.unit.test_callbacks_group.TeamBoundary"
    spec = validate(compose([*ON_CPU, "callbacks=ema", f"+callbacks.mine._target_={target}"]))
    assert list(spec.callbacks) == ["ema", "mine"] and spec.callbacks["mine"] == {"_target_": target}


@pytest.mark.parametrize("target, pointer", [
    ("lightning.pytorch.callbacks.ModelCheckpoint", "the checkpointing group"),
    ("lightning.pytorch.callbacks.TQDMProgressBar", "the top-level key progress"),
    ("lightning.pytorch.callbacks.RichProgressBar", "the top-level key progress"),
    ("lightning.pytorch.callbacks.GradientAccumulationScheduler", "trainer.accumulate_grad_batches"),
    ("lightning.pytorch.callbacks.LearningRateMonitor", "the logger group"),
    ("trainer.groups.clipping.GradientClipping", "the clipping group"),
    ("tests.unit.test_callbacks_group.TeamClipping", "the clipping group"),
    ("trainer.groups.nonfinite.NonFiniteGuard", "the nonfinite group"),
    ("trainer.groups.checkpointing.PeriodicCheckpoint", "the checkpointing group"),
    ("trainer.callbacks.progress.PlainProgress", "the top-level key progress"),
    ("trainer.callbacks.throughput.ThroughputMeter", "remove the entry"),
])
def test_a_callback_the_framework_sets_is_refused_with_a_pointer_to_its_group(target, pointer):
    error = refusal(f"+callbacks.extra._target_={target}")
    assert error.where == "callbacks.extra"
    assert "set by the framework" in error.problem or "the framework's own" in error.problem
    assert error.allowed.startswith(("use " + pointer, pointer))


def _framework_callback_classes() -> list[type]:
    modules = [importlib.import_module(f"trainer.callbacks.{module.name}")
               for module in pkgutil.iter_modules(trainer.callbacks.__path__)]
    modules += [importlib.import_module(name) for name in ("trainer.groups.checkpointing", "trainer.groups.logger")]
    return [cls for module in modules for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, Callback) and cls.__module__ == module.__name__ and cls is not StepBoundary
            and cls.__name__ not in ADDED_BY_CONFIG]


@pytest.mark.parametrize("cls", _framework_callback_classes(), ids=lambda cls: cls.__name__)
def test_every_callback_class_of_the_framework_is_refused(cls):
    error = refusal(f"+callbacks.extra._target_={cls.__module__}.{cls.__qualname__}")
    assert error.where == "callbacks.extra", error.line()


def test_the_frameworks_callbacks_added_by_config_are_accepted():
    spec = validate(compose([*ON_CPU, "callbacks=device_stats"]))
    assert spec.callbacks["utilisation"] == {"_target_": "trainer.callbacks.utilisation.UtilisationSampler",
                                             "interval_s": 0.5}
    built = build_callbacks(spec.callbacks, has_logger=True, accelerator="cpu")
    assert [type(c).__name__ for c in built] == ["DeviceStatsMonitor", "UtilisationSampler"]


def test_a_teams_callback_on_the_frameworks_reusable_base_is_accepted():
    assert validate(compose([*ON_CPU, "+callbacks.b._target_=tests.unit.test_callbacks_group.TeamBoundary"]))


def test_a_target_that_is_not_a_callback_is_one_line():
    error = refusal("+callbacks.x._target_=torch.nn.Identity")
    assert error.where == "callbacks.x._target_" and "not a Lightning callback" in error.problem


def test_a_wrong_key_names_the_callback_and_the_key_with_what_is_allowed():
    error = refusal("callbacks=early_stopping", "+callbacks.early_stopping.patiense=5")
    assert error.where == "callbacks.early_stopping.patiense"
    assert "patience" in error.allowed and "min_delta" in error.allowed


def test_a_wrong_key_ema_would_hand_on_to_averaged_model_is_one_line_at_validation():
    # EMAWeightAveraging takes **kwargs and passes them to torch's AveragedModel when fit starts.
    error = refusal("callbacks=ema", "+callbacks.ema.decya=0.99")
    assert error.where == "callbacks.ema.decya" and "decay" in error.allowed and "use_buffers" in error.allowed
    assert refusal("callbacks=ema", "callbacks.ema.decay=high").where == "callbacks.ema.decay"


def test_early_stopping_on_a_metric_the_task_does_not_log_is_refused_before_training():
    """Checked against the task once it is built (trainer/phases/build.py), with the metrics it logs."""
    from trainer.phases.build import check_metric_names
    from trainer.tasks.classification import Classification

    spec = validate(compose([*ON_CPU, "callbacks=early_stopping", "callbacks.early_stopping.monitor=val/accuracy"]))
    task = Classification()
    task.num_classes = 3
    with pytest.raises(UserError) as caught:
        check_metric_names(spec, logged_metrics(task))
    assert caught.value.where == "callbacks.early_stopping.monitor"
    assert caught.value.line() == ("callbacks.early_stopping.monitor: 'val/accuracy' is not a metric this task logs; "
                                   "allowed: train/loss, train/acc, val/loss, val/acc")


def test_a_callback_switched_off_with_null_is_left_out():
    assert validate(compose([*ON_CPU, "callbacks=[early_stopping,ema]", "callbacks.ema=null"])).callbacks.keys() == {
        "early_stopping"}


def test_what_a_factory_builds_must_be_a_callback():
    with pytest.raises(UserError) as caught:
        build_callbacks({"f": {"_target_": "tests.unit.test_callbacks_group.not_a_callback"}}, True, "cpu")
    assert caught.value.where == "callbacks.f._target_" and "built a dict" in caught.value.problem


def test_a_constructor_that_refuses_its_arguments_is_one_line():
    with pytest.raises(UserError) as caught:
        build_callbacks({"es": {"_target_": "lightning.pytorch.callbacks.EarlyStopping", "monitor": "val/loss",
                                "mode": "sideways"}}, True, "cpu")
    assert caught.value.where == "callbacks.es" and "sideways" in caught.value.problem


def test_device_stats_without_a_logger_is_refused_before_fit():
    with pytest.raises(UserError) as caught:
        build_callbacks({"ds": {"_target_": "lightning.pytorch.callbacks.DeviceStatsMonitor", "cpu_stats": False}},
                        has_logger=False, accelerator="cpu")
    assert caught.value.where == "callbacks.ds" and "logger" in caught.value.allowed


def test_built_callbacks_keep_their_order_and_ema_gets_its_companions():
    built = build_callbacks({"es": {"_target_": "lightning.pytorch.callbacks.EarlyStopping", "monitor": "val/loss"},
                             "ema": {"_target_": "lightning.pytorch.callbacks.EMAWeightAveraging", "decay": 0.9}},
                            True, "cpu")
    assert [type(c) for c in built] == [EarlyStopping, EMAWeightAveraging, AveragedWeightsUnderTest, EMAHorizonCheck]


class _LogsValLoss(BoringModel):
    def validation_step(self, batch, batch_idx):
        out = super().validation_step(batch, batch_idx)
        self.log("val_loss", out["x"])
        return out


class _WeightsUnderTest(Callback):
    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.weight = pl_module.layer.weight.detach().clone()


@pytest.mark.run
def test_the_test_after_fit_measures_the_best_checkpoints_averaged_weights(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss")
    probe = _WeightsUnderTest()
    averaging = build_callbacks({"ema": {"_target_": "lightning.pytorch.callbacks.EMAWeightAveraging",
                                         "decay": 0.9}}, True, "cpu")
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=5, limit_val_batches=1,
                        limit_test_batches=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[*averaging, checkpoint, probe])
    model = _LogsValLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
        trainer.test(model, ckpt_path="best", verbose=False)
    saved = torch.load(checkpoint.best_model_path, weights_only=True)
    assert torch.equal(probe.weight, saved["state_dict"]["layer.weight"])  # the average
    assert not torch.equal(probe.weight, saved["current_model_state"]["layer.weight"])  # not the raw weights


@pytest.mark.parametrize("decay, steps, warned", [(0.999, 380, True), (0.95, 380, False), (0.999, 20_000, False)])
def test_an_ema_that_averages_over_more_steps_than_the_run_has_is_warned_about(caplog, decay, steps, warned):
    """Measured: decay 0.999 over the digits ViT's 380 steps validated at 0.14 accuracy, 0.95 at 0.89."""
    spec = validate(compose([*ON_CPU, "callbacks=ema", f"callbacks.ema.decay={decay}"]))
    built = build_callbacks(spec.callbacks, has_logger=True, accelerator="cpu")
    check = next(c for c in built if isinstance(c, EMAHorizonCheck))

    class Stub:
        estimated_stepping_batches = steps

    with caplog.at_level("WARNING", logger="trainer"):
        check.on_fit_start(Stub(), None)
    lines = [r.getMessage() for r in caplog.records if "callbacks.ema.decay" in r.getMessage()]
    assert bool(lines) == warned
    if warned:
        assert "Try callbacks.ema.decay=0.974 or less" in lines[0] and "\n" not in lines[0]


def test_the_rich_bar_reads_its_metrics_at_log_steps_only(monkeypatch):
    """Lightning's bar reads the logged tensors on the host after every batch (a wait for the GPU
    each step); the framework's asks Lightning only at the log steps and shows the last values between,
    with the step's training loss (not a logged value: the task logs it once an epoch) asked of the
    loss record at the log steps too."""
    from lightning.pytorch.callbacks import RichProgressBar

    from tests.helpers import fake_trainer_with_log_steps
    from trainer.callbacks.progress import LogStepRichProgressBar

    asked, losses_read = [], []
    monkeypatch.setattr(RichProgressBar, "get_metrics", lambda self, trainer, module: asked.append(trainer.global_step)
                        or {"v_num": 0})
    bar = LogStepRichProgressBar(latest_loss=lambda: losses_read.append(1) or float(len(asked)))
    shown = []
    for step in range(1, 26):
        trainer = fake_trainer_with_log_steps(training=True, global_step=step, log_every_n_steps=10, callback_metrics={})
        shown.append(bar.get_metrics(trainer, None)["train/loss_step"])
    assert asked == [1, 10, 20] and len(losses_read) == 3
    assert shown[8] == 1.0 and shown[9] == 2.0 and shown[-1] == 3.0
    validating = fake_trainer_with_log_steps(training=False, global_step=25, log_every_n_steps=10,
                                             callback_metrics={"train/loss_epoch": torch.tensor(2.5)})
    assert bar.get_metrics(validating, None) == {"v_num": 0, "train/loss_epoch": 2.5}  # outside training: as asked
