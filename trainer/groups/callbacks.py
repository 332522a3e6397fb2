"""The `callbacks` group (conf/callbacks/): Lightning callbacks a person adds by config.

    callbacks=[early_stopping,ema]                  ready choices, one YAML each
    +callbacks.mine._target_=my_pkg.MyCallback      a team's own (+callbacks.mine.ARG=VALUE for its arguments)

Each entry is checked when the config is validated (trainer/configuration/spec.py, and
`check_callback` here) and built by `build_callbacks` after the framework's own, so Lightning calls
it after them at every hook; docs/config.md ("Callbacks and Lightning objects") has the rest."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
from typing import Any, Mapping

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.callbacks import (Callback, DeviceStatsMonitor, EMAWeightAveraging,
                                         GradientAccumulationScheduler, LearningRateMonitor, ModelCheckpoint,
                                         ProgressBar, WeightAveraging)
from torch.optim.swa_utils import AveragedModel

from trainer.infra.errors import UserError
from trainer.infra.instantiation import construct
from trainer.infra.schema import (ConfigGroup, Schema, check_mapping, check_target, locate_target,
                                  schema_of_callable)

log = logging.getLogger("trainer")

#: The decay EMAWeightAveraging uses when the config does not set one (Lightning's own default).
EMA_DEFAULT_DECAY = inspect.signature(EMAWeightAveraging).parameters["decay"].default

#: Lightning callbacks the framework sets from its own groups: a second one would fight them.
OWNED_LIGHTNING_CALLBACKS: tuple[tuple[type, str], ...] = (
    (ModelCheckpoint, "the checkpointing group (checkpointing=default|off, checkpointing.monitor=..., "
                      "checkpointing.save_top_k=...)"),
    (ProgressBar, "the top-level key progress (progress=auto|rich|plain|off)"),
    (GradientAccumulationScheduler, "trainer.accumulate_grad_batches"),
    (LearningRateMonitor, "the logger group: the learning rate is logged whenever a logger is on (logger=csv, ...)"),
)

#: The framework's callbacks that a group or key sets, and what sets each; by class name, so the check
#: imports none of their modules. Any other Callback class of this package is the framework's as well.
OWNED_FRAMEWORK_CALLBACKS: dict[str, str] = {
    "GradientClipping": "the clipping group (clipping=percentile|autoclip|fixed_norm|value|off)",
    "NonFiniteGuard": "the nonfinite group (nonfinite=skip|off)",
    "PeriodicCheckpoint": "the checkpointing group (checkpointing.every_n_steps, checkpointing.every_minutes)",
    "PlainProgress": "the top-level key progress (progress=plain, progress_every_s=...)",
}
#: Base classes of this package meant to be built upon; a team's callback may derive from them.
REUSABLE_BASES = ("StepBoundary",)
#: The framework's callbacks that a run has only when its config adds them (conf/callbacks/).
ADDED_BY_CONFIG = ("UtilisationSampler", "HostReads")  # callbacks=device_stats, callbacks=host_reads
_PACKAGE = __name__.split(".")[0]

#: Callbacks whose ``**kwargs`` go to another constructor, not to a parent class, so the signature
#: check cannot follow them: WeightAveraging hands them to torch's AveragedModel when fit starts,
#: where a misspelt key would stop the run with a traceback. (callback, receiver, what it fills in)
KWARGS_FORWARDED: tuple[tuple[type, Any, tuple[str, ...]], ...] = ((WeightAveraging, AveragedModel, ("model",)),)


def check_callback(key: str, target: Any, arguments: Mapping[str, Any]) -> None:
    """Refuse, at validation, a `_target_` that is not a Lightning callback, one the framework sets
    itself, or keys that a callback forwards to a constructor the signature check cannot see."""
    if not inspect.isclass(target):
        return  # a factory function: what it returns is checked when it is built
    _refuse_owned(key, target)
    if not issubclass(target, Callback):
        raise UserError(f"{key}._target_", f"'{target.__module__}.{target.__qualname__}' is not a Lightning callback",
                        "a subclass of lightning.pytorch.callbacks.Callback")
    for owner, receiver, filled_in in KWARGS_FORWARDED:
        if issubclass(target, owner):
            own = schema_of_callable(target)
            forwarded = schema_of_callable(receiver, skip=filled_in)
            check_mapping(key, arguments, Schema({**forwarded.fields, **own.fields}, open=False), target.__name__)


def _refuse_owned(key: str, cls: type) -> None:
    for owned, pointer in OWNED_LIGHTNING_CALLBACKS:
        if issubclass(cls, owned):
            kind = "" if cls is owned else f" (a {owned.__name__})"
            raise UserError(key, f"{cls.__name__}{kind} is set by the framework", f"use {pointer}")
    for base in cls.__mro__:
        if base.__module__.split(".")[0] == _PACKAGE and base.__name__ not in (*REUSABLE_BASES, *ADDED_BY_CONFIG) \
                and issubclass(base, Callback):
            kind = "" if cls is base else f" (a {base.__name__})"
            use = OWNED_FRAMEWORK_CALLBACKS.get(base.__name__)
            if use:
                raise UserError(key, f"{cls.__name__}{kind} is set by the framework", f"use {use}")
            raise UserError(key, f"{cls.__name__}{kind} is the framework's own, and every run has it already",
                            "remove the entry")


def build_callbacks(specs: Mapping[str, Mapping[str, Any]], has_logger: bool, accelerator: str) -> list[Callback]:
    """The group's callbacks in the order composed (validated specs, `_target_` mappings)."""
    callbacks = []
    for name, spec in specs.items():
        key = f"callbacks.{name}"
        callback = construct(key, functools.partial(instantiate, spec, _convert_="all"))
        if not isinstance(callback, Callback):
            raise UserError(f"{key}._target_", f"'{spec['_target_']}' built a {type(callback).__name__}, "
                            "not a Lightning callback", "a subclass of lightning.pytorch.callbacks.Callback")
        _refuse_owned(key, type(callback))
        if isinstance(callback, DeviceStatsMonitor):
            _check_device_stats(key, spec, has_logger, accelerator)
        callbacks.append(callback)
        if isinstance(callback, WeightAveraging):
            callbacks.append(AveragedWeightsUnderTest(callback))
        decay = spec.get("decay", EMA_DEFAULT_DECAY)
        if isinstance(callback, EMAWeightAveraging) and isinstance(decay, (int, float)):
            callbacks.append(EMAHorizonCheck(key, float(decay)))
    return callbacks


