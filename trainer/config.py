"""The schema of every config group, and `validate`: the composed config, checked in one pass.

Groups whose choice is a `_target_` (data, model, logger) take their schema from the target's
constructor signature, so a team's own class is checked the same way as ours. The framework's
own groups have a dataclass each, below. Everything wrong stops here, before any training, with a
single line naming the full key.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Mapping, Optional, Union

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.errors import UserError, choices
from trainer.schema import (
    AT_LEAST_ONE,
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    Range,
    Schema,
    check_mapping,
    check_value,
    schema_of_callable,
    schema_of_dataclass,
)

UnitInterval = Annotated[float, Range(ge=0, lt=1)]


# --- optimizer ---------------------------------------------------------------------------------
ScalingRule = Literal["sqrt", "linear", "none"]


@dataclass
class _OptimizerCommon:
    """What every optimizer choice shares: the batch-scaling rules and the parameter groups.

    `lr` and `weight_decay` are given at `ref_batch_size`; the run moves them to its global batch
    by `lr_scaling` and `wd_scaling` (see trainer/scaling.py).
    """

    lr: Annotated[float, POSITIVE] = 1e-3
    weight_decay: Annotated[float, NON_NEGATIVE] = 0.0
    ref_batch_size: Annotated[int, AT_LEAST_ONE] = 256
    lr_scaling: ScalingRule = "sqrt"
    wd_scaling: ScalingRule = "linear"
    # Decay on norm weights and biases (1-D parameters) only pulls them toward zero for no gain
    # (timm filter_bias_and_bn, torchvision --norm-weight-decay 0).
    decay_norm_and_bias: bool = False
    implementation: Literal["auto", "fused", "foreach", "for_loop"] = "auto"


@dataclass
class SGDConfig(_OptimizerCommon):
    name: Literal["sgd"] = "sgd"
    momentum: UnitInterval = 0.9
    nesterov: bool = True

    def check(self, prefix: str) -> None:
        if self.nesterov and self.momentum == 0:
            raise UserError(f"{prefix}.nesterov", "needs momentum > 0", "nesterov=false, or momentum in (0, 1)")


@dataclass
class AdamWConfig(_OptimizerCommon):
    name: Literal["adamw"] = "adamw"
    betas: tuple[UnitInterval, UnitInterval] = (0.9, 0.999)
    eps: Annotated[float, POSITIVE] = 1e-8


# --- scheduler ---------------------------------------------------------------------------------
@dataclass
class WarmupCosineConfig:
    """Linear warmup from 0, then cosine decay to ``min_lr_ratio * lr``, stepped every batch.

    ``warmup`` is a step count when it is an integer and a fraction of all steps when a float.
    """

    name: Literal["warmup_cosine"]
    warmup: Union[Annotated[int, NON_NEGATIVE], Annotated[float, Range(ge=0, lt=1)]] = 0.05
    min_lr_ratio: Annotated[float, FRACTION] = 0.0


@dataclass
class ConstantConfig:
    name: Literal["constant"]


@dataclass
class StepConfig:
    """Multiply the lr by ``gamma`` every ``step_size`` epochs."""

    name: Literal["step"]
    step_size: Annotated[int, AT_LEAST_ONE] = 10
    gamma: Annotated[float, Range(gt=0, le=1)] = 0.1


# --- precision, compile, checkpointing ---------------------------------------------------------
PrecisionName = Literal["auto", "fp32", "bf16_mixed", "fp16_mixed"]


AutoBool = Union[bool, Literal["auto"]]


@dataclass
class PrecisionConfig:
    """Numeric format and memory layout. GradScaler settings apply to fp16_mixed only."""

    name: PrecisionName
    channels_last: AutoBool = "auto"
    tf32: AutoBool = "auto"
    scaler_init_scale: Annotated[float, POSITIVE] = 65536.0
    scaler_growth_factor: Annotated[float, Range(gt=1)] = 2.0
    scaler_backoff_factor: Annotated[float, Range(gt=0, lt=1)] = 0.5
    scaler_growth_interval: Annotated[int, AT_LEAST_ONE] = 2000


@dataclass
class CompileConfig:
    """torch.compile of the network. ``mode`` off leaves the model eager; auto compiles on CUDA."""

    mode: Literal["off", "auto", "default", "reduce-overhead", "max-autotune"]
    fullgraph: bool = False
    dynamic: Optional[bool] = None


MonitoredMetric = Literal["val/acc", "val/loss", "train/loss", "train/acc"]


@dataclass
class CheckpointingConfig:
    """Keep the last checkpoint and the best ones by a validation metric."""

    enabled: bool
    monitor: MonitoredMetric = "val/loss"
    mode: Literal["max", "min"] = "min"
    save_last: bool = True
    save_top_k: Annotated[int, Range(ge=-1)] = 1
    every_n_epochs: Annotated[int, AT_LEAST_ONE] = 1
    #: Also write last.ckpt inside epochs, every N optimizer steps and/or every N minutes, so a
    #: killed run loses at most that much (resume=auto carries on from it, mid-epoch).
    every_n_steps: Optional[Annotated[int, AT_LEAST_ONE]] = None
    every_minutes: Optional[Annotated[float, POSITIVE]] = None


@dataclass
class RunConfig:
    """Top-level keys."""

    seed: Annotated[int, NON_NEGATIVE] = 42
    progress: Literal["auto", "rich", "plain", "off"] = "auto"
    progress_every_s: Annotated[float, POSITIVE] = 30.0
    #: Time the parts of a training step on the composed config instead of training (trainer/diagnose.py).
    diagnose: bool = False
    diagnose_steps: Annotated[int, Range(ge=3)] = 20
    #: Set by a ``+ladder=NAME`` config: the run is one stage of an optimization ladder.
    ladder: Optional[str] = None
    #: ``auto``: carry on from the newest valid checkpoint of the run named ``run.name`` (an error if
    #: there is none); ``if_any``: the same, or start fresh when there is none (a job that may be a
    #: requeue); a path: from that checkpoint; null: start fresh (trainer/resume.py).
    resume: Optional[str] = None
    #: What `train.py` returns to a sweeper: a logged metric ``split/name`` (train, val or test).
    objective: str = "val/acc"

    def check(self, group: str = "") -> None:
        split, _, metric = self.objective.partition("/")
        if split not in ("train", "val", "test") or not metric:
            raise UserError("objective", f"'{self.objective}' is not a metric name",
                            "split/metric with split train, val or test: val/acc, val/loss, test/acc, train/loss")


@dataclass
class RunIdentity:
    """The `run` mapping: a run's stable name (its checkpoints are found by it after a requeue puts
    it in a new folder) and the folder under which runs are kept."""

    name: Optional[str] = None
    root: str = "outputs"


OPTIMIZERS = {"sgd": SGDConfig, "adamw": AdamWConfig}
SCHEDULERS = {"warmup_cosine": WarmupCosineConfig, "constant": ConstantConfig, "step": StepConfig}

# Trainer arguments the framework sets from its own groups; setting them under `trainer.` would
# silently fight those groups, so they are refused with a pointer to the right place.
TRAINER_KEYS_OWNED_ELSEWHERE = {
    "precision": "the precision group (precision=bf16_mixed, ...)",
    "logger": "the logger group (logger=csv, ...)",
    "callbacks": "the framework's callbacks (checkpointing=..., progress=...)",
    "enable_checkpointing": "the checkpointing group (checkpointing=off)",
    "enable_progress_bar": "the top-level key progress (progress=off)",
    "default_root_dir": "the Hydra run folder (hydra.run.dir=...)",
    "plugins": "the precision group",
    "gradient_clip_val": "the clipping group (clipping=fixed_norm clipping.max_norm=1.0, ...)",
    "gradient_clip_algorithm": "the clipping group (clipping=value, ...)",
}


@dataclass
class RunSpec:
    """The validated run: plain values with defaults filled, ready for `resolve` and `build`."""

    run: RunConfig
    identity: RunIdentity
    data: dict[str, Any]
    model: dict[str, Any]
    optimizer: Union[SGDConfig, AdamWConfig]
    scheduler: Union[WarmupCosineConfig, ConstantConfig, StepConfig]
    precision: PrecisionConfig
    compile: CompileConfig
    checkpointing: CheckpointingConfig
    loggers: dict[str, dict[str, Any]]
    trainer: dict[str, Any]
    clipping: dict[str, Any] = field(default_factory=dict)
    nonfinite: dict[str, Any] = field(default_factory=dict)
    activation_checkpointing: list[str] = field(default_factory=list)
    choices: dict[str, str] = field(default_factory=dict)
    #: The whole config as validated: plain containers, interpolations resolved.
    resolved: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


GROUPS = ("data", "model", "optimizer", "scheduler", "precision", "compile", "checkpointing", "clipping", "nonfinite",
          "logger", "trainer")


def validate(cfg: DictConfig | Mapping[str, Any], group_choices: Mapping[str, str] | None = None) -> RunSpec:
    """Check the composed config against every group's schema; raise `UserError` on the first fault."""
    plain = to_plain(cfg)
    plain.pop("hydra", None)
    top_level = schema_of_dataclass(RunConfig)
    allowed_top = sorted(set(GROUPS) | set(top_level.fields) | {"run"})
    for key in plain:
        if key not in allowed_top:
            raise UserError(str(key), "unknown top-level key", choices(allowed_top))
    for group in GROUPS:
        if not isinstance(plain.get(group), dict):
            raise UserError(group, "missing or not a mapping", f"a choice of the {group} group ({group}=NAME)")

    run = RunConfig(**check_mapping("", {k: plain[k] for k in top_level.fields if k in plain}, top_level, "the run"))
    run.check()
    if not isinstance(plain.get("run", {}), dict):
        raise UserError("run", "not a mapping", "run.name=NAME, run.root=FOLDER")
    run_values = dict(plain.get("run", {}))
    if isinstance(run_values.get("name"), (int, float)) and not isinstance(run_values["name"], bool):
        run_values["name"] = str(run_values["name"])  # run.name=2024 is a name, not a number
    identity = _dataclass("run", run_values, RunIdentity)
    if identity.name is not None and not identity.name.strip():
        raise UserError("run.name", "is empty", "a name for the run (or leave it unset for the default)")
    optimizer = _choice("optimizer", plain["optimizer"], OPTIMIZERS)
    scheduler = _choice("scheduler", plain["scheduler"], SCHEDULERS)
    precision = _dataclass("precision", plain["precision"], PrecisionConfig)
    compile_ = _dataclass("compile", plain["compile"], CompileConfig)
    checkpointing = _dataclass("checkpointing", plain["checkpointing"], CheckpointingConfig)

    data = _target("data", plain["data"], skip=())
    from trainer.data.base import ImageClassificationData

    data_cls = locate_target("data", data["_target_"])
    if not (inspect.isclass(data_cls) and issubclass(data_cls, ImageClassificationData)):
        raise UserError("data._target_", f"'{data['_target_']}' is not a data module of this framework",
                        "a subclass of trainer.data.base.ImageClassificationData")
    if "batch_size" not in data:
        raise UserError("data.batch_size", "missing", "a positive integer (per-device batch size)")

    model_values = dict(plain["model"])
    stages = model_values.pop("activation_checkpointing", [])
    check_value("model.activation_checkpointing", stages, list[str])
    model = _target("model", model_values, skip=INJECTED_MODEL_ARGS)
    clipping = _target("clipping", plain["clipping"], skip=())
    nonfinite = _target("nonfinite", plain["nonfinite"], skip=())
    loggers = {}
    for name, spec in plain["logger"].items():
        if spec is None:
            continue  # a logger switched off with logger.NAME=null
        if not isinstance(spec, dict):
            raise UserError(f"logger.{name}", "not a mapping", "a logger config with _target_")
        loggers[name] = _target(f"logger.{name}", spec, skip=INJECTED_LOGGER_ARGS)

    trainer = plain["trainer"]
    for key in trainer:
        if key in TRAINER_KEYS_OWNED_ELSEWHERE:
            raise UserError(f"trainer.{key}", "is set by the framework", f"use {TRAINER_KEYS_OWNED_ELSEWHERE[key]}")
    import lightning

    trainer = check_mapping("trainer", trainer, _trainer_schema(lightning.Trainer), "lightning.Trainer")
    trainer = {k: v for k, v in trainer.items() if k in plain["trainer"]}

    return RunSpec(run, identity, data, model, optimizer, scheduler, precision, compile_, checkpointing, loggers, trainer,
                   clipping, nonfinite, list(stages), dict(group_choices or {}), plain)


