"""The fast paths the framework puts in Lightning's per-step host work (trainer/infra/lean_lightning.py)
do the same work as Lightning's own: every hook a callback defines is called, in the same order with
the same arguments, every module and strategy hook is called with the hook's name where `self.log`
reads it, and a logged value's state lands on the value's device; what Lightning they rely
on is pinned here, so that an upgrade shows here first."""

from __future__ import annotations

import inspect
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import SimpleProfiler
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.connectors.logger_connector import result
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainer.infra.lean_lightning as lean

STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_zero_grad",
              "on_before_optimizer_step", "on_train_batch_end")


class Recorder(Callback):
    """Defines every per-step hook and a few others, and records each call with its arguments' kinds."""

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def _record(self, hook: str, *args: Any) -> None:
        self.calls.append((self.name, hook, tuple(type(a).__name__ for a in args)))


for _hook in (*STEP_HOOKS, "on_fit_start", "on_train_epoch_end", "on_validation_end"):
    setattr(Recorder, _hook, (lambda hook: lambda self, trainer, module, *args: self._record(hook, *args))(_hook))


class OnlyEpochEnd(Callback):
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.calls.append(("only", "on_train_epoch_end", ()))


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.net(batch[0]).square().mean()
        self.log("train/loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


MODULE_HOOKS = ("on_train_batch_start", "on_before_backward", "backward", "on_after_backward", "optimizer_step",
                "on_before_optimizer_step", "optimizer_zero_grad", "on_before_zero_grad", "on_train_batch_end",
                "on_train_epoch_end", "transfer_batch_to_device", "on_after_batch_transfer")


class NamedHooks(Tiny):
    """Records each module hook it is called at, with the hook name Lightning's bookkeeping says is
    running (what `self.log` checks), then does what LightningModule's own hook does."""

    def __init__(self, calls: list) -> None:
        super().__init__()
        self.calls = calls


for _hook in MODULE_HOOKS:
    def _recording(self: Any, *args: Any, _hook: str = _hook, **kwargs: Any) -> Any:
        self.calls.append(("module", _hook, self._current_fx_name))
        return getattr(L.LightningModule, _hook)(self, *args, **kwargs)
    setattr(NamedHooks, _hook, _recording)


def fit(lean_dispatch: bool, module: Any = None, **kwargs: Any) -> tuple[list, L.Trainer]:
    torch.manual_seed(0)
    calls: list = []
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                        callbacks=[Recorder("a", calls), OnlyEpochEnd(calls), Callback(), Recorder("b", calls)],
                        **kwargs)
    if lean_dispatch:
        lean.mark_lean(trainer)
    data = DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=2)
    trainer.fit(NamedHooks(calls) if module is None else module, train_dataloaders=data)
    return calls, trainer


def test_every_defined_hook_is_called_in_lightnings_order_with_its_arguments():
    lightning_calls, plain = fit(lean_dispatch=False)
    lean_calls, marked = fit(lean_dispatch=True)
    assert lean_calls == lightning_calls
    assert sum(1 for c in lean_calls if c[:2] == ("a", "on_before_optimizer_step")) == 8  # 2 epochs of 4 steps
    # Each module hook ran, with its own name as the hook running (backward and optimizer_step run
    # inside the strategy's hook of the same name).
    assert {c[1] for c in lean_calls if c[0] == "module"} == set(MODULE_HOOKS)
    assert all(name == hook for kind, hook, name in lean_calls if kind == "module")
    # And what the steps logged is the same.
    assert float(marked.callback_metrics["train/loss_epoch"]) == float(plain.callback_metrics["train/loss_epoch"])


def test_a_profiler_gets_lightnings_own_dispatch_so_its_report_names_every_hook():
    calls, trainer = fit(lean_dispatch=True, profiler=SimpleProfiler())
    names = set(trainer.profiler.recorded_durations)
    assert "[Callback]OnlyEpochEnd.on_train_batch_end" in names  # a hook it does not define, timed by Lightning
    assert calls == fit(lean_dispatch=False)[0]


