"""The schema of every config group, and `validate`: the composed config, checked in one pass.

Groups whose choice is a `_target_` (data, model, logger) take their schema from the target's
constructor signature, so a team's own class is checked the same way as ours. The framework's
own groups have a dataclass each, below. Everything wrong stops here, before any training, with a
single line naming the full key.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Mapping, Optional, Union, cast

import lightning
from hydra import compose, initialize_config_dir
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.plugins import CheckpointIO, ClusterEnvironment, LayerSync, Precision
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.callbacks.configured import check_callback
from trainer.data.base import ImageClassificationData
from trainer.infra.errors import UserError, choices
from trainer.infra.extras import require
from trainer.configuration.recipes import CONF_DIR
from trainer.configuration.schema import (
    AT_LEAST_ONE,
    Doc,
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
AutoBool = Union[bool, Literal["auto"]]

# The groups' values live in their YAML files (conf/GROUP/CHOICE.yaml), nowhere else: these
# dataclasses give each key its type, bounds and one-line doc, and have no defaults, so a value
# cannot silently differ between the YAML and the code (tests/unit/test_compose_all.py checks that
# every YAML sets every field).


# --- optimizer ---------------------------------------------------------------------------------
ScalingRule = Literal["sqrt", "linear", "none"]
#: optimizer.lr=find: the lr comes from Lightning's lr range test (trainer/modes/lr_finder.py).
LR_FIND = "find"
#: Lightning's suggestion skips the range test's first 10 losses and its last, and needs 2 more.
FIND_STEPS_MIN = 20


@dataclass
class _OptimizerCommon:
    """What every optimizer choice shares: the batch-scaling rules and the parameter groups.

    `lr` and `weight_decay` are given at `ref_batch_size`; the run moves them to its global batch
    by `lr_scaling` and `wd_scaling` (see trainer/groups/scaling.py).
    """

    lr: Annotated[Union[Annotated[float, POSITIVE], Literal["find"]],
                  Doc("learning rate at ref_batch_size, moved to the global batch by lr_scaling; find: Lightning's "
                      "lr range test picks it before training (find_*)")]
    weight_decay: Annotated[float, NON_NEGATIVE, Doc("weight decay at ref_batch_size, moved by wd_scaling")]
    ref_batch_size: Annotated[int, AT_LEAST_ONE, Doc("the global batch at which lr and weight_decay are given")]
    lr_scaling: Annotated[ScalingRule, Doc("lr x (B/ref)^1/2 (sqrt), x B/ref (linear) or as given (none)")]
    wd_scaling: Annotated[ScalingRule, Doc("weight decay x B/ref (linear), x (B/ref)^1/2 (sqrt) or as given")]
    # Decay on norm weights and biases (1-D parameters) only pulls them toward zero for no gain
    # (timm filter_bias_and_bn, torchvision --norm-weight-decay 0).
    decay_norm_and_bias: Annotated[bool, Doc("false: no weight decay on 1-D parameters (norm weights, biases)")]
    implementation: Annotated[Literal["auto", "fused", "foreach", "for_loop"],
                              Doc("optimizer kernel; auto: fused on CUDA (not under an fp16 GradScaler), else foreach")]
    layer_decay: Annotated[Optional[Annotated[float, Range(gt=0, le=1)]],
                           Doc("layer-wise lr decay: lr x this^k for a parameter k layers below the head "
                               "(timm models; null: off)")]
    # lr=find: the range of Lightning's range test (its defaults are 1e-8..1 and 100 steps).
    find_min_lr: Annotated[float, POSITIVE, Doc("lr=find: the lr the range test starts from")]
    find_max_lr: Annotated[float, POSITIVE, Doc("lr=find: the lr the range test rises to, exponentially")]
    find_steps: Annotated[int, Range(ge=FIND_STEPS_MIN),
                          Doc(f"lr=find: training steps of the range test (>= {FIND_STEPS_MIN}: its suggestion "
                              "leaves out the first 10)")]

    def check(self, prefix: str) -> None:
        if self.find_min_lr >= self.find_max_lr:
            raise UserError(f"{prefix}.find_max_lr", f"{self.find_max_lr:g} is not above find_min_lr "
                            f"{self.find_min_lr:g}", "a range with find_min_lr < find_max_lr, e.g. 1e-6 and 1")


@dataclass
class SGDConfig(_OptimizerCommon):
    name: Annotated[Literal["sgd"], Doc("the optimizer")]
    momentum: Annotated[UnitInterval, Doc("momentum factor")]
    nesterov: Annotated[bool, Doc("Nesterov momentum (needs momentum > 0)")]

    def check(self, prefix: str) -> None:
        super().check(prefix)
        if self.nesterov and self.momentum == 0:
            raise UserError(f"{prefix}.nesterov", "needs momentum > 0", "nesterov=false, or momentum in (0, 1)")


@dataclass
class AdamWConfig(_OptimizerCommon):
    name: Annotated[Literal["adamw"], Doc("the optimizer")]
    betas: Annotated[tuple[UnitInterval, UnitInterval], Doc("decay rates of the first and second moment estimates")]
    eps: Annotated[float, POSITIVE, Doc("added to the denominator for numerical stability")]


@dataclass
class LambConfig(_OptimizerCommon):
    """LAMB (You et al. 2019), timm's: Adam's update rescaled per tensor by ||w|| / ||update||, for
    large batches; tensors without weight decay (norm weights, biases) are not rescaled."""

    name: Annotated[Literal["lamb"], Doc("the optimizer")]
    betas: Annotated[tuple[UnitInterval, UnitInterval], Doc("decay rates of the first and second moment estimates")]
    eps: Annotated[float, POSITIVE, Doc("added to the denominator for numerical stability")]


@dataclass
class LarsConfig(_OptimizerCommon):
    """LARS (You et al. 2017), timm's: SGD with momentum whose step per tensor is scaled to
    trust_coeff x ||w|| / ||g + wd w||; tensors without weight decay are not rescaled."""

    name: Annotated[Literal["lars"], Doc("the optimizer")]
    momentum: Annotated[UnitInterval, Doc("momentum factor")]
    nesterov: Annotated[bool, Doc("Nesterov momentum (needs momentum > 0)")]
    trust_coeff: Annotated[float, POSITIVE, Doc("the trust coefficient: a tensor's step is about lr x trust_coeff "
                                                "x its norm")]

    def check(self, prefix: str) -> None:
        super().check(prefix)
        if self.nesterov and self.momentum == 0:
            raise UserError(f"{prefix}.nesterov", "needs momentum > 0", "nesterov=false, or momentum in (0, 1)")


# --- scheduler ---------------------------------------------------------------------------------
@dataclass
class WarmupCosineConfig:
    """Linear warmup from 0, then cosine decay to ``min_lr_ratio * lr``, stepped every batch."""

    name: Annotated[Literal["warmup_cosine"], Doc("linear warmup, then cosine decay, per optimizer step")]
    warmup: Annotated[Union[Annotated[int, NON_NEGATIVE], Annotated[float, Range(ge=0, lt=1)]],
                      Doc("warmup steps (an integer) or fraction of all steps (a float < 1)")]
    min_lr_ratio: Annotated[float, FRACTION, Doc("the lr the cosine ends at, as a fraction of the peak lr")]


@dataclass
class ConstantConfig:
    name: Annotated[Literal["constant"], Doc("the lr stays as derived")]


@dataclass
class StepConfig:
    """Multiply the lr by ``gamma`` every ``step_size`` epochs."""

    name: Annotated[Literal["step"], Doc("lr x gamma every step_size epochs")]
    step_size: Annotated[int, AT_LEAST_ONE, Doc("epochs between two decays")]
    gamma: Annotated[float, Range(gt=0, le=1), Doc("factor applied at each decay")]


@dataclass
class OneCycleConfig:
    """The one-cycle policy (Smith 2018; fastai's fit_one_cycle), torch's OneCycleLR stepped every
    optimizer step: from lr/div_factor up to the run's derived lr, then annealed far below it, with
    momentum (beta1 for Adam-family optimizers) moving the other way."""

    name: Annotated[Literal["one_cycle"], Doc("rise to the derived lr, then anneal far below it (OneCycleLR), "
                                              "per optimizer step")]
    pct_start: Annotated[float, Range(gt=0, lt=1), Doc("share of the steps over which the lr rises to its peak")]
    div_factor: Annotated[float, Range(ge=1), Doc("the first lr is the peak lr / div_factor")]
    final_div_factor: Annotated[float, Range(ge=1), Doc("the last lr is the first lr / final_div_factor")]
    anneal_strategy: Annotated[Literal["cos", "linear"], Doc("the shape of each rise and fall")]
    three_phase: Annotated[bool, Doc("false: rise, then anneal to the last lr; true: rise, fall back to the first "
                                     "lr as long, then anneal (fastai's is false)")]
    cycle_momentum: Annotated[bool, Doc("move momentum (beta1 for AdamW and LAMB) inversely to the lr, replacing "
                                        "the optimizer's own")]
    base_momentum: Annotated[UnitInterval, Doc("cycle_momentum: the momentum at the peak lr")]
    max_momentum: Annotated[UnitInterval, Doc("cycle_momentum: the momentum at the first and last lr")]

    def check(self, prefix: str) -> None:
        if self.three_phase and self.pct_start >= 0.5:
            raise UserError(f"{prefix}.pct_start", f"{self.pct_start:g} leaves no steps for the third phase "
                            "(three_phase rises and falls back over 2 x pct_start of the steps)",
                            "a pct_start below 0.5 with three_phase=true")
        if self.cycle_momentum and self.base_momentum > self.max_momentum:
            raise UserError(f"{prefix}.base_momentum", f"{self.base_momentum:g} is above max_momentum "
                            f"{self.max_momentum:g}", "base_momentum <= max_momentum (e.g. 0.85 and 0.95)")


# --- precision, compile, checkpointing ---------------------------------------------------------
PrecisionName = Literal["auto", "fp32", "bf16_mixed", "fp16_mixed"]


@dataclass
class PrecisionConfig:
    """Numeric format and memory layout. GradScaler settings apply to fp16_mixed only."""

    name: Annotated[PrecisionName, Doc("auto, fp32, bf16_mixed or fp16_mixed; auto: bf16-mixed on GPUs with bf16, "
                                       "fp16-mixed + GradScaler on older GPUs, fp32 elsewhere")]
    channels_last: Annotated[AutoBool, Doc("NHWC memory format; auto: on for convolutional models on CUDA")]
    tf32: Annotated[AutoBool, Doc("TF32 matmuls and cuDNN autotuning; auto: on with CUDA unless trainer.deterministic")]
    scaler_init_scale: Annotated[float, POSITIVE, Doc("fp16 GradScaler: the first loss scale")]
    scaler_growth_factor: Annotated[float, Range(gt=1), Doc("fp16 GradScaler: scale x this after growth_interval "
                                                            "clean steps")]
    scaler_backoff_factor: Annotated[float, Range(gt=0, lt=1), Doc("fp16 GradScaler: scale x this after an overflow")]
    scaler_growth_interval: Annotated[int, AT_LEAST_ONE, Doc("fp16 GradScaler: clean steps before the scale grows")]


@dataclass
class CompileConfig:
    """torch.compile of the network. ``mode`` off leaves the model eager; auto compiles on CUDA."""

    mode: Annotated[Literal["off", "auto", "default", "reduce-overhead", "max-autotune"],
                    Doc("torch.compile mode; auto: default on CUDA, eager elsewhere")]
    fullgraph: Annotated[bool, Doc("fail instead of falling back to eager at a graph break")]
    dynamic: Annotated[Optional[bool], Doc("dynamic shapes: true, false, or null to let torch decide")]


# --- regularization ------------------------------------------------------------------------------
@dataclass
class RegularizationConfig:
    """The accuracy practices of the loss and the batch (trainer/groups/regularization.py): label smoothing,
    and mixup/cutmix of whole batches on the device, as torchvision's and timm's ImageNet recipes use them."""

    label_smoothing: Annotated[UnitInterval, Doc("share of the target spread evenly over all classes "
                                                 "(training loss only; 0: off)")]
    mixup_alpha: Annotated[float, NON_NEGATIVE, Doc("mixup: blend each image with another, weight ~ "
                                                    "Beta(alpha, alpha) (0: off)")]
    cutmix_alpha: Annotated[float, NON_NEGATIVE, Doc("cutmix: paste a box of another image, area share ~ "
                                                     "Beta(alpha, alpha) (0: off)")]
    mix_prob: Annotated[float, FRACTION, Doc("probability that a training batch is mixed at all")]
    switch_prob: Annotated[float, FRACTION, Doc("with both on: probability of cutmix rather than mixup")]


MonitoredMetric = Literal["val/acc", "val/loss", "train/loss", "train/acc"]


@dataclass
class CheckpointingConfig:
    """Keep the last checkpoint and the best ones by a validation metric."""

    enabled: Annotated[bool, Doc("write checkpoints at all (false: none, and the test uses the final weights)")]
    monitor: Annotated[MonitoredMetric, Doc("the metric that picks the best checkpoint, which the test uses")]
    mode: Annotated[Literal["max", "min"], Doc("whether a larger or a smaller monitor value is better")]
    save_last: Annotated[bool, Doc("keep checkpoints/last.ckpt, which resume carries on from")]
    save_top_k: Annotated[int, Range(ge=-1), Doc("best checkpoints kept (-1: all, 0: none)")]
    every_n_epochs: Annotated[int, AT_LEAST_ONE, Doc("epochs between checkpoints")]
    every_n_steps: Annotated[Optional[Annotated[int, AT_LEAST_ONE]],
                             Doc("also write last.ckpt every N optimizer steps inside an epoch (null: no)")]
    every_minutes: Annotated[Optional[Annotated[float, POSITIVE]],
                             Doc("also write last.ckpt every N minutes of training (null: only at epoch ends)")]


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
    objective: Annotated[str, Doc("what train.py returns to a sweeper: split/metric, e.g. val/acc")]

    def check(self, group: str = "") -> None:
        if self.diagnose and self.profile:
            raise UserError("profile", "diagnose=true and profile=true both replace training", "one of them")
        split, _, metric = self.objective.partition("/")
        if split not in ("train", "val", "test") or not metric:
            raise UserError("objective", f"'{self.objective}' is not a metric name",
                            "split/metric with split train, val or test: val/acc, val/loss, test/acc, train/loss")


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


OPTIMIZERS = {"sgd": SGDConfig, "adamw": AdamWConfig, "lamb": LambConfig, "lars": LarsConfig}
OptimizerConfig = Union[SGDConfig, AdamWConfig, LambConfig, LarsConfig]
SCHEDULERS = {"warmup_cosine": WarmupCosineConfig, "constant": ConstantConfig, "step": StepConfig,
              "one_cycle": OneCycleConfig}
SchedulerConfig = Union[WarmupCosineConfig, ConstantConfig, StepConfig, OneCycleConfig]

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

#: Tighter bounds than lightning.Trainer's signature, for arguments Lightning accepts when the
#: Trainer is built but fails on once fit starts (0 accumulation, 0 epochs or batches between
#: validations: a ZeroDivisionError mid-run), reads as "always" (negative counts), or that the
#: batch rules multiply before any Trainer exists (num_nodes, accumulate_grad_batches).
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


@dataclass(frozen=True)
class RunSpec:
    """The validated run: plain values with defaults filled, ready for `resolve` and `build`. Frozen:
    a phase that needs other values makes a new spec (`dataclasses.replace`), as the batch finder does."""

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
    callbacks: dict[str, dict[str, Any]] = field(default_factory=dict)
    clipping: dict[str, Any] = field(default_factory=dict)
    nonfinite: dict[str, Any] = field(default_factory=dict)
    activation_checkpointing: list[str] = field(default_factory=list)
    choices: dict[str, str] = field(default_factory=dict)
    #: The whole config as validated: plain containers, interpolations resolved.
    resolved: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


GROUPS = ("data", "model", "optimizer", "scheduler", "precision", "compile", "checkpointing", "clipping", "nonfinite",
          "regularization", "logger", "callbacks", "trainer")

#: Where the code that consumes each config group lives (conf/GROUP/ -> module), and what the group
#: chooses. `--help` prints it; tests/unit/test_compose_all.py checks every group and module exists.
GROUP_MODULES: dict[str, tuple[str, str]] = {
    "data": ("trainer/data/", "the data set and its loader (one module per choice)"),
    "model": ("trainer/models/", "the network; classes, channels and image size come from the data"),
    "optimizer": ("trainer/groups/optimizer.py", "the optimizer, its batch-scaling rules and kernel"),
    "scheduler": ("trainer/groups/scheduler.py", "the learning-rate schedule"),
    "precision": ("trainer/groups/precision.py", "numeric format, TF32, channels_last, the fp16 GradScaler"),
    "compile": ("trainer/groups/compile.py", "torch.compile of the network"),
    "checkpointing": ("trainer/groups/checkpoint.py", "last and best checkpoints, periodic ones inside epochs"),
    "clipping": ("trainer/callbacks/clipping.py", "gradient clipping (95th percentile by default)"),
    "nonfinite": ("trainer/callbacks/nonfinite.py", "the guard that skips NaN/Inf steps"),
    "regularization": ("trainer/groups/regularization.py", "label smoothing, mixup and cutmix (accuracy practices)"),
    "logger": ("trainer/groups/logger.py", "Lightning loggers writing into the run folder"),
    "callbacks": ("trainer/callbacks/configured.py", "callbacks added after the framework's: early stopping, "
                  "EMA, a team's own (+callbacks.NAME._target_=...)"),
    "trainer": ("trainer/groups/lightning_trainer.py", "the lightning.Trainer's own arguments"),
    "hparams_search": ("trainer/groups/sweeps.py", "an Optuna study (Hydra's Optuna sweeper, its SQLite storage)"),
    "ladder": ("trainer/measure/comparison.py", "an optimization ladder: stages of one multirun, compared"),
    "recipe": ("trainer/configuration/recipes.py", "a team-shared recipe from recipes/ (+recipe=NAME)"),
}

#: The framework's own groups, checked by a dataclass (the others by their `_target_`'s signature).
DATACLASS_GROUPS: dict[str, Mapping[str, type]] = {
    "optimizer": OPTIMIZERS, "scheduler": SCHEDULERS, "precision": {"": PrecisionConfig},
    "compile": {"": CompileConfig}, "checkpointing": {"": CheckpointingConfig},
    "regularization": {"": RegularizationConfig}}


def choice_config(group: str, choice: str, **overrides: Any) -> Any:
    """The checked config of ``conf/GROUP/CHOICE.yaml`` with `overrides` applied: the values a run of
    that choice gets, for use from Python (tests, benchmarks), from the same file a run composes."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose(config_name=f"{group}/{choice}")
    group_values = cast(dict[str, Any], OmegaConf.to_container(composed[group], resolve=True))  # a DictConfig's
    values = {**group_values, **overrides}
    schemas = DATACLASS_GROUPS[group]
    if "" in schemas:
        return _dataclass(group, values, schemas[""])
    return _choice(group, values, schemas)


def validate(cfg: DictConfig | Mapping[str, Any], group_choices: Mapping[str, str] | None = None) -> RunSpec:
    """Check the composed config against every group's schema; raise `UserError` on the first fault."""
    plain = to_plain(cfg)
    plain.pop("hydra", None)
    _check_layout(plain)
    _require_extras(plain)
    stages, model = _model(plain["model"])
    return RunSpec(
        top=_top_level_keys(plain),
        identity=_identity(plain.get("run", {})),
        data=_data(plain["data"]),
        model=model,
        optimizer=_choice("optimizer", plain["optimizer"], OPTIMIZERS),
        scheduler=_choice("scheduler", plain["scheduler"], SCHEDULERS),
        precision=_dataclass("precision", plain["precision"], PrecisionConfig),
        compile=_dataclass("compile", plain["compile"], CompileConfig),
        checkpointing=_dataclass("checkpointing", plain["checkpointing"], CheckpointingConfig),
        regularization=_dataclass("regularization", plain["regularization"], RegularizationConfig),
        loggers=_loggers(plain["logger"]),
        trainer=_trainer(plain["trainer"]),
        callbacks=_callbacks(plain.get("callbacks") or {}),
        clipping=_target("clipping", plain["clipping"], skip=()),
        nonfinite=_target("nonfinite", plain["nonfinite"], skip=()),
        activation_checkpointing=stages,
        choices=dict(group_choices or {}),
        target=_target_config(plain.get("target") or {}),
        resolved=plain,
    )


def _require_extras(plain: Mapping[str, Any]) -> None:
    """The optional parts the composed run uses are installed (trainer/infra/extras.py), else one line
    with the pip command, before anything is built."""
    optimizer = plain.get("optimizer") or {}
    if optimizer.get("name") in ("lamb", "lars"):
        require("timm", f"optimizer={optimizer['name']}")  # timm's LAMB and LARS
    if optimizer.get("layer_decay") is not None:
        require("timm", "optimizer.layer_decay")
    if str((plain.get("model") or {}).get("_target_", "")).startswith("trainer.models.timm."):
        require("timm", "model=timm")
    if str((plain.get("data") or {}).get("_target_", "")) == "trainer.data.shards.ShardsDataModule":
        require("shards", "data=shards")  # LitData and boto3
    for name, logger in (plain.get("logger") or {}).items():
        target = str((logger or {}).get("_target_", "")) if isinstance(logger, Mapping) else ""
        for suffix, extra in (("WandbLogger", "wandb"), ("TensorBoardLogger", "tensorboard")):
            if target.endswith(suffix):
                require(extra, f"logger.{name}")


def _check_layout(plain: Mapping[str, Any]) -> None:
    """Only known top-level keys, and every group present as a mapping."""
    allowed = sorted(set(GROUPS) | set(schema_of_dataclass(TopLevelKeys).fields) | {"run", "target"})
    for key in plain:
        if key not in allowed:
            raise UserError(str(key), "unknown top-level key", choices(allowed))
    for group in GROUPS:
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
    return _dataclass("target", dict(values), TargetConfig)


def _identity(values: Mapping[str, Any]) -> RunIdentity:
    values = dict(values)
    if isinstance(values.get("name"), (int, float)) and not isinstance(values["name"], bool):
        values["name"] = str(values["name"])  # run.name=2024 is a name, not a number
    identity = _dataclass("run", values, RunIdentity)
    if identity.name is not None and not identity.name.strip():
        raise UserError("run.name", "is empty", "a name for the run (or leave it unset for the default)")
    return identity


def _data(values: dict[str, Any]) -> dict[str, Any]:
    data = _target("data", values, skip=())
    data_cls = locate_target("data", data["_target_"])
    if not (inspect.isclass(data_cls) and issubclass(data_cls, ImageClassificationData)):
        raise UserError("data._target_", f"'{data['_target_']}' is not a data module of this framework",
                        "a subclass of trainer.data.base.ImageClassificationData")
    if "batch_size" not in data:
        raise UserError("data.batch_size", "missing", "a positive integer (per-device batch size)")
    return data


def _model(values: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """The stages to checkpoint (a framework key inside the group) and the constructor's keys."""
    values = dict(values)
    stages = values.pop("activation_checkpointing", [])
    check_value("model.activation_checkpointing", stages, list[str])
    return list(stages), _target("model", values, skip=INJECTED_MODEL_ARGS)


def _loggers(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    loggers = {}
    for name, spec in values.items():
        if spec is None:
            continue  # a logger switched off with logger.NAME=null
        if not isinstance(spec, dict):
            raise UserError(f"logger.{name}", "not a mapping", "a logger config with _target_")
        loggers[name] = _target(f"logger.{name}", spec, skip=INJECTED_LOGGER_ARGS)
    return loggers


def _trainer(values: dict[str, Any]) -> dict[str, Any]:
    """Checked against `lightning.Trainer`'s own signature; only the keys given are kept."""
    for key in values:
        if key in TRAINER_KEYS_OWNED_ELSEWHERE:
            raise UserError(f"trainer.{key}", "is set by the framework", f"use {TRAINER_KEYS_OWNED_ELSEWHERE[key]}")
    checked = check_mapping("trainer", values, _trainer_schema(lightning.Trainer), "lightning.Trainer")
    given = {k: v for k, v in checked.items() if k in values}
    for key, value in given.items():
        # An object argument given as {_target_: ...}: made by trainer/groups/lightning_trainer.py.
        if key == "plugins":
            given[key] = _plugins(value)
        elif isinstance(value, dict) and "_target_" in value:
            given[key] = _target(f"trainer.{key}", value, skip=())
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
        plugins.append(_target(key, entry, skip=()))
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


def _callbacks(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The callbacks group's entries (name -> `_target_` mapping), each checked against its
    constructor; see trainer/callbacks/configured.py for what is refused."""
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
        checked = _target(key, spec, skip=())
        if inspect.isclass(target) and issubclass(target, EarlyStopping) and "monitor" in checked:
            # Lightning looks the metric up only after the first validation, and stops the run there.
            check_value(f"{key}.monitor", checked["monitor"], MonitoredMetric)
        callbacks[name] = checked
    return callbacks


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
    return _dataclass(group, values, schemas[cast(str, name)])  # one of its keys, as checked above


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
    fields = {k: dataclasses.replace(v, annotation=TRAINER_BOUNDS.get(k, v.annotation))
              for k, v in schema.fields.items() if k not in TRAINER_KEYS_OWNED_ELSEWHERE}
    return Schema(fields, open=False)
