"""The `trainer` group (conf/trainer/): lightning.Trainer's own arguments, made into the Trainer.

- An argument given as a mapping with `_target_` (``trainer.strategy``, ``trainer.plugins``, ...)
  is instantiated here, fresh for each Trainer: Lightning attaches its accelerator and environment
  to a strategy, so one instance cannot serve two.
- Whatever Lightning rejects while the Trainer is built ends as one line naming the argument (found
  by trial Trainers when Lightning's message does not name it: docs/config.md). Values Lightning
  accepts here but fails on once fit starts are bounded in the schema instead (TRAINER_BOUNDS).
- The group's own keys beside the Trainer's (gradient_compression, powersgd_*) are the DDP gradient
  compression's (trainer/groups/communication.py): `validate` checks them and leaves them out of the
  Trainer's arguments; the spec keeps them as `spec.communication`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import warnings
from typing import Annotated, Any, Iterable, Iterator, Mapping, Optional, Union

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.plugins import CheckpointIO, ClusterEnvironment, LayerSync, Precision

from trainer.groups.communication import KEYS as COMMUNICATION_KEYS
from trainer.groups.communication import Communication, communication_of
from trainer.infra.errors import UserError, first_line
from trainer.infra.instantiation import construct
from trainer.infra.lean_lightning import mark_lean
from trainer.infra.schema import (AT_LEAST_ONE, FRACTION, NON_NEGATIVE, ConfigGroup, Range, Schema, check_mapping,
                                  check_target, describe, locate_target, matches, schema_of_callable)

#: What each argument allows, where Lightning's own message does not say it.
ALLOWED: dict[str, str] = {
    "accelerator": "auto, cpu, cuda (or gpu), mps",
    "strategy": "auto, ddp, ddp_spawn, fsdp, deepspeed (and their variants), or {_target_: a Strategy class}",
    "devices": "a positive count, a list of device ids, a string of ids ('0,1'), or auto / -1 (all)",
    "num_nodes": "a positive integer",
    "max_epochs": "-1 (no limit) or an integer >= 0",
    "max_steps": "-1 (no limit) or an integer >= 0",
    "max_time": "a duration 'DD:HH:MM:SS' or a mapping of timedelta arguments ({hours: 2})",
    **dict.fromkeys(("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
                     "overfit_batches"), "a fraction in [0, 1] or a number of batches (an integer >= 0)"),
    "val_check_interval": "a fraction of the epoch in [0, 1], a number of batches (an integer >= 1), or a "
                          "duration 'DD:HH:MM:SS'",
    "fast_dev_run": "true/false or a number of batches (an integer >= 0)",
    "reload_dataloaders_every_n_epochs": "an integer >= 0",
    "profiler": "simple, advanced, pytorch, or {_target_: a Profiler class}",
    "plugins": "a list of {_target_: ...} cluster environments or layer syncs",
    "benchmark": "true, false or null",
    "barebones": "false while the run has loggers, checkpoints or progress output (barebones mode turns them off)",
}


# Trainer arguments the framework sets from its own groups; setting them under `trainer.` would
# silently fight those groups, so they are refused with a pointer to the right place.
TRAINER_KEYS_OWNED_ELSEWHERE = {
    "precision": "the precision group (precision=bf16_mixed, ...)",
    "logger": "the logger group (logger=csv, ...)",
    "callbacks": "the callbacks group (callbacks=[early_stopping,ema], +callbacks.NAME._target_=pkg.Class)",
    "enable_checkpointing": "the checkpointing group (checkpointing=off)",
    "enable_progress_bar": "the top-level key progress (progress=off)",
    "default_root_dir": "the Hydra run folder (hydra.run.dir=...)",
    "gradient_clip_val": "the clipping group (clipping=fixed_norm clipping.max_norm=1.0, ...)",
    "gradient_clip_algorithm": "the clipping group (clipping=value, ...)",
}

#: Tighter bounds than lightning.Trainer's signature, for arguments Lightning accepts when the Trainer is
#: built but fails on once fit starts (0 accumulation, 0 epochs or batches between validations: a
#: ZeroDivisionError mid-run), reads as "always" (negative counts), or that the batch rules multiply first.
TRAINER_BOUNDS: dict[str, Any] = {
    "accumulate_grad_batches": Annotated[int, AT_LEAST_ONE],
    "num_nodes": Annotated[int, AT_LEAST_ONE],
    "check_val_every_n_epoch": Optional[Annotated[int, AT_LEAST_ONE]],
    "val_check_interval": Optional[Union[Annotated[int, AT_LEAST_ONE], Annotated[float, FRACTION], str,
                                         dict[str, int]]],
    "log_every_n_steps": Optional[Annotated[int, NON_NEGATIVE]],
    "min_epochs": Optional[Annotated[int, NON_NEGATIVE]],
    "min_steps": Optional[Annotated[int, NON_NEGATIVE]],
    "num_sanity_val_steps": Optional[Annotated[int, Range(ge=-1)]],
    # Plugin objects come as {_target_: ...} mappings; each is checked by `_plugins`.
    "plugins": Optional[Union[dict[str, Any], list[Any]]],
}


#: Lightning's hint, wherever `srun` is installed, to prefix the command with srun. Dropped: here SLURM
#: jobs are started by hydra/launcher=slurm (which does use srun), and the hint would mislead.
_SRUN_HINT = "The `srun` command is available on your system but is not used"


def make_trainer(given: Iterable[str], /, **arguments: Any) -> L.Trainer:
    """`lightning.Trainer(**arguments)`, `_target_` mappings among them instantiated; `given` are
    the keys the person set (the `trainer` group's), the only ones an error may name."""
    given = [key for key in given if key in arguments]
    flags = _torch_flags()
    try:
        # The warnings Lightning gives while constructing (the srun hint, ...) are shown only for a
        # Trainer that is made: a refused one ends with nothing but the line that says why.
        with warnings.catch_warnings(record=True) as said:
            trainer = _make(arguments)
        mark_lean(trainer)  # Lightning's per-step dispatch, less its calls of hooks nobody defines
        for warning in said:
            if _SRUN_HINT not in str(warning.message):  # see _SRUN_HINT
                warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno,
                                     warning.file, warning.line)
        return trainer
    except Exception as ex:  # noqa: BLE001 - Lightning refuses values with many exception types
        # Lightning sets determinism and cuDNN autotuning early in its constructor: a Trainer that could not
        # be made (nor the trials that look for why) leaves the process as it was, for a sweep's next job.
        try:
            fault = None if isinstance(ex, UserError) else _find_fault(arguments, given, ex)
        finally:
            _restore_torch_flags(flags)
        if fault is None:
            raise  # a UserError already, or the framework's own arguments fail without the person's: a bug
        raise fault from None


