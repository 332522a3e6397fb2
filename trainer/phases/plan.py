"""The resolve phase: every concrete setting a run will use, with how it was derived (the `Plan`),
printed at start and stored in summary.json, so "why did it pick 0 workers?" is never a mystery.
`decide_probe` settles where and how a step runs (all the batch and lr finders need); `resolve` takes
the probe, the finders' answers and what the build made, and returns the frozen plan; nothing is
changed here (docs/architecture.md, "A run")."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch
from torch import nn

from trainer.configuration.spec import RunSpec
from trainer.data.loader import LoaderSettings, available_memory
from trainer.data.progressive_resize import ResizeSchedule, epochs_of_run
from trainer.groups.communication import UNCOMPRESSED, Communication
from trainer.groups.communication import decide as decide_communication
from trainer.groups.compile import recompile_note, resolve_compile_mode, resolve_dynamic
from trainer.groups.optimizer.build import OptimizerRecipe, choose_implementation
from trainer.groups.optimizer.parameters import describe_groups
from trainer.groups.optimizer.scaling import FoundLr, at_batch, measured_warnings
from trainer.groups.optimizer.schema import LR_FIND
from trainer.groups.precision import resolve_channels_last, resolve_precision, resolve_tf32
from trainer.groups.regularization import describe
from trainer.groups.scheduler import describe as describe_schedule
from trainer.groups.trainer import slurm_environment
from trainer.infra.devices import Devices
from trainer.measure.mfu import bf16_peak_flops, peak_flops, training_flops_per_sample
from trainer.models.activation_checkpointing import select_stages
from trainer.phases.products import Parts


def device_of(accelerator: str) -> torch.device:
    """The torch device a step runs on (the current CUDA device under several processes)."""
    return torch.device("cuda", torch.cuda.current_device()) if accelerator == "cuda" else torch.device(accelerator)


@dataclass(frozen=True)
class Derived:
    value: Any
    how: str


@dataclass(frozen=True)
class Probe:
    """Where and how a training step runs: what a measurement made before the plan needs (the
    batch finder, the lr range test), decided once; `resolve` takes these values as they are."""

    devices: Devices
    #: Lightning's precision string ("32-true", "bf16-mixed", "16-mixed").
    precision: str
    tf32: bool
    channels_last: bool
    #: The optimizer kernel: fused, foreach or for_loop.
    implementation: str
    #: cuDNN autotuning (the Trainer's `benchmark`).
    cudnn_benchmark: bool
    #: rich, plain or off.
    progress: str
    derived: Mapping[str, Derived]
    #: The task's units in one sample (tokens of a packed sequence; 1 when batches count samples):
    #: the batch rules scale lr and weight decay by the global batch in the task's unit.
    units_per_sample: int = 1
    #: Bytes of memory available when probed (None: unknown): what bounds the loader's prefetch
    #: depth, read once here so that `resolve` stays a function of the probe. A reading of a
    #: moving figure, so two probes of one machine are equal whatever it said.
    available_memory: Optional[int] = field(default=None, compare=False)

    @property
    def accelerator(self) -> str:
        return self.devices.accelerator

    @property
    def device(self) -> torch.device:
        return device_of(self.accelerator)

    def optimizer(self, spec: RunSpec, net: nn.Module, batch: int, found: FoundLr | None = None) -> OptimizerRecipe:
        """The run's optimizer recipe at a per-device `batch` (lr and weight decay by the batch rules)."""
        lr, weight_decay = at_batch(spec.optimizer, self.global_batch(spec, batch) * self.units_per_sample, found)
        return OptimizerRecipe.for_network(net, spec.optimizer, lr.value, weight_decay.value, self.implementation)

    def global_batch(self, spec: RunSpec, batch: int) -> int:
        """The global batch in samples."""
        return self.devices.global_batch(batch, int(spec.trainer.get("accumulate_grad_batches", 1)))


def decide_probe(spec: RunSpec, devices: Devices, parts: Parts) -> Probe:
    """Where and how a step of the built network runs; the task says how many of its units a
    sample holds (the batch rules scale by the global batch in that unit)."""
    derived: dict[str, Derived] = {"trainer.accelerator": Derived(devices.accelerator, devices.how)}
    precision, how = resolve_precision(spec.precision.name, devices.accelerator)
    derived["precision"] = Derived(precision, how)
    implementation, how = choose_implementation(spec.optimizer.implementation, devices.accelerator,
                                                grad_scaler=precision == "16-mixed", cfg=spec.optimizer)
    derived["optimizer.implementation"] = Derived(implementation, how)
    tf32, how = resolve_tf32(spec.precision.tf32, devices.accelerator, bool(spec.trainer.get("deterministic", False)))
    derived["precision.tf32"] = Derived(tf32, how)
    channels_last, how = resolve_channels_last(spec.precision.channels_last, devices.accelerator, parts.net)
    derived["precision.channels_last"] = Derived(channels_last, how)
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
        benchmark = tf32 and devices.accelerator == "cuda"
        how = f"follows TF32 on CUDA -> {str(benchmark).lower()}"
    else:
        benchmark, how = bool(configured), f"{str(bool(configured)).lower()} (trainer.benchmark, as configured)"
    derived["trainer.benchmark"] = Derived(benchmark, how)
    return Probe(devices, precision, tf32, channels_last, implementation, benchmark, progress,
                 MappingProxyType(derived), parts.definition.units_per_sample(), available_memory())