class EMAHorizonCheck(Callback):
    """Warns once, as fit starts, when an EMA's decay averages over more steps than the run has.
    An EMA with decay d weighs about the last 1/(1-d) updates, and its start (the random initial
    weights) fades as d^steps. With Lightning's default 0.999 a run of a few hundred steps is
    validated and tested on weights still mostly at their initialization: the digits ViT recipe
    measured val accuracy 0.14 with it against 0.89 with decay 0.95 (benchmarks/accuracy_practices.sh)."""

    #: The initial weights' share of the average at the end of the run above which it warns.
    STALE_SHARE = 0.05

    def __init__(self, key: str, decay: float) -> None:
        self.key, self.decay = key, decay

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        steps = trainer.estimated_stepping_batches
        if not 0 < self.decay < 1 or not isinstance(steps, (int, float)) or steps == float("inf") or steps <= 0:
            return
        left = self.decay ** steps
        if left > self.STALE_SHARE:
            horizon = 1 / (1 - self.decay)
            suggestion = 1 - 10 / steps
            log.warning("%s.decay=%g averages over about the last %s steps and this run has %s: at its end the "
                        "initial weights still make up %.0f%% of the average that validation and the test use. "
                        "Try %s.decay=%.3g or less (or more steps)", self.key, self.decay, f"{horizon:,.0f}",
                        f"{int(steps):,}", 100 * left, self.key, max(0.5, suggestion))


class AveragedWeightsUnderTest(Callback):
    """Makes the test measure a weight-averaging callback's (EMA, SWA) averaged weights.

    The run tests the best checkpoint with the Trainer that trained (`trainer.test(ckpt_path="best")`).
    Lightning 2.6's WeightAveraging, still set up from fit, loads the checkpoint's raw weights
    (current_model_state) into the model, so the test would measure what the average was meant to
    replace; the average restored from the same checkpoint goes back in before the first test batch."""

    def __init__(self, averaging: WeightAveraging) -> None:
        self.averaging = averaging

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.averaging._average_model is not None:  # noqa: SLF001 - see the class docstring
            self.averaging._copy_average_to_current(pl_module)  # noqa: SLF001


def _check_device_stats(key: str, spec: Mapping[str, Any], has_logger: bool, accelerator: str) -> None:
    """DeviceStatsMonitor's own checks, which Lightning makes only once fit has started."""
    if not has_logger:
        raise UserError(key, "DeviceStatsMonitor writes through the run's loggers, and this run has none",
                        "a logger (logger=csv, tensorboard or wandb)")
    cpu_stats = spec.get("cpu_stats")
    if (cpu_stats or (cpu_stats is None and accelerator == "cpu")) and importlib.util.find_spec("psutil") is None:
        raise UserError(f"{key}.cpu_stats", "CPU statistics need the psutil package, which is not installed",
                        "false, or pip install psutil")


def validate(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The callbacks group's entries (name -> `_target_` mapping), each checked against its
    constructor; `check_callback` says what is refused."""
    callbacks = {}
    for name, spec in values.items():
        key = f"callbacks.{name}"
        if spec is None:
            continue  # a callback switched off with callbacks.NAME=null
        if not isinstance(spec, dict):
            raise UserError(key, "not a mapping", "{_target_: pkg.module.Callback, ...its arguments}")
        if not isinstance(spec.get("_target_"), str):
            raise UserError(f"{key}._target_", "missing", "the import path of a Lightning callback class")
        # What it is first (a callback, not one the framework sets), then whether its keys fit.
        target = locate_target(key, spec["_target_"])
        check_callback(key, target, {k: v for k, v in spec.items() if not (k.startswith("_") and k.endswith("_"))})
        callbacks[name] = check_target(key, spec)
    return callbacks


#: Docs Lightning's docstring does not give EMAWeightAveraging's arguments (it passes them on).
EMA_DOCS = {
    "decay": "averaged = decay x averaged + (1 - decay) x current, at each update",
    "update_every_n_steps": "optimizer steps between two updates of the average",
    "update_starting_at_step": "the first step that updates the average (null: from the start)",
    "update_starting_at_epoch": "the first epoch that updates the average (null: from the start)",
}

GROUP = ConfigGroup("callbacks", __name__, "callbacks added after the framework's: early stopping, EMA, a team's "
                    "own (+callbacks.NAME._target_=...)", validate, argument_docs={EMAWeightAveraging: EMA_DOCS})