def _make(arguments: Mapping[str, Any]) -> L.Trainer:
    built = {key: _instantiated(key, value) for key, value in arguments.items()}
    for key in ("callbacks", "logger"):
        if isinstance(built.get(key), list):
            built[key] = list(built[key])  # Lightning appends its defaults to the list it is given
    return L.Trainer(**built)


def _instantiated(key: str, value: Any) -> Any:
    """`value` with `_target_` mappings (itself, or entries of a list) made into their objects."""
    if isinstance(value, list):
        return [_instantiated(f"{key}[{i}]", entry) if _is_target(entry) else entry for i, entry in enumerate(value)]
    if not _is_target(value):
        return value
    built = construct(f"trainer.{key}", lambda: instantiate(dict(value), _convert_="all"))
    annotation = _annotations().get(key)
    if annotation is not None and not matches(built, annotation):
        raise UserError(f"trainer.{key}._target_", f"'{value['_target_']}' built a {type(built).__name__}, "
                        f"not {describe(annotation)}", ALLOWED.get(key))
    return built


def _is_target(value: Any) -> bool:
    return isinstance(value, Mapping) and "_target_" in value


@functools.cache
def _annotations() -> dict[str, Any]:
    return {name: field.annotation for name, field in schema_of_callable(L.Trainer).fields.items()}