INJECTED_MODEL_ARGS = ("num_classes", "in_channels", "image_size")
INJECTED_LOGGER_ARGS = ("save_dir",)


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


def _choice(group: str, values: dict[str, Any], schemas: Mapping[str, type]) -> Any:
    name = values.get("name")
    if name not in schemas:
        raise UserError(f"{group}.name", f"unknown {group} '{name}'", choices(schemas))
    return _dataclass(group, values, schemas[name])


def _dataclass(group: str, values: dict[str, Any], cls: type) -> Any:
    checked = check_mapping(group, values, schema_of_dataclass(cls), f"{group} ({cls.__name__})")
    if "betas" in checked and isinstance(checked["betas"], list):
        checked["betas"] = tuple(checked["betas"])
    instance = cls(**checked)
    check = getattr(instance, "check", None)
    if check:
        check(group)
    return instance


def _target(prefix: str, values: dict[str, Any], skip: tuple[str, ...]) -> dict[str, Any]:
    target_path = values.get("_target_")
    if not isinstance(target_path, str) or not target_path:
        raise UserError(f"{prefix}._target_", "missing", "the import path of a class or function (pkg.module.Name)")
    target = locate_target(prefix, target_path)
    kwargs = {k: v for k, v in values.items() if not (k.startswith("_") and k.endswith("_"))}
    for name in skip:
        if name in kwargs:
            raise UserError(f"{prefix}.{name}", "is filled in by the framework from the data", "remove the key")
    schema = schema_of_callable(target, skip=skip)
    checked = check_mapping(prefix, kwargs, schema, target_path)
    # Keep only what the person wrote (defaults stay the callee's business), plus Hydra's keys.
    out = {k: v for k, v in values.items() if k.startswith("_") and k.endswith("_")}
    out.update({k: checked[k] for k in kwargs})
    return out


def locate_target(prefix: str, path: str) -> Any:
    """Import `path` (``pkg.module.Name``); a failure names the key and the missing part."""
    import importlib

    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as ex:
            if ex.name and (module_name == ex.name or module_name.startswith(ex.name + ".")):
                continue  # this prefix is not a module; try a shorter one
            reason = f"importing '{module_name}' failed: {ex}"
            break
        except Exception as ex:  # noqa: BLE001 - the person's module failed to import
            reason = f"importing '{module_name}' failed: {type(ex).__name__}: {ex}"
            break
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                reason = f"'{module_name}' has no attribute '{attribute}'"
                break
            obj = getattr(obj, attribute)
            module_name = f"{module_name}.{attribute}"
        else:
            return obj
        break
    else:
        reason = f"no module named '{parts[0]}'"
    raise UserError(f"{prefix}._target_", f"cannot import '{path}': {reason}",
                    "an importable class or function (pkg.module.Name)")


def _trainer_schema(trainer_cls: type) -> Schema:
    schema = schema_of_callable(trainer_cls)
    fields = {k: v for k, v in schema.fields.items() if k not in TRAINER_KEYS_OWNED_ELSEWHERE}
    return Schema(fields, open=False)
