"""The build phase: objects from the validated config, then the Lightning Trainer from the plan.

`build_parts` instantiates what the config names (data module, network, clipping and non-finite
callbacks) before anything is resolved; `apply_to_data` and `build_task` apply the frozen `Plan` to
the data module and the network; `build_trainer` assembles the callbacks (the framework's, then the
`callbacks` group's), loggers and `lightning.Trainer` (the `trainer` group's arguments plus what the
plan decided, made by trainer/groups/lightning_trainer.py). Nothing here decides a setting: that is `trainer.phases.plan`.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, RichProgressBar
from torch import nn

from trainer.callbacks.clipping import GradientClipping
from trainer.callbacks.configured import build_callbacks
from trainer.callbacks.curves import Curves
from trainer.callbacks.graceful import GracefulStop, SignalLatch
from trainer.callbacks.logged_metrics import LoggedMetrics
from trainer.callbacks.loss_record import LossRecord
from trainer.callbacks.nonfinite import NonFiniteGuard
from trainer.callbacks.progress import PlainProgress
from trainer.callbacks.rng import RNGState
from trainer.callbacks.target import TargetWatch
from trainer.callbacks.throughput import ThroughputMeter
from trainer.groups.checkpoint import SafeCheckpointIO, build_checkpointing, build_periodic
from trainer.groups.compile import allow_recompiles, apply_compile
from trainer.configuration.spec import INJECTED_MODEL_ARGS, RunSpec, locate_target
from trainer.data.base import DataInfo, ImageClassificationData
from trainer.infra.errors import UserError
from trainer.configuration.instantiation import construct
from trainer.groups.lightning_trainer import make_trainer
from trainer.groups.logger import RunLabels, build_loggers, logger_callbacks, run_hyperparameters
from trainer.models.activation_checkpointing import apply_activation_checkpointing
from trainer.phases.plan import Plan
from trainer.groups.precision import apply_tf32, lightning_precision
from trainer.task import ClassificationTask


class Parts(NamedTuple):
    """What the config names, instantiated and not yet changed by the plan."""

    datamodule: ImageClassificationData
    info: DataInfo
    net: nn.Module
    clipping: GradientClipping
    guard: NonFiniteGuard


class Built(NamedTuple):
    """The Trainer and the callbacks the run reads back from after fitting."""

    trainer: L.Trainer
    checkpoint: ModelCheckpoint | None
    losses: LossRecord
    stopper: GracefulStop
    curves: Curves
    meter: ThroughputMeter
    logged: LoggedMetrics
    target: TargetWatch | None = None


def build_parts(spec: RunSpec, run_dir: Path) -> Parts:
    datamodule, info = build_data(spec, run_dir)
    return Parts(datamodule, info, build_model(spec, info),
                 construct("clipping", lambda: instantiate(spec.clipping, _convert_="all")),
                 construct("nonfinite", lambda: instantiate(spec.nonfinite, _convert_="all")))


def build_data(spec: RunSpec, run_dir: Path) -> tuple[ImageClassificationData, DataInfo]:
    """The data module, told the run's folder and seed, and what it found in its source."""
    datamodule = construct("data", lambda: instantiate(spec.data, _convert_="all"))
    datamodule.attach_run(run_dir, spec.top.seed)
    info = datamodule.inspect()
    train_size = info.sizes.get("train", 0)
    if train_size < datamodule.batch_size:
        raise UserError("data.batch_size", f"{datamodule.batch_size} is larger than the training split "
                        f"({train_size} samples); the last partial batch is dropped, so no step would run",
                        f"at most {train_size}")
    return datamodule, info


def build_model(spec: RunSpec, info: DataInfo) -> nn.Module:
    """The network, given the data's classes, channels and image size where its constructor takes them."""
    target = locate_target("model", spec.model["_target_"])
    available = {"num_classes": info.num_classes, "in_channels": info.in_channels, "image_size": list(info.image_size)}
    try:
        parameters = inspect.signature(target).parameters
        takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        injected = {k: v for k, v in available.items() if k in parameters or takes_kwargs}
    except (TypeError, ValueError):
        injected = {"num_classes": info.num_classes}
    if "num_classes" not in injected:
        raise UserError("model._target_", f"'{spec.model['_target_']}' takes no num_classes argument",
                        f"a constructor accepting {', '.join(INJECTED_MODEL_ARGS)} (those it needs)")
    net = construct("model", lambda: instantiate(spec.model, _convert_="all", **injected))
    if not isinstance(net, nn.Module):
        raise UserError("model._target_", f"'{spec.model['_target_']}' returned {type(net).__name__}, not an nn.Module",
                        "a class or function that returns a torch.nn.Module")
    return net


def apply_to_data(plan: Plan, datamodule: ImageClassificationData) -> None:
    """The plan's loader settings, decode mode and training sizes, for every loader the data module builds."""
    datamodule.apply_loader(plan.loader)
    datamodule.apply_decode(plan.decode)
    datamodule.apply_resize(plan.resize)