def _find_fault(arguments: Mapping[str, Any], given: list[str], failure: Exception) -> UserError | None:
    """The person's argument (or pair) that makes Lightning refuse, found by making the Trainer
    with each alone; None when the framework's own arguments fail without them."""
    framework = {key: value for key, value in arguments.items() if key not in given}
    with _quietly():
        if _refusal(framework) is not None:
            return None
        for key in given:
            refused = _refusal({**framework, key: arguments[key]})
            if refused is not None:
                return UserError(f"trainer.{key}", _problem(refused), ALLOWED.get(key))
        for i, first in enumerate(given):
            for second in given[i + 1:]:
                refused = _refusal({**framework, first: arguments[first], second: arguments[second]})
                if refused is not None:
                    return UserError(f"trainer.{second}", f"cannot be combined with trainer.{first}="
                                     f"{_show(arguments[first])}: {_problem(refused)}", ALLOWED.get(second))
    keys = ", ".join(f"trainer.{key}" for key in given)
    return UserError("trainer", f"Lightning refuses these arguments together ({keys}): {_problem(failure)}")


def _refusal(arguments: Mapping[str, Any]) -> Exception | None:
    try:
        _make(arguments)
    except Exception as ex:  # noqa: BLE001 - see make_trainer
        return ex
    return None


def _problem(ex: Exception) -> str:
    # Lightning writes argument names in Markdown backticks; the first line says what is wrong.
    line = first_line(ex).replace("`", "").strip().rstrip(".")
    return line or type(ex).__name__


def _show(value: Any) -> str:
    if _is_target(value):
        return f"{{_target_: {value['_target_']}}}"
    return repr(value) if isinstance(value, str) else str(value)


@contextlib.contextmanager
def _quietly() -> Iterator[None]:
    """The trial Trainers say nothing: Lightning logs its device report for each."""
    disabled = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(disabled)


def _torch_flags() -> tuple[bool, bool, bool, str | None]:
    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


def _restore_torch_flags(flags: tuple[bool, bool, bool, str | None]) -> None:
    deterministic, warn_only, benchmark, cublas = flags
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.backends.cudnn.benchmark = benchmark
    if cublas is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas


def validate(values: dict[str, Any]) -> dict[str, Any]:
    """Checked against `lightning.Trainer`'s own signature; only the keys given are kept. The
    compression keys are checked too, and left out (`communication_of` reads them)."""
    communication_of(values)
    values = {key: value for key, value in values.items() if key not in COMMUNICATION_KEYS}
    for key in values:
        if key in TRAINER_KEYS_OWNED_ELSEWHERE:
            raise UserError(f"trainer.{key}", "is set by the framework", f"use {TRAINER_KEYS_OWNED_ELSEWHERE[key]}")
    fields = {k: dataclasses.replace(v, annotation=TRAINER_BOUNDS.get(k, v.annotation))
              for k, v in schema_of_callable(L.Trainer).fields.items() if k not in TRAINER_KEYS_OWNED_ELSEWHERE}
    checked = check_mapping("trainer", values, Schema(fields, open=False), "lightning.Trainer")
    given = {k: v for k, v in checked.items() if k in values}
    for key, value in given.items():  # an object argument given as {_target_: ...}: made by `_instantiated`
        if key == "plugins":
            given[key] = _plugins(value)
        elif isinstance(value, dict) and "_target_" in value:
            given[key] = check_target(f"trainer.{key}", value)
    return given