def per_device_batch(spec: RunSpec, found: Derived | None) -> int:
    """The per-device batch a run trains (and a range test measures) with: what data.batch_size=auto
    found, else data.batch_size. The one place that rule is written."""
    return int(found.value) if found is not None else int(spec.data["batch_size"])


@dataclass(frozen=True)
class Plan:
    """The settings the run applies, each also under `derived` with its derivation. Where and how a
    step runs is the probe's, held as it was decided (`accelerator`, `precision` and the others
    below read it), not copied."""

    probe: Probe
    loader: LoaderSettings
    #: The image decode mode (data sets held decoded: "none").
    decode: str
    #: The per-device batch: data.batch_size, or what data.batch_size=auto found.
    batch_size: int
    global_batch_size: int
    #: What builds the optimizer, for training and for every measurement alike.
    optimizer: OptimizerRecipe
    compile_mode: str
    checkpointed_stages: tuple[str, ...]
    #: Whether the Trainer gets Lightning's SLURM environment (inside a SLURM job, none configured).
    slurm_environment: bool
    #: Training FLOPs per unit of the task (a sample, a token) and the device's peak FLOP/s, where
    #: known (for MFU).
    flops_per_sample: int | None
    peak_flops: float | None
    peak_flops_note: str
    #: The device's dense bf16 tensor-core peak FLOP/s, where known, whatever the precision: the one
    #: peak every run's MFU is also taken against, so that runs of different precisions compare.
    bf16_peak_flops: float | None
    bf16_peak_note: str
    derived: Mapping[str, Derived]
    #: What the studies say about this setting, to print at start (trainer/groups/optimizer/scaling.py).
    warnings: tuple[str, ...] = ()
    #: Progressive resizing: the training crop's side per epoch (None: every epoch at data.image_size).
    resize: Optional[ResizeSchedule] = None
    #: What the task counts a batch in ("samples", "tokens") and how many one sample holds.
    unit: str = "samples"
    units_per_sample: int = 1
    #: torch.compile's dynamic shapes (None: torch decides; true for batches of varying length).
    compile_dynamic: Optional[bool] = None
    #: The DDP gradient compression the Trainer's strategy registers (gradient_compression none: none).
    communication: Communication = UNCOMPRESSED

    @property
    def accelerator(self) -> str:
        return self.probe.accelerator

    @property
    def devices(self) -> int:
        """Devices per node."""
        return self.probe.devices.per_node

    @property
    def precision(self) -> str:
        return self.probe.precision

    @property
    def tf32(self) -> bool:
        return self.probe.tf32

    @property
    def channels_last(self) -> bool:
        return self.probe.channels_last

    @property
    def progress(self) -> str:
        return self.probe.progress

    @property
    def cudnn_benchmark(self) -> bool:
        return self.probe.cudnn_benchmark

    @property
    def global_batch_units(self) -> int:
        """The global batch in the task's unit (what the batch rules scaled by)."""
        return self.global_batch_size * self.units_per_sample

    @property
    def lr(self) -> float:
        return self.optimizer.lr

    @property
    def weight_decay(self) -> float:
        return self.optimizer.weight_decay

    @property
    def optimizer_implementation(self) -> str:
        return self.optimizer.implementation

    @property
    def device(self) -> torch.device:
        return self.probe.device

    def lines(self) -> list[str]:
        width = max(len(k) for k in self.derived)
        return [f"{key:<{width}}  {d.value!s:<12} {d.how}" for key, d in self.derived.items()]

    def to_dict(self) -> dict[str, Any]:
        return {key: {"value": d.value, "how": d.how} for key, d in self.derived.items()}