def test_the_calls_lightning_goes_through_are_the_ones_replaced():
    lean.install()
    assert call._call_callback_hooks is lean.lean_dispatch
    assert call._call_lightning_module_hook is lean.lean_module_hook
    assert call._call_strategy_hook is lean.lean_strategy_hook
    parameters = list(inspect.signature(lean._lightning_dispatch).parameters)
    assert parameters == ["trainer", "hook_name", "args", "monitoring_callbacks", "kwargs"]
    assert list(inspect.signature(lean._lightning_module_hook).parameters) == ["trainer", "hook_name", "args",
                                                                               "pl_module", "kwargs"]
    assert list(inspect.signature(lean._lightning_strategy_hook).parameters) == ["trainer", "hook_name", "args",
                                                                                 "kwargs"]


def test_a_marked_trainer_with_a_profiler_times_every_module_and_strategy_hook():
    calls, trainer = fit(lean_dispatch=True, profiler=SimpleProfiler())
    names = set(trainer.profiler.recorded_durations)
    assert {"[LightningModule]NamedHooks.on_train_batch_start", "[Strategy]SingleDeviceStrategy.training_step",
            "[LightningModule]NamedHooks.optimizer_step"} <= names


def test_a_logged_state_already_on_the_device_is_not_walked_again_and_one_elsewhere_is():
    lean.install()
    meta = result._Metadata(fx="training_step", name="x", on_step=True, on_epoch=True)
    metric = result._ResultMetric(meta, is_tensor=True)
    walked = []

    with pytest.MonkeyPatch.context() as patch:
        # Lightning's walk, recorded instead of done (a second device is not at hand on a CPU machine).
        patch.setattr(lean, "_lightning_result_to", lambda self, *args, **kwargs: walked.append(args) or self)
        assert metric.to(torch.device("cpu")) is metric and walked == []  # everything is on the CPU already
        metric.to(device="cpu")  # any other form of the call: Lightning's own
        metric.cumulated_batch_size = torch.zeros((), device="meta")  # one state elsewhere
        metric.to(torch.device("cpu"))
    assert walked == [(), (torch.device("cpu"),)]
    assert not lean._all_on({"defaults": {"value": torch.zeros((), device="meta")}}, torch.device("cpu"))
    assert not lean._all_on({"states": [torch.zeros(())], "other": [torch.zeros((), device="meta")]},
                            torch.device("cpu"))


def test_lightnings_logged_state_is_moved_with_the_call_the_fast_path_expects():
    source = inspect.getsource(result._ResultCollection.log)
    assert "self[key].to(value.device)" in source


class LogStepProbe(Callback):
    """At every point a callback can ask, `at_log_step` beside Lightning's own `should_update_logs`;
    tells the fit to stop at the start of batch `stop_at` (Lightning counts a step that ends a fit
    as a log step too)."""

    def __init__(self, stop_at: int) -> None:
        self.stop_at, self.seen = stop_at, []

    def _compare(self, trainer: L.Trainer, where: str) -> None:
        from trainer.callbacks.steps import at_log_step

        self.seen.append((where, trainer.global_step, at_log_step(trainer),
                          bool(trainer._logger_connector.should_update_logs)))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._compare(trainer, "train start")
        if batch_idx == self.stop_at:
            trainer.should_stop = True
            self._compare(trainer, "told to stop")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._compare(trainer, "train end")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._compare(trainer, "validation end")


class TinyWithValidation(Tiny):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", self.net(batch[0]).square().mean())


@pytest.mark.parametrize("every, accumulate", [(3, 1), (2, 2), (0, 1)])
def test_at_log_step_answers_as_lightnings_own_rule_in_training_validation_accumulation_and_a_stop(every, accumulate):
    """trainer/callbacks/steps.py reads the fit loop's case of Lightning's `should_update_logs`
    directly (Lightning's property finds the running loop at 3.5 us a call): at each batch's start
    and end, under gradient accumulation, in validation, with logging off, and at the batch where
    the fit is told to stop, both say the same."""
    probe = LogStepProbe(stop_at=10)
    data = DataLoader(TensorDataset(torch.randn(24, 3)), batch_size=2)
    L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, log_every_n_steps=every, accumulate_grad_batches=accumulate,
              val_check_interval=4, callbacks=[probe]).fit(TinyWithValidation(), train_dataloaders=data,
                                                           val_dataloaders=DataLoader(TensorDataset(torch.randn(4, 3)),
                                                                                      batch_size=2))
    assert {where for where, *_ in probe.seen} == {"train start", "told to stop", "train end", "validation end"}
    assert [row for row in probe.seen if row[2] != row[3]] == []
    if every:  # both answers were True somewhere and False somewhere: the comparison compared something
        assert {answer for *_, answer, _ in probe.seen} == {True, False}
