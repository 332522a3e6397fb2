"""`validate`: the composed config checked in one pass, each group against the declaration of the
room that owns it (`GROUPS`; a group's schema, rules and builder stand together there), into the
frozen `RunSpec` every phase reads. The top-level keys of conf/train.yaml are checked here. Anything
wrong stops the run before anything is built, with one line naming the full key."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Mapping, Optional, cast

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.configuration.recipes import CONF_DIR
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
from trainer.infra.errors import UserError, choices
from trainer.infra.schema import (NON_NEGATIVE, POSITIVE, ConfigGroup, Doc, Range, check_keys, check_mapping,
                                  schema_of_dataclass)
from trainer.models import group as model

#: Every group of a run's config, in the order it is checked; each declared by the module that owns it.
GROUPS: tuple[ConfigGroup, ...] = (task.GROUP, data.GROUP, model.GROUP, optimizer.GROUP, scheduler.GROUP, precision.GROUP,
                                   compile.GROUP, checkpointing.GROUP, clipping.GROUP, nonfinite.GROUP,
                                   regularization.GROUP, logger.GROUP, callbacks.GROUP, trainer.GROUP)
BY_NAME: Mapping[str, ConfigGroup] = {group.name: group for group in GROUPS}


@dataclass
class TopLevelKeys:
    """The top-level keys of conf/train.yaml (seed, resume, progress, ...): `spec.top`. The `run`
    mapping (name, root) is `RunIdentity`: `spec.identity`."""

    seed: Annotated[int, NON_NEGATIVE, Doc("seeds Python, NumPy, torch and the loader workers")]
    progress: Annotated[Literal["auto", "rich", "plain", "off"],
                        Doc("auto: a Rich bar on a terminal, plain lines in logs and pipes")]
    progress_every_s: Annotated[float, POSITIVE, Doc("plain progress: at most one line per this many seconds")]
    diagnose: Annotated[bool, Doc("time the parts of a training step instead of training (trainer/measure/diagnose.py)")]
    diagnose_steps: Annotated[int, Range(ge=3), Doc("timed steps per measurement of the diagnosis")]
    profile: Annotated[bool, Doc("record a few training steps with torch.profiler instead of training: trace, "
                                 "ops.md by category, roofline (trainer/measure/profile.py)")]
    profile_steps: Annotated[int, Range(ge=1, le=50), Doc("steps the profile keeps (after 3 skipped and 2 warm-up)")]
    memory_plan: Annotated[bool, Doc("measure where a step's memory goes and what each practice would change, "
                                     "before training (trainer/measure/memory.py)")]
    ladder: Annotated[Optional[str], Doc("set by +ladder=NAME: the run is one stage of an optimization ladder")]
    resume: Annotated[Optional[str], Doc("auto: from run.name's newest checkpoint; if_any: the same or fresh; "
                                         "a path; null: fresh")]
    objective: Annotated[str, Doc("what a run returns to a sweeper: split/metric, e.g. val/acc; auto: the "
                                  "task's (val/acc for classification, val/perplexity for a language model)")]

    def check(self, group: str = "") -> None:
        if self.diagnose and self.profile:
            raise UserError("profile", "diagnose=true and profile=true both replace training", "one of them")
        split, _, metric = self.objective.partition("/")
        if self.objective != "auto" and (split not in ("train", "val", "test") or not metric):
            raise UserError("objective", f"'{self.objective}' is not a metric name",
                            "auto, or split/metric with split train, val or test: val/acc, val/loss, test/acc, "
                            "train/loss")


@dataclass
class RunIdentity:
    """The `run` mapping: a run's stable name (its checkpoints are found by it after a requeue puts
    it in a new folder) and the folder under which runs are kept."""

    name: Annotated[Optional[str], Doc("the run's stable identity (null: the recipe or data-model, plus the "
                                       "overrides that change the result)")]
    root: Annotated[str, Doc("runs are kept, and resume=auto searches, under this folder")]


@dataclass
class TargetConfig:
    """The `target` mapping: time to accuracy (trainer/callbacks/target.py)."""

    metric: Annotated[Optional[str], Doc("split/metric to reach, e.g. val/acc (null: no target)")]
    value: Annotated[Optional[float], Doc("the value the metric must reach")]
    mode: Annotated[Literal["auto", "max", "min"], Doc("max: reached at or above value, min: at or below; "
                                                       "auto: min for a loss, else max")]

    def check(self, group: str = "") -> None:
        if self.metric is None and self.value is None:
            return
        if self.metric is None or self.value is None:
            raise UserError("target.metric" if self.metric is None else "target.value", "missing: a target needs "
                            "both", "target.metric=val/acc target.value=0.98")
        split, _, name = self.metric.partition("/")
        if split not in ("train", "val") or not name:
            raise UserError("target.metric", f"'{self.metric}' is not a metric measured while training",
                            "val/acc, val/loss or train/loss (the test split is evaluated once, at the end)")


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
    top, identity = _top_level_keys(plain), _identity(plain.get("run", {}))
    # A group's values are a mapping (_check_layout saw to it); callbacks=[] composes none.
    checked = {group.name: group.validate(plain.get(group.name) or {}) for group in GROUPS if group.validate}
    return RunSpec(
        top=top, identity=identity, data=checked["data"], model=checked["model"], optimizer=checked["optimizer"],
        scheduler=checked["scheduler"], precision=checked["precision"], compile=checked["compile"],
        checkpointing=checked["checkpointing"], regularization=checked["regularization"], loggers=checked["logger"],
        trainer=checked["trainer"], callbacks=checked["callbacks"], clipping=checked["clipping"],
        nonfinite=checked["nonfinite"], communication=communication_of(plain.get("trainer") or {}),
        activation_checkpointing=model.checkpointed_stages(plain["model"]),
        target=_target_config(plain.get("target") or {}), task=checked["task"], choices=dict(group_choices or {}), resolved=plain)


def choice_values(group: str, choice: str) -> dict[str, Any]:
    """The values of ``GROUP/CHOICE.yaml`` as Hydra composes them: through the running app's search
    path (a team's folders included) inside a Hydra app, else from the package's conf/."""
    if GlobalHydra.instance().is_initialized():
        composed = compose(config_name=f"{group}/{choice}")
    else:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            composed = compose(config_name=f"{group}/{choice}")
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


def _top_level_keys(plain: Mapping[str, Any]) -> TopLevelKeys:
    top_level = schema_of_dataclass(TopLevelKeys)
    values = {k: plain[k] for k in top_level.fields if k in plain}
    keys = TopLevelKeys(**check_mapping("", values, top_level, "the run's top-level keys (conf/train.yaml)"))
    keys.check()
    return keys


def _target_config(values: Mapping[str, Any]) -> TargetConfig:
    if not isinstance(values, Mapping):
        raise UserError("target", "not a mapping", "target.metric=val/acc target.value=0.98")
    return check_keys("target", dict(values), TargetConfig)


def _identity(values: Mapping[str, Any]) -> RunIdentity:
    values = dict(values)
    if isinstance(values.get("name"), (int, float)) and not isinstance(values["name"], bool):
        values["name"] = str(values["name"])  # run.name=2024 is a name, not a number
    identity = check_keys("run", values, RunIdentity)
    if identity.name is not None and not identity.name.strip():
        raise UserError("run.name", "is empty", "a name for the run (or leave it unset for the default)")
    return identity


def to_plain(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Resolve interpolations into plain containers; a broken interpolation is a user error."""
    if not isinstance(cfg, DictConfig):
        return dict(cfg)
    plain: dict[str, Any] = {}
    for key in cfg.keys():
        if key == "hydra":
            continue
        try:
            node = cfg[key]
            if isinstance(node, (DictConfig, ListConfig)):
                node = OmegaConf.to_container(node, resolve=True, throw_on_missing=True)
            plain[str(key)] = node
        except OmegaConfBaseException as ex:
            where = getattr(ex, "full_key", None) or str(key)
            raise UserError(str(where), _omegaconf_problem(ex)) from None
    return plain


def _omegaconf_problem(ex: OmegaConfBaseException) -> str:
    text = str(getattr(ex, "msg", None) or ex).splitlines()[0]
    if type(ex).__name__ == "MissingMandatoryValue":
        return "missing mandatory value (???); set it on the command line or in the config"
    return text