def resolve(spec: RunSpec, probe: Probe, parts: Parts, batch_size: Derived | None = None,
            lr: FoundLr | None = None) -> Plan:
    """Derive every setting from the validated config, the probe and what was built from it: the
    data module resolves its own loader settings for the device; the network decides what
    activation checkpointing and MFU can do; nothing is changed. `batch_size`: what
    data.batch_size=auto found, with its derivation; `lr`: what optimizer.lr=find found."""
    datamodule, info, net = parts.datamodule, parts.info, parts.net
    accelerator, early = probe.accelerator, probe.derived
    derived: dict[str, Derived] = {}
    if batch_size is not None:
        derived["data.batch_size"] = batch_size
    batch = per_device_batch(spec, batch_size)
    derived["trainer.accelerator"] = early["trainer.accelerator"]
    global_batch = probe.global_batch(spec, batch)
    derived["global_batch_size"] = Derived(global_batch, f"{batch} per device x {probe.devices.per_node} devices x "
                                           f"{probe.devices.nodes} nodes x "
                                           f"{spec.trainer.get('accumulate_grad_batches', 1)} accumulation")
    definition = parts.definition
    derived["task"] = Derived(spec.choices.get("task", type(definition).__name__), definition.describe())
    units = probe.units_per_sample
    if definition.unit != "samples":
        derived[f"global_batch_{definition.unit}"] = Derived(
            global_batch * units, f"{global_batch} samples x {units} {definition.unit} a sample: what the lr and "
            "weight-decay rules scale by")
    derived["precision"] = early["precision"]
    loader = datamodule.loader_settings(cuda=accelerator == "cuda", batch_bytes=info.sample_bytes * batch or None,
                                        available_bytes=probe.available_memory)
    for key, reason in loader.reasons.items():
        derived[f"data.{key}"] = Derived(getattr(loader, key), reason)
    decode, how = datamodule.resolve_decode(cuda=accelerator == "cuda")
    derived["data.decode"] = Derived(decode, how)
    resize = _progressive_resize(spec, parts, global_batch, derived)
    # The rules scale by the batch in the task's unit (tokens for a language model); the range test's
    # batch is in samples: counted in the same unit first, or the found lr moves by units-per-sample too.
    found = lr.in_units(definition.unit, units) if lr is not None else None
    recipe = _optimizer(spec, probe, net, global_batch * units, found, derived)
    derived["precision.tf32"] = early["precision.tf32"]
    flops, (peak, peak_note), (bf16_peak, bf16_note) = _flops(net, parts, accelerator, probe.precision, probe.tf32,
                                                              derived)
    stages, compile_mode, dynamic = _model_changes(spec, parts, probe, derived, resize)
    derived["clipping"] = Derived(parts.clipping.mode, parts.clipping.describe())
    derived["regularization"] = Derived(spec.choices.get("regularization", "custom"), describe(spec.regularization))
    derived["progress"], derived["trainer.benchmark"] = early["progress"], early["trainer.benchmark"]
    communication = decide_communication(spec.communication, spec.trainer.get("strategy", "auto"),
                                         probe.devices.processes, accelerator)
    derived["trainer.gradient_compression"] = Derived(communication.compression, communication.how)
    slurm = slurm_environment(spec.trainer.get("plugins"))
    if slurm:
        derived["trainer.plugins"] = Derived("SLURMEnvironment", "inside a SLURM job: Lightning's SLURM environment, "
                                             "without its auto-requeue (preemption is submitit's signal here)")
    return Plan(probe, loader, decode, batch, global_batch, recipe, compile_mode, stages, slurm, flops, peak,
                peak_note, bf16_peak, bf16_note, MappingProxyType(derived),
                _warnings(spec, definition.unit, global_batch, units), resize, definition.unit, units, dynamic,
                spec.communication)


def _warnings(spec: RunSpec, unit: str, global_batch: int, units_per_sample: int) -> tuple[str, ...]:
    """What the batch-scaling studies say of this setting. They measured batches of images: a batch
    counted in another unit has its own study (docs/tasks.md), and gets a warning when the optimizer's
    reference batch cannot be one in that unit (an image recipe's 256 is not 256 tokens' lr)."""
    opt = spec.optimizer
    if unit == "samples":
        return tuple(measured_warnings(opt.name, opt.lr_scaling, global_batch))
    if opt.ref_batch_size < units_per_sample and opt.lr_scaling != "none":
        return (f"optimizer.ref_batch_size={opt.ref_batch_size} counts {unit} for this task, less than one sample "
                f"({units_per_sample} {unit}): lr and weight decay given for {opt.ref_batch_size} {unit} are moved to "
                f"{global_batch * units_per_sample} by the {opt.lr_scaling} rule. Give ref_batch_size as the batch in "
                f"{unit} your lr was tuned at (+recipe=gpt_tiny_text: 4096)",)
    return ()