def _plugins(value: Any) -> list[dict[str, Any]]:
    """The person's Trainer plugins: cluster environments and layer syncs, each a `_target_` mapping.
    The precision plugin is the precision group's, and every checkpoint is written by the framework's
    SafeCheckpointIO (atomic, weights-only): a plugin of either kind would replace them."""
    entries = [] if value is None else value if isinstance(value, list) else [value]
    plugins = []
    for i, entry in enumerate(entries):
        key = f"trainer.plugins[{i}]"
        if not (isinstance(entry, dict) and isinstance(entry.get("_target_"), str)):
            raise UserError(key, "not a plugin mapping", "{_target_: pkg.module.Plugin, ...its arguments}")
        plugin_cls = locate_target(key, entry["_target_"])
        if inspect.isclass(plugin_cls):  # (a factory function: Lightning checks what it returns)
            _check_plugin_kind(key, entry["_target_"], plugin_cls)
        plugins.append(check_target(key, entry))
    return plugins


def _check_plugin_kind(key: str, path: str, plugin_cls: type) -> None:
    if issubclass(plugin_cls, Precision):
        raise UserError(f"{key}._target_", f"'{path}' is a precision plugin, which the framework sets itself",
                        "use the precision group (precision=bf16_mixed|fp16_mixed|fp32, precision.scaler_* for "
                        "fp16's GradScaler)")
    if issubclass(plugin_cls, CheckpointIO):
        raise UserError(f"{key}._target_", f"'{path}' is a CheckpointIO, and every checkpoint is written by the "
                        "framework's SafeCheckpointIO (atomic, weights-only)",
                        "use the checkpointing group (checkpointing=default|off, checkpointing.every_n_steps=...)")
    if not issubclass(plugin_cls, (ClusterEnvironment, LayerSync)):
        raise UserError(f"{key}._target_", f"'{path}' is not a Lightning plugin",
                        "a ClusterEnvironment (lightning.pytorch.plugins.environments.SLURMEnvironment, ...) "
                        "or a LayerSync (lightning.pytorch.plugins.TorchSyncBatchNorm, ...)")


def slurm_environment(plugins: Any) -> bool:
    """Whether the Trainer gets Lightning's SLURM environment: inside a SLURM job, unless the
    person's plugins bring a cluster environment of their own. Deliberately without Lightning's
    auto-requeue: its SIGUSR1 handler writes an hpc_ckpt and requeues on its own, and a requeued
    run then restores that file whatever `resume` says. Preemption is submitit's signal and
    GracefulStop's checkpoint here."""
    with warnings.catch_warnings():  # Lightning's own test, without its srun hint (see _SRUN_HINT)
        warnings.simplefilter("ignore")
        if not SLURMEnvironment.detect():
            return False
    for plugin in plugins if isinstance(plugins, (list, tuple)) else [plugins] if plugins is not None else []:
        target = plugin.get("_target_") if isinstance(plugin, Mapping) else type(plugin)
        try:
            cls = locate_target("trainer.plugins", target) if isinstance(target, str) else target
        except UserError:
            continue  # an unknown target is reported where it is built
        if isinstance(cls, type) and issubclass(cls, ClusterEnvironment):
            return False
    return True


#: Trainer arguments whose docstring is silent, or to which the framework gives a meaning of its own.
ARGUMENT_DOCS = {
    "benchmark": "cuDNN autotuning; null: follows precision.tf32 on CUDA (trainer/phases/plan.py)",
    "accelerator": "cpu, gpu, cuda, mps, ... or auto: a GPU when there is one",
    "devices": "devices per node: a count, a list of indices, or auto (all)",
    "max_epochs": "stop training once this number of epochs is reached (-1: no limit)",
}

GROUP = ConfigGroup("trainer", __name__, "the lightning.Trainer's own arguments", validate, keys=Communication,
                    signature=L.Trainer,
                    argument_docs={L.Trainer: ARGUMENT_DOCS}, hidden=tuple(TRAINER_KEYS_OWNED_ELSEWHERE))
