"""The `task` group: what is learned (trainer/tasks/): task=classification (the default),
task=language_model, or a team's own `_target_` (a `trainer.tasks.protocol.TaskDefinition`).

`build_definition` makes the definition, binds it to the data and gives it the regularization it
takes, refusing in one line what cannot apply to the task; `logged_metrics` names every metric a run
of the task logs, with its direction, and `check_metric` holds a key that names one to them."""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Optional, Sequence

from hydra.utils import instantiate

from trainer.data.base import DataInfo
from trainer.groups.regularization import BatchMixing, RegularizationConfig
from trainer.infra.errors import UserError
from trainer.infra.instantiation import construct
from trainer.infra.schema import ConfigGroup, check_target, locate_target
from trainer.tasks.protocol import UNITS, TaskDefinition

#: The splits a run logs metrics of, as "{split}/{name}" (trainer/task.py logs them).
SPLITS = ("train", "val", "test")

#: The default task, and what a config without a `task` group (one saved before it existed) means.
CLASSIFICATION = "trainer.tasks.classification.Classification"


def validate(values: dict[str, Any]) -> dict[str, Any]:
    path = values.get("_target_")
    target = locate_target("task", path) if isinstance(path, str) and path else None
    if target is not None and not (inspect.isclass(target) and issubclass(target, TaskDefinition)):
        raise UserError("task._target_", f"'{path}' is not a task definition",
                        "a subclass of trainer.tasks.protocol.TaskDefinition (docs/tasks.md)")
    checked = check_target("task", values)  # a missing _target_ is one line here
    unit = getattr(target, "unit", None)
    if unit not in UNITS:
        raise UserError("task._target_", f"'{path}' counts batches in '{unit}'", " or ".join(UNITS))
    return checked


def build_definition(cfg: Mapping[str, Any], info: DataInfo, regularization: RegularizationConfig) -> TaskDefinition:
    """The task's definition, bound to the data, with the regularization it takes."""
    definition = construct("task", lambda: instantiate(dict(cfg), _convert_="all"))
    if info.kind not in definition.data_kinds:
        raise UserError("task", f"{type(definition).__name__} cannot learn from {info.kind} (the data module's "
                        "kind)", f"data of kind {' or '.join(definition.data_kinds)}, or another task")
    for name in definition.model_inputs:
        if name not in info.model_inputs():
            raise UserError("data", f"the data module gives no {name}, which {type(definition).__name__} needs",
                            f"a data module of kind {' or '.join(definition.data_kinds)}")
    definition.bind(info)
    _check_regularization(definition, regularization)
    give_regularization(definition, regularization, info.num_classes)
    return definition


def give_regularization(definition: TaskDefinition, cfg: RegularizationConfig, num_classes: int) -> None:
    """The `regularization` group's settings a definition takes: its label smoothing, and the batch
    mixing (mixup, cutmix) where it names "mixing" and the settings mix at all."""
    mixing = BatchMixing(cfg, num_classes) if "mixing" in definition.regularization else None
    definition.use_regularization(cfg.label_smoothing, mixing if mixing is not None and mixing.active else None)


def _check_regularization(definition: TaskDefinition, cfg: RegularizationConfig) -> None:
    takes = definition.regularization
    name = type(definition).__name__
    if cfg.label_smoothing > 0 and "label_smoothing" not in takes:
        raise UserError("regularization.label_smoothing", f"{name} has no use for label smoothing",
                        "0 (regularization=off)")
    if (cfg.mixup_alpha > 0 or cfg.cutmix_alpha > 0) and "mixing" not in takes:
        raise UserError("regularization", f"{name} cannot mix batches (mixup and cutmix blend images and labels)",
                        "regularization=off" + (" or label_smoothing" if "label_smoothing" in takes else ""))


def check_task(definition: TaskDefinition, settings: Mapping[str, Any]) -> None:
    """The task's own refusals of the run's settings, one line for the first; then a task that
    does not define its loss."""
    for key, problem, allowed in definition.refusals(settings):
        raise UserError(key, problem, allowed)
    if type(definition).loss is TaskDefinition.loss:
        name = f"{type(definition).__module__}.{type(definition).__qualname__}"
        raise UserError("task._target_", f"{name} does not define loss(outputs, targets, training)",
                        "a TaskDefinition that defines its loss (docs/tasks.md)")


def logged_metrics(definition: TaskDefinition) -> dict[str, Optional[bool]]:
    """Every metric a run of the task logs ("val/acc"), with whether a higher value is better (None:
    the metric does not say; torchmetrics' `higher_is_better`): each split's loss, the task's
    metrics of the split, and for validation and test those computed from the loss."""
    logged: dict[str, Optional[bool]] = {}
    for split in SPLITS:
        logged[f"{split}/loss"] = False
        metrics = {**definition.metrics(split), **(definition.metrics_from_loss() if split != "train" else {})}
        for name, metric in metrics.items():
            logged[f"{split}/{name}"] = getattr(metric, "higher_is_better", None)
    return logged


def check_metric(key: str, name: str, logged: Mapping[str, Optional[bool]], splits: Sequence[str],
                 mode_key: Optional[str] = None, mode: Optional[str] = None) -> None:
    """`name` (given at `key`) must be a metric the task logs, of one of `splits`; with a mode
    ("max" or "min", given at `mode_key`), one that agrees with the metric's direction where it has one."""
    allowed = [metric for metric in logged if metric.split("/", 1)[0] in splits]
    if name not in allowed:
        raise UserError(key, f"'{name}' is not a metric this task logs" + (
            f" in {' or '.join(splits)}" if name in logged else ""), ", ".join(allowed))
    higher = logged[name]
    if mode_key is None or mode not in ("max", "min") or higher is None or (mode == "max") == higher:
        return
    raise UserError(mode_key, f"{mode} takes the {'highest' if mode == 'max' else 'lowest'} {name} as the best, "
                    f"but a {'higher' if higher else 'lower'} {name} is better", "max" if higher else "min")


def shown_metrics(logged: Mapping[str, Optional[bool]]) -> tuple[str, ...]:
    """What the per-epoch lines show: the training and validation metrics the task logs, losses first."""
    return tuple(name for split in ("train", "val") for name in logged if name.startswith(f"{split}/"))


def headline_metrics(logged: Mapping[str, Optional[bool]], objective: str) -> tuple[str, ...]:
    """The validation metric the curves draw beside the loss, and its training counterpart where the
    task logs one: the run's objective when it is a validation metric other than the loss, else the
    task's first validation metric; none when the task logs only losses."""
    candidates = [name for name in logged if name.startswith("val/") and name != "val/loss"]
    if not candidates:
        return ()
    shown = objective if objective in candidates else candidates[0]
    train = "train/" + shown.split("/", 1)[1]
    return (shown, train) if train in logged else (shown,)


def mode_of(mode: str, name: str, logged: Mapping[str, Optional[bool]]) -> str:
    """`mode` ("max", "min", or "auto"); auto: the direction the metric `name` has, "auto" where it has
    none (the caller's own rule then)."""
    higher = logged.get(name)
    if mode != "auto" or higher is None:
        return mode
    return "max" if higher else "min"


def objective_of(task: Mapping[str, Any], objective: str) -> str:
    """The metric a run returns to a sweeper: `objective`, or with objective=auto the task's own."""
    if objective != "auto":
        return objective
    return str(locate_target("task", task["_target_"]).objective)


GROUP = ConfigGroup("task", __name__, "what is learned: the batch, the loss, the metrics, the unit a batch is "
                    "counted in (samples or tokens)", validate, target=True)