def _progressive_resize(spec: RunSpec, parts: Parts, global_batch: int,
                        derived: dict[str, Derived]) -> Optional[ResizeSchedule]:
    """data.progressive_resize: the sizes of each epoch of this run's length."""
    if not spec.data.get("progressive_resize", False):
        return None
    steps = max(1, int(parts.info.sizes.get("train", 0)) // max(1, global_batch))
    epochs = epochs_of_run(spec.trainer.get("max_epochs"), spec.trainer.get("max_steps"), steps)
    schedule = parts.datamodule.resize_schedule(epochs)
    if schedule is not None:
        derived["data.progressive_resize"] = Derived(schedule.sizes(), schedule.describe())
    return schedule


def _optimizer(spec: RunSpec, probe: Probe, net: nn.Module, global_batch: int, found: FoundLr | None,
               derived: dict[str, Derived]) -> OptimizerRecipe:
    """lr and weight decay moved to the global batch by their rules, the parameter groups, the kernel
    and the schedule's shape at that lr."""
    opt = spec.optimizer
    lr, weight_decay = at_batch(opt, global_batch, found)
    derived["optimizer.lr"] = Derived(round(lr.value, 10) if found is not None or opt.lr != LR_FIND else LR_FIND,
                                      lr.how)
    derived["optimizer.weight_decay"] = Derived(round(weight_decay.value, 10), weight_decay.how)
    recipe = OptimizerRecipe.for_network(net, opt, lr.value, weight_decay.value, probe.implementation)
    lines = describe_groups(opt, net, recipe.lr, recipe.lr_scales)
    derived["optimizer.decay_norm_and_bias"] = Derived(*lines.pop("optimizer.decay_norm_and_bias"))
    derived["optimizer.implementation"] = probe.derived["optimizer.implementation"]
    derived.update({key: Derived(*line) for key, line in lines.items()})
    derived["scheduler"] = Derived(spec.scheduler.name, describe_schedule(spec.scheduler, recipe.lr, None, opt))
    return recipe


def _flops(net: nn.Module, parts: Parts, accelerator: str, precision: str, tf32: bool, derived: dict[str, Derived]
           ) -> tuple[int | None, tuple[float | None, str], tuple[float | None, str]]:
    """The model's training FLOPs per unit of the task: the task's own count where it has one (a
    Transformer's 6N plus attention), else counted on the plain network (before activation
    checkpointing and compile change it); the device's peak for the math it will run, and its dense
    bf16 peak (the one peak every precision's MFU is also taken against), each with its note."""
    definition, info = parts.definition, parts.info
    flops, how = definition.flops_per_unit(net)
    if flops is None and not how:
        integer = info.kind in ("tokens", "sequences")
        flops, how = training_flops_per_sample(net, info.input_shape(),
                                               dtype=torch.long if integer else None)
        if flops is not None and definition.units_per_sample() > 1:
            flops = flops // definition.units_per_sample()
            how += f", over {definition.units_per_sample()} {definition.unit} a sample"
    unit = (definition.rate_unit or definition.unit).removesuffix("s")
    key = "model.flops_per_sample" if unit == "sample" else f"model.flops_per_{unit}"
    derived[key] = Derived(f"{flops / 1e9:.4g} GFLOP" if flops else None, how)
    if accelerator == "cuda":
        name = torch.cuda.get_device_name()
        peak, peak_how = peak_flops(name, precision, tf32)
        bf16_peak, bf16_how = bf16_peak_flops(name)
    else:
        peak, peak_how = None, f"no known peak for the {accelerator.upper()}: MFU left out"
        bf16_peak, bf16_how = None, f"no known dense bf16 peak for the {accelerator.upper()}: MFU against it left out"
    derived["device.peak_flops"] = Derived(f"{peak / 1e12:.1f} TFLOP/s" if peak else None, peak_how)
    derived["device.bf16_peak_flops"] = Derived(f"{bf16_peak / 1e12:.1f} TFLOP/s" if bf16_peak else None, bf16_how)
    return flops, (peak, peak_how), (bf16_peak, bf16_how)


def _model_changes(spec: RunSpec, parts: Parts, probe: Probe, derived: dict[str, Derived],
                   resize: Optional[ResizeSchedule]) -> tuple[tuple[str, ...], str, Optional[bool]]:
    """What the build phase will do to the network: checkpointed stages, memory format, compile."""
    stages = tuple(select_stages(parts.net, spec.activation_checkpointing))
    if stages:
        derived["model.activation_checkpointing"] = Derived(
            ",".join(stages), "recomputed in backward (non-reentrant), BatchNorm statistics counted once")
    derived["precision.channels_last"] = probe.derived["precision.channels_last"]
    compile_mode, how = resolve_compile_mode(spec.compile.mode, probe.accelerator)
    dynamic, dynamic_how = resolve_dynamic(spec.compile, bool(getattr(parts.datamodule, "variable_shapes", False)))
    if compile_mode == "off":
        how += "; eager"
    else:
        how += f"; torch.compile fullgraph={spec.compile.fullgraph} {dynamic_how}"
        if resize is not None:
            how += f"; {recompile_note(len(set(resize.sizes())))}"
    derived["compile"] = Derived(compile_mode, how)
    return stages, compile_mode, dynamic
