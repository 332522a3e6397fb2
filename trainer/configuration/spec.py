"""`validate`: the composed config checked in one pass, each group against the declaration of the
room that owns it (`GROUPS`; a group's schema, rules and builder stand together there), into the
frozen `RunSpec` every phase reads. The top-level keys of conf/train.yaml are checked with them
(trainer/configuration/top_level.py). Anything wrong stops the run before anything is built, with one
line naming the full key."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, cast

from omegaconf import DictConfig, OmegaConf

from trainer.configuration.recipes import compose_here
from trainer.data import group as data
from trainer.groups import (callbacks, checkpointing, clipping, compile, logger, nonfinite, optimizer, precision,
                            regularization, scheduler, task, trainer)
from trainer.groups.checkpointing import CheckpointingConfig
from trainer.groups.communication import UNCOMPRESSED, Communication, communication_of
from trainer.groups.compile import CompileConfig
from trainer.groups.optimizer.schema import OptimizerConfig
from trainer.groups.precision import PrecisionConfig
from trainer.groups.regularization import RegularizationConfig
from trainer.groups.scheduler import SchedulerConfig
from trainer.configuration.top_level import (RunIdentity, TargetConfig, TopLevelKeys, identity, target_config, to_plain,
                                             top_level_keys)
from trainer.infra.errors import UserError, choices
from trainer.infra.schema import ConfigGroup, schema_of_dataclass
from trainer.models import group as model

#: Every group of a run's config, in the order it is checked; each declared by the module that owns it.
GROUPS: tuple[ConfigGroup, ...] = (task.GROUP, data.GROUP, model.GROUP, optimizer.GROUP, scheduler.GROUP, precision.GROUP,
                                   compile.GROUP, checkpointing.GROUP, clipping.GROUP, nonfinite.GROUP,
                                   regularization.GROUP, logger.GROUP, callbacks.GROUP, trainer.GROUP)
BY_NAME: Mapping[str, ConfigGroup] = {group.name: group for group in GROUPS}


@dataclass(frozen=True)
class RunSpec:
    """The validated run: plain values with defaults filled, frozen. Decisions derived from it are
    the plan's (trainer/phases/plan.py), never written back into it."""

    top: TopLevelKeys
    identity: RunIdentity
    data: dict[str, Any]
    model: dict[str, Any]
    optimizer: OptimizerConfig
    scheduler: SchedulerConfig
    precision: PrecisionConfig
    compile: CompileConfig
    checkpointing: CheckpointingConfig
    regularization: RegularizationConfig
    loggers: dict[str, dict[str, Any]]
    trainer: dict[str, Any]
    target: TargetConfig
    #: The `task` group: a task definition's `_target_` and its keys (trainer/groups/task.py).
    task: dict[str, Any] = field(default_factory=lambda: {"_target_": task.CLASSIFICATION})
    callbacks: dict[str, dict[str, Any]] = field(default_factory=dict)
    clipping: dict[str, Any] = field(default_factory=dict)
    nonfinite: dict[str, Any] = field(default_factory=dict)
    #: The `trainer` group's gradient compression keys (not Trainer arguments: not in `trainer`).
    communication: Communication = UNCOMPRESSED
    activation_checkpointing: list[str] = field(default_factory=list)
    choices: dict[str, str] = field(default_factory=dict)
    #: The whole config as validated: plain containers, interpolations resolved.
    resolved: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def validate(cfg: DictConfig | Mapping[str, Any], group_choices: Mapping[str, str] | None = None) -> RunSpec:
    """Check the composed config against every group's schema; raise `UserError` on the first fault."""
    plain = to_plain(cfg)
    plain.pop("hydra", None)
    # A config composed before the task group existed (a saved run's config_resolved.yaml) is a
    # classification run.
    plain.setdefault("task", {"_target_": task.CLASSIFICATION})
    _check_layout(plain)
    top, run_identity = top_level_keys(plain), identity(plain.get("run", {}))
    # A group's values are a mapping (_check_layout saw to it); callbacks=[] composes none. Each
    # group's checked values go into the RunSpec field of its name (the logger group's: `loggers`).
    checked = {group.name: group.validate(plain.get(group.name) or {}) for group in GROUPS if group.validate}
    checked["loggers"] = checked.pop("logger")
    return RunSpec(top=top, identity=run_identity, **checked,
                   communication=communication_of(plain.get("trainer") or {}),
                   activation_checkpointing=model.checkpointed_stages(plain["model"]),
                   target=target_config(plain.get("target") or {}), choices=dict(group_choices or {}), resolved=plain)


def choice_values(group: str, choice: str) -> dict[str, Any]:
    """The values of ``GROUP/CHOICE.yaml`` as Hydra composes them: through the running app's search
    path (a team's folders included) inside a Hydra app, else from the package's conf/."""
    composed = compose_here(f"{group}/{choice}")
    return cast(dict[str, Any], OmegaConf.to_container(composed[group], resolve=True))  # a DictConfig's


def choice_config(group: str, choice: str, **overrides: Any) -> Any:
    """The checked config of ``conf/GROUP/CHOICE.yaml`` with `overrides` applied: the values a run of
    that choice gets, for use from Python (tests, benchmarks), from the same file a run composes."""
    validate_group = BY_NAME[group].validate
    assert validate_group is not None
    return validate_group({**choice_values(group, choice), **overrides})


def _check_layout(plain: Mapping[str, Any]) -> None:
    """Only known top-level keys, and every group present as a mapping."""
    allowed = sorted(set(BY_NAME) | set(schema_of_dataclass(TopLevelKeys).fields) | {"run", "target"})
    for key in plain:
        if key not in allowed:
            raise UserError(str(key), "unknown top-level key", choices(allowed))
    for group in BY_NAME:
        if group == "callbacks" and plain.get(group) is None:
            continue  # callbacks=[] composes no node: no callbacks beyond the framework's
        if not isinstance(plain.get(group), dict):
            raise UserError(group, "missing or not a mapping", f"a choice of the {group} group ({group}=NAME)")
    if not isinstance(plain.get("run", {}), dict):
        raise UserError("run", "not a mapping", "run.name=NAME, run.root=FOLDER")