def build_task(spec: RunSpec, plan: Plan, parts: Parts) -> ClassificationTask:
    """Apply the plan to the network (checkpointed stages, TF32, compile, memory format) and wrap it
    in the LightningModule with the plan's lr, weight decay and optimizer kernel."""
    apply_activation_checkpointing(parts.net, plan.checkpointed_stages)
    apply_tf32(plan.tf32, plan.accelerator)
    apply_compile(parts.net, plan.compile_mode, spec.compile)
    if plan.compile_mode != "off" and plan.resize is not None:
        allow_recompiles(len(set(plan.resize.sizes())))
    return ClassificationTask(parts.net, parts.info.num_classes, plan.optimizer, spec.scheduler,
                              channels_last=plan.channels_last, regularization=spec.regularization)


def build_trainer(spec: RunSpec, plan: Plan, run_dir: Path, parts: Parts,
                  logger_ids: dict[str, str] | None = None, latch: SignalLatch | None = None,
                  labels: RunLabels | None = None, extra_callbacks: Sequence[Callback] = ()) -> Built:
    meter = ThroughputMeter(flops_per_sample=plan.flops_per_sample, peak_flops=plan.peak_flops,
                            mfu_note=plan.peak_flops_note)
    losses, stopper, curves, logged = LossRecord(), GracefulStop(latch), Curves(), LoggedMetrics()
    # The guard goes first: a step it skips has no gradients left for clipping to record.
    # RNGState and LoggedMetrics: the random generators' states and the logged metrics go into
    # every checkpoint and come back on resume.
    callbacks: list[Callback] = [parts.guard, parts.clipping, meter, losses, curves, stopper, RNGState(), logged]
    periodic = build_periodic(spec.checkpointing, run_dir)
    checkpoint = build_checkpointing(spec.checkpointing, run_dir)
    callbacks += [c for c in (periodic, checkpoint) if c is not None]
    progress = _progress_callback(spec, plan.progress)
    if progress is not None:
        callbacks.append(progress)
    loggers = build_loggers(spec.loggers, run_dir, logger_ids, labels)
    if loggers:
        # Every logger gets the lr per step and the resolved config with the plan's derived values.
        callbacks += logger_callbacks(run_hyperparameters(
            spec.resolved, {key: derived.value for key, derived in plan.derived.items()}, spec.choices))
    # The callbacks group's (early stopping, EMA, a team's own) run after the framework's at every hook.
    callbacks += build_callbacks(spec.callbacks, has_logger=bool(loggers), accelerator=plan.accelerator)
    callbacks += list(extra_callbacks)  # a measurement's own (the profiler of profile=true)
    target = None
    if spec.target.metric is not None:
        assert spec.target.value is not None  # TargetConfig.check refuses a metric without a value
        target = TargetWatch(spec.target.metric, spec.target.value, spec.target.mode, plan.global_batch_size)
        callbacks.append(target)
    trainer = make_trainer(  # what Lightning refuses here ends as one line naming trainer.<key>
        spec.trainer,
        **_trainer_arguments(spec, plan),
        logger=loggers if loggers else False,
        callbacks=callbacks,
        enable_checkpointing=checkpoint is not None,
        enable_progress_bar=isinstance(progress, RichProgressBar),
        default_root_dir=str(run_dir),
    )
    return Built(trainer, checkpoint, losses, stopper, curves, meter, logged, target)


def _progress_callback(spec: RunSpec, progress: str) -> Callback | None:
    if progress == "rich":
        return RichProgressBar()
    if progress == "plain":
        return PlainProgress(every_s=spec.top.progress_every_s)
    return None


def _trainer_arguments(spec: RunSpec, plan: Plan) -> dict[str, Any]:
    """The `trainer` group's arguments, with the accelerator and precision the plan chose."""
    arguments = dict(spec.trainer)
    precision = lightning_precision(plan.precision, plan.accelerator, spec.precision)
    # Every checkpoint the Trainer writes or reads goes through SafeCheckpointIO (atomic,
    # weights-only, prefix-free keys) instead of Lightning's TorchCheckpointIO. The person's own
    # plugins (trainer.plugins: cluster environments, layer syncs) come after the framework's.
    plugins = [*precision.pop("plugins", []), SafeCheckpointIO(), *arguments.pop("plugins", [])]
    if plan.slurm_environment:  # without auto-requeue: see trainer/phases/plan.py
        plugins.append(SLURMEnvironment(auto_requeue=False))
    arguments.update(accelerator=plan.accelerator, plugins=plugins, benchmark=plan.cudnn_benchmark, **precision)
    return arguments


def device_of(plan: Plan) -> torch.device:
    """The torch device the run trains on (the current CUDA device under several processes)."""
    if plan.accelerator == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(plan.accelerator)
