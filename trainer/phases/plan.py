"""The resolve phase: every concrete setting a run will use, with how it was derived (the `Plan`).

Printed at start and stored in summary.json, so "why did it pick 0 workers?" is never a mystery.
Everything is decided here and nothing is changed: `resolve` reads the validated spec and what was
built from it and returns a frozen plan (called twice on the same inputs, it returns equal plans
and leaves its inputs as they were). The build phase applies it.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch
from hydra.utils import get_class
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from torch import nn

from trainer.callbacks.clipping import GradientClipping
from trainer.groups.compile import recompile_note, resolve_compile_mode
from trainer.configuration.spec import LR_FIND, OneCycleConfig, RunSpec
from trainer.data.base import DataInfo, ImageClassificationData
from trainer.data.loader import LoaderSettings
from trainer.data.progressive_resize import ResizeSchedule, epochs_of_run
from trainer.infra.devices import count_devices, resolve_accelerator
from trainer.infra.errors import UserError
from trainer.measure.mfu import peak_flops, training_flops_per_sample
from trainer.models.activation_checkpointing import select_stages
from trainer.groups.optimizer import OptimizerRecipe, choose_implementation, named_by_model
from trainer.groups.precision import resolve_channels_last, resolve_precision, resolve_tf32
from trainer.groups.regularization import describe
from trainer.groups.scaling import FoundLr, Scaled, measured_warnings, scale, scale_found
from trainer.groups.scheduler import describe_one_cycle, planned_optimizer_steps


@dataclass(frozen=True)
class Derived:
    value: Any
    how: str


@dataclass(frozen=True)
class Plan:
    """The settings the run applies, each also under `derived` with its derivation."""

    accelerator: str
    devices: int
    #: Lightning's precision string ("32-true", "bf16-mixed", "16-mixed").
    precision: str
    loader: LoaderSettings
    #: The image decode mode (data sets held decoded: "none").
    decode: str
    global_batch_size: int
    #: What builds the optimizer, for training and for every measurement alike.
    optimizer: OptimizerRecipe
    tf32: bool
    channels_last: bool
    compile_mode: str
    checkpointed_stages: tuple[str, ...]
    #: rich, plain or off.
    progress: str
    #: cuDNN autotuning (the Trainer's `benchmark`).
    cudnn_benchmark: bool
    #: Whether the Trainer gets Lightning's SLURM environment (inside a SLURM job, none configured).
    slurm_environment: bool
    #: Training FLOPs per sample and the device's peak FLOP/s, where known (for MFU).
    flops_per_sample: int | None
    peak_flops: float | None
    peak_flops_note: str
    derived: Mapping[str, Derived]
    #: What the studies say about this setting, to print at start (trainer/groups/scaling.py).
    warnings: tuple[str, ...] = ()
    #: Progressive resizing: the training crop's side per epoch (None: every epoch at data.image_size).
    resize: Optional[ResizeSchedule] = None

    @property
    def lr(self) -> float:
        return self.optimizer.lr

    @property
    def weight_decay(self) -> float:
        return self.optimizer.weight_decay

    @property
    def optimizer_implementation(self) -> str:
        return self.optimizer.implementation

    def lines(self) -> list[str]:
        width = max(len(k) for k in self.derived)
        return [f"{key:<{width}}  {d.value!s:<12} {d.how}" for key, d in self.derived.items()]

    def to_dict(self) -> dict[str, Any]:
        return {key: {"value": d.value, "how": d.how} for key, d in self.derived.items()}


def resolve(spec: RunSpec, datamodule: ImageClassificationData, info: DataInfo, net: nn.Module,
            clipping: GradientClipping, batch_size: Derived | None = None, lr: FoundLr | None = None) -> Plan:
    """Derive every setting from the validated config and what was built from it: the data module
    resolves its own loader settings for the device; the network decides what channels_last,
    activation checkpointing and MFU can do; nothing is changed yet. `batch_size`: the batch
    data.batch_size=auto found, with its derivation; `lr`: the lr optimizer.lr=find found (without it, a plan
    of such a run is provisional: its lr is a placeholder for the measurements made before the test)."""
    derived: dict[str, Derived] = {}
    if batch_size is not None:
        derived["data.batch_size"] = batch_size
    accelerator, devices, global_batch = _devices_and_batch(spec, derived)
    precision, how = resolve_precision(spec.precision.name, accelerator)
    derived["precision"] = Derived(precision, how)
    loader = datamodule.loader_settings(cuda=accelerator == "cuda",
                                        batch_bytes=info.sample_bytes * int(spec.data["batch_size"]) or None)
    for key, reason in loader.reasons.items():
        derived[f"data.{key}"] = Derived(getattr(loader, key), reason)
    decode, how = datamodule.resolve_decode(cuda=accelerator == "cuda")
    derived["data.decode"] = Derived(decode, how)
    resize = _progressive_resize(spec, datamodule, info, global_batch, derived)
    lr_value, weight_decay, implementation = _optimizer(spec, accelerator, precision, global_batch, derived, lr)
    recipe = OptimizerRecipe.for_network(net, spec.optimizer, lr_value, weight_decay, implementation)
    _parameter_groups(spec, net, recipe, derived)
    _schedule(spec, info, devices, lr_value, derived)
    tf32, how = resolve_tf32(spec.precision.tf32, accelerator, bool(spec.trainer.get("deterministic", False)))
    derived["precision.tf32"] = Derived(tf32, how)
    flops, peak, peak_note = _flops(net, info, accelerator, precision, tf32, derived)
    stages, channels_last, compile_mode = _model_changes(spec, net, accelerator, derived, resize)
    derived["clipping"] = Derived(clipping.mode, clipping.describe())
    derived["regularization"] = Derived(spec.choices.get("regularization", "custom"), describe(spec.regularization))
    progress, cudnn_benchmark, slurm_environment = _trainer_settings(spec, accelerator, tf32, derived)
    return Plan(accelerator, devices, precision, loader, decode, global_batch, recipe, tf32, channels_last,
                compile_mode, stages, progress, cudnn_benchmark, slurm_environment, flops, peak, peak_note,
                MappingProxyType(derived),
                tuple(measured_warnings(spec.optimizer.name, spec.optimizer.lr_scaling, global_batch)), resize)


def _progressive_resize(spec: RunSpec, datamodule: ImageClassificationData, info: DataInfo, global_batch: int,
                        derived: dict[str, Derived]) -> Optional[ResizeSchedule]:
    """data.progressive_resize: the sizes of each epoch of this run's length."""
    if not spec.data.get("progressive_resize", False):
        return None
    steps = max(1, int(info.sizes.get("train", 0)) // max(1, global_batch))
    epochs = epochs_of_run(spec.trainer.get("max_epochs"), spec.trainer.get("max_steps"), steps)
    schedule = datamodule.resize_schedule(epochs)
    if schedule is not None:
        derived["data.progressive_resize"] = Derived(schedule.sizes(), schedule.describe())
    return schedule


def _devices_and_batch(spec: RunSpec, derived: dict[str, Derived]) -> tuple[str, int, int]:
    accelerator, how = resolve_accelerator(str(spec.trainer.get("accelerator", "auto")))
    derived["trainer.accelerator"] = Derived(accelerator, how)
    devices = count_devices(spec.trainer.get("devices", 1), accelerator)
    if devices < 1:
        raise UserError("trainer.devices", f"resolves to {devices} devices", "a positive count, a list of ids, or auto")
    nodes = int(spec.trainer.get("num_nodes", 1))
    accumulation = int(spec.trainer.get("accumulate_grad_batches", 1))
    batch = int(spec.data["batch_size"])
    global_batch = batch * devices * nodes * accumulation
    derived["global_batch_size"] = Derived(
        global_batch, f"{batch} per device x {devices} devices x {nodes} nodes x {accumulation} accumulation")
    return accelerator, devices, global_batch


def _optimizer(spec: RunSpec, accelerator: str, precision: str, global_batch: int,
               derived: dict[str, Derived], found: FoundLr | None = None) -> tuple[float, float, str]:
    """lr and weight decay moved to the global batch by their rules, and the optimizer kernel."""
    opt = spec.optimizer
    lr = _lr(spec, global_batch, found)
    wd = scale("weight_decay", opt.weight_decay, opt.wd_scaling, global_batch, opt.ref_batch_size)
    derived["optimizer.lr"] = Derived(round(lr.value, 10) if found is not None or opt.lr != LR_FIND else LR_FIND,
                                      lr.how)
    derived["optimizer.weight_decay"] = Derived(round(wd.value, 10), wd.how)
    derived["optimizer.decay_norm_and_bias"] = Derived(
        opt.decay_norm_and_bias, "weight decay on every parameter" if opt.decay_norm_and_bias
        else "no weight decay on 1-D parameters (norm weights, biases)")
    implementation, how = choose_implementation(opt.implementation, accelerator, grad_scaler=precision == "16-mixed",
                                                optimizer=opt.name)
    derived["optimizer.implementation"] = Derived(implementation, how)
    return lr.value, wd.value, implementation


def _lr(spec: RunSpec, global_batch: int, found: FoundLr | None) -> Scaled:
    """The configured lr, or the one the range test found, moved to the global batch by the lr rule."""
    opt = spec.optimizer
    if found is not None:
        return scale_found(found, opt.lr_scaling, global_batch, opt.ref_batch_size)
    if isinstance(opt.lr, str):  # LR_FIND
        # A provisional plan (the batch finder's, the range test's own): the test replaces every
        # group's lr, and nothing trains with this one.
        return Scaled(opt.find_min_lr, "find: Lightning's lr range test, before training (not run yet)")
    return scale("lr", opt.lr, opt.lr_scaling, global_batch, opt.ref_batch_size)


def _schedule(spec: RunSpec, info: DataInfo, devices: int, lr: float, derived: dict[str, Derived]) -> None:
    """The one-cycle schedule's shape in numbers (the other schedules are their config)."""
    cfg = spec.scheduler
    if not isinstance(cfg, OneCycleConfig):
        return
    processes = devices * int(spec.trainer.get("num_nodes", 1))
    steps = planned_optimizer_steps(spec.trainer, int(info.sizes.get("train", 0)), processes,
                                    int(spec.data["batch_size"]))
    derived["scheduler"] = Derived("one_cycle", describe_one_cycle(cfg, lr, steps, spec.optimizer))


def _parameter_groups(spec: RunSpec, net: nn.Module, recipe: OptimizerRecipe, derived: dict[str, Derived]) -> None:
    """What the model adds to the optimizer's groups: parameters it exempts from decay by name, and
    the layer-wise lr decay."""
    named = sorted(named_by_model(net))
    if named and not spec.optimizer.decay_norm_and_bias:
        derived["optimizer.decay_norm_and_bias"] = Derived(
            False, f"no weight decay on 1-D parameters (norm weights, biases) nor on {', '.join(named)} (the model's "
            "no_weight_decay())")
    decay, scales, lr = spec.optimizer.layer_decay, recipe.lr_scales, recipe.lr
    if decay and scales:
        layers = len(set(scales.values()))
        derived["optimizer.layer_decay"] = Derived(
            decay, f"{layers} layers (the model's group_matcher): lr {lr:.3g} at the head down to "
            f"{lr * min(scales.values()):.3g} at the stem ({decay:g}^{layers - 1})")


def _flops(net: nn.Module, info: DataInfo, accelerator: str, precision: str, tf32: bool,
           derived: dict[str, Derived]) -> tuple[int | None, float | None, str]:
    """The model's training FLOPs per sample, counted on the plain network (before activation
    checkpointing and compile change it), and the device's peak for the math it will run."""
    flops, how = training_flops_per_sample(net, (info.in_channels, *info.image_size))
    derived["model.flops_per_sample"] = Derived(f"{flops / 1e9:.4g} GFLOP" if flops else None, how)
    if accelerator == "cuda":
        peak, peak_how = peak_flops(torch.cuda.get_device_name(), precision, tf32)
    else:
        peak, peak_how = None, f"no known peak for the {accelerator.upper()}: MFU left out"
    derived["device.peak_flops"] = Derived(f"{peak / 1e12:.1f} TFLOP/s" if peak else None, peak_how)
    return flops, peak, peak_how


def _model_changes(spec: RunSpec, net: nn.Module, accelerator: str, derived: dict[str, Derived],
                   resize: Optional[ResizeSchedule] = None) -> tuple[tuple[str, ...], bool, str]:
    """What the build phase will do to the network: checkpointed stages, memory format, compile."""
    stages = tuple(select_stages(net, spec.activation_checkpointing))
    if stages:
        derived["model.activation_checkpointing"] = Derived(
            ",".join(stages), "recomputed in backward (non-reentrant), BatchNorm statistics counted once")
    channels_last, how = resolve_channels_last(spec.precision.channels_last, accelerator, net)
    derived["precision.channels_last"] = Derived(channels_last, how)
    compile_mode, how = resolve_compile_mode(spec.compile.mode, accelerator)
    if compile_mode == "off":
        how += "; eager"
    else:
        how += f"; torch.compile fullgraph={spec.compile.fullgraph} dynamic={spec.compile.dynamic}"
        if resize is not None:
            how += f"; {recompile_note(len(set(resize.sizes())))}"
    derived["compile"] = Derived(compile_mode, how)
    return stages, channels_last, compile_mode


def _trainer_settings(spec: RunSpec, accelerator: str, tf32: bool,
                      derived: dict[str, Derived]) -> tuple[str, bool, bool]:
    """The progress output, cuDNN autotuning and the SLURM environment plugin."""
    progress = spec.top.progress
    if progress == "auto":
        progress, how = ("rich", "auto -> rich (output is a terminal)") if sys.stdout.isatty() else (
            "plain", "auto -> plain (output is not a terminal: a line every progress_every_s)")
    else:
        how = f"{progress} (as configured)"
    derived["progress"] = Derived(progress, how)
    configured = spec.trainer.get("benchmark")
    if configured is None:
        # Said explicitly either way: Lightning's None keeps the process's setting, which a previous
        # job of a sweep may have set.
        benchmark = tf32 and accelerator == "cuda"
        how = f"follows TF32 on CUDA -> {str(benchmark).lower()}"
    else:
        benchmark, how = bool(configured), f"{str(bool(configured)).lower()} (trainer.benchmark, as configured)"
    derived["trainer.benchmark"] = Derived(benchmark, how)
    # Deliberately without Lightning's SLURM auto-requeue: its SIGUSR1 handler writes an hpc_ckpt and
    # requeues on its own, and a requeued run then restores that file whatever `resume` says.
    # Preemption is submitit's signal and GracefulStop's checkpoint here.
    slurm = _inside_slurm_job() and not _names_cluster_environment(spec.trainer.get("plugins"))
    if slurm:
        derived["trainer.plugins"] = Derived("SLURMEnvironment", "inside a SLURM job: Lightning's SLURM environment, "
                                             "without its auto-requeue (preemption is submitit's signal here)")
    return progress, benchmark, slurm


def _inside_slurm_job() -> bool:
    """Lightning's own test, without the srun hint it prints on any machine that has srun
    (trainer/groups/lightning_trainer.py drops that hint)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SLURMEnvironment.detect()


def _names_cluster_environment(plugins: Any) -> bool:
    """Whether the person's plugins (objects, or `_target_` mappings still to be built) include a
    cluster environment of their own."""
    if plugins is None:
        return False
    for plugin in plugins if isinstance(plugins, (list, tuple)) else [plugins]:
        target = plugin.get("_target_") if isinstance(plugin, Mapping) else type(plugin)
        try:
            cls = get_class(target) if isinstance(target, str) else target
        except Exception:  # noqa: BLE001 - an unknown target is reported where it is built
            continue
        if isinstance(cls, type) and issubclass(cls, ClusterEnvironment):
            return True
    return False
