"""The `trainer` group (conf/trainer/): lightning.Trainer's own arguments, made into the Trainer.

- An argument given as a mapping with `_target_` (``trainer.strategy``, ``trainer.profiler``, each
  entry of ``trainer.plugins``, any other) is instantiated here, so Lightning receives the object
  and not a dict; trainer/configuration/spec.py checked at validation that it imports and that its keys fit its
  constructor. Each Trainer made gets fresh objects: Lightning attaches its accelerator and
  environment to a strategy, so one instance cannot serve two Trainers.
- Whatever Lightning rejects while the Trainer is built ends as one line naming the argument.
  Lightning's messages do not always name it (``set_benchmark_cudnn expects a bool``) and some of
  its checks look at several arguments, so on failure, and only then, the Trainer is made again
  with each argument the person gave alone on top of the framework's own, and the first one that
  fails alone is named; two that fail only together are named together. (Values Lightning accepts
  here but fails on once fit starts are bounded in the schema instead: config.TRAINER_BOUNDS.)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from typing import Any, Iterable, Iterator, Mapping

import lightning as L
import torch
from hydra.utils import instantiate

from trainer.infra.errors import UserError, first_line
from trainer.configuration.instantiation import construct
from trainer.configuration.schema import describe, matches, schema_of_callable

#: What each argument allows, where Lightning's own message does not say it.
ALLOWED: dict[str, str] = {
    "accelerator": "auto, cpu, cuda (or gpu), mps",
    "strategy": "auto, ddp, ddp_spawn, fsdp, deepspeed (and their variants), or {_target_: a Strategy class}",
    "devices": "a positive count, a list of device ids, a string of ids ('0,1'), or auto / -1 (all)",
    "num_nodes": "a positive integer",
    "max_epochs": "-1 (no limit) or an integer >= 0",
    "max_steps": "-1 (no limit) or an integer >= 0",
    "max_time": "a duration 'DD:HH:MM:SS' or a mapping of timedelta arguments ({hours: 2})",
    "limit_train_batches": "a fraction in [0, 1] or a number of batches (an integer >= 0)",
    "limit_val_batches": "a fraction in [0, 1] or a number of batches (an integer >= 0)",
    "limit_test_batches": "a fraction in [0, 1] or a number of batches (an integer >= 0)",
    "limit_predict_batches": "a fraction in [0, 1] or a number of batches (an integer >= 0)",
    "overfit_batches": "a fraction in [0, 1] or a number of batches (an integer >= 0)",
    "val_check_interval": "a fraction of the epoch in [0, 1], a number of batches (an integer >= 1), or a "
                          "duration 'DD:HH:MM:SS'",
    "fast_dev_run": "true/false or a number of batches (an integer >= 0)",
    "reload_dataloaders_every_n_epochs": "an integer >= 0",
    "profiler": "simple, advanced, pytorch, or {_target_: a Profiler class}",
    "plugins": "a list of {_target_: ...} cluster environments or layer syncs",
    "benchmark": "true, false or null",
    "barebones": "false while the run has loggers, checkpoints or progress output (barebones mode turns them off)",
}


#: Lightning's hint, on any machine where `srun` is installed, to prefix the command with srun.
#: Dropped: here SLURM jobs are started by hydra/launcher=slurm (which does use srun), and the hint
#: would send people the wrong way.
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
        for warning in said:
            if _SRUN_HINT in str(warning.message):
                continue  # see _SRUN_HINT
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno, warning.file,
                                 warning.line)
        return trainer
    except Exception as ex:  # noqa: BLE001 - Lightning refuses values with many exception types
        # Lightning sets determinism and cuDNN autotuning early in its constructor: a Trainer that
        # could not be made (nor the trials that look for why) leaves the process as it was, for
        # the next job of a sweep.
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
