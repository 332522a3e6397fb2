"""The build phase: objects from the validated config (`build_parts`), then the frozen `Plan` applied
to them (`build_task`) and the Lightning Trainer made with the callbacks and loggers (`build_trainer`).
Nothing here decides a setting: that is the resolve phase's (trainer/phases/plan.py)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Mapping, Optional, Sequence

from hydra.utils import instantiate
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelSummary

from trainer.callbacks.curves import Curves
from trainer.callbacks.graceful import GracefulStop
from trainer.callbacks.logged_metrics import LoggedMetrics
from trainer.callbacks.model_summary import model_summary
from trainer.callbacks.loss_record import LossRecord
from trainer.callbacks.progress import LogStepRichProgressBar, PlainProgress
from trainer.callbacks.rng import RNGState
from trainer.callbacks.step_log import StepLog
from trainer.callbacks.target import TargetWatch
from trainer.callbacks.throughput import ThroughputMeter
from trainer.configuration.spec import RunSpec
from trainer.data.base import DataModule
from trainer.data.group import build_data
from trainer.groups.callbacks import build_callbacks
from trainer.groups.checkpointing import build_checkpointing, build_periodic
from trainer.groups.clipping import GradientClipping
from trainer.groups.communication import strategy_target
from trainer.groups.compile import allow_recompiles, apply_compile
from trainer.groups.logger import build_loggers, logger_callbacks, run_hyperparameters, run_labels, start_loggers
from trainer.groups.precision import apply_tf32, lightning_precision
from trainer.groups.task import (SPLITS, build_definition, check_metric, check_task, headline_metrics, logged_metrics,
                                 mode_of, objective_of, shown_metrics)
from trainer.groups.trainer import make_trainer
from trainer.infra.checkpoint_io import SafeCheckpointIO
from trainer.infra.devices import stop_nvml_probes_without_cuda
from trainer.infra.instantiation import construct
from trainer.infra.schema import locate_target
from trainer.models.activation_checkpointing import apply_activation_checkpointing
from trainer.models.group import build_model
from trainer.phases.first_batch import check_first_batch
from trainer.phases.plan import Plan, device_of
from trainer.phases.products import Built, Parts
from trainer.phases.resume import check_fits
from trainer.phases.state import Run
from trainer.task import TrainingTask


def build_parts(run: Run) -> None:
    """The data module (told the run's folder and seed), the task bound to what the data say, the
    network for both, one batch through the three (trainer/phases/first_batch.py), and the clipping
    and non-finite callbacks; `run.parts`."""
    spec = run.spec
    datamodule, info = build_data(spec.data, run.job.run_dir, spec.top.seed)
    definition = build_definition(spec.task, info, spec.regularization)
    check_task(definition, task_settings(spec))
    metrics = logged_metrics(definition)
    check_metric_names(spec, metrics)
    net = build_model(spec.model, info.model_inputs(), required=definition.model_inputs)
    check_first_batch(datamodule, info, net, definition, device_of(run.devices.accelerator))
    run.parts = Parts(datamodule, info, net,
                      GradientClipping(construct("clipping", lambda: instantiate(spec.clipping, _convert_="all"))),
                      construct("nonfinite", lambda: instantiate(spec.nonfinite, _convert_="all")), definition,
                      metrics)


def check_metric_names(spec: RunSpec, logged: Mapping[str, Optional[bool]]) -> None:
    """Every key that names a metric names one the task logs (the best checkpoint's monitor, early
    stopping's, the target, the objective), with a mode that agrees with its direction: one line for
    the first that does not, before anything trains (Lightning would find out after the first
    validation, or never: a best checkpoint picked by the wrong end)."""
    during = ("train", "val")  # the test split is evaluated once, at the end
    if spec.checkpointing.enabled:
        check_metric("checkpointing.monitor", spec.checkpointing.monitor, logged, during, "checkpointing.mode",
                     spec.checkpointing.mode)
    if spec.target.metric is not None:
        check_metric("target.metric", spec.target.metric, logged, during, "target.mode", spec.target.mode)
    if spec.top.objective != "auto":
        check_metric("objective", spec.top.objective, logged, SPLITS)
    for name, values in spec.callbacks.items():
        target = locate_target(f"callbacks.{name}", values["_target_"])
        if inspect.isclass(target) and issubclass(target, EarlyStopping) and "monitor" in values:
            check_metric(f"callbacks.{name}.monitor", values["monitor"], logged, during, f"callbacks.{name}.mode",
                         values.get("mode", "min"))  # (Lightning's default mode)


def task_settings(spec: RunSpec) -> dict[str, Any]:
    """What a task's refusals read: the groups' choices and the data's and compile's keys."""
    return {"choices": dict(spec.choices), "data": dict(spec.data),
            "compile": {"mode": spec.compile.mode, "dynamic": spec.compile.dynamic}}


def apply_to_data(plan: Plan, datamodule: DataModule) -> None:
    """The plan's batch, loader settings, decode mode and training sizes, for every loader the data
    module builds."""
    datamodule.set_batch_size(plan.batch_size)
    datamodule.apply_loader(plan.loader)
    datamodule.apply_decode(plan.decode)
    datamodule.apply_resize(plan.resize)


def build_task(run: Run) -> None:
    """Apply the plan to the data and the network (checkpointed stages, TF32, compile, memory format)
    and wrap it in the LightningModule with the plan's optimizer recipe; `run.task`. A checkpoint to
    resume from must fit it."""
    plan, parts, spec = run.plan, run.parts, run.spec
    apply_to_data(plan, parts.datamodule)
    apply_activation_checkpointing(parts.net, plan.checkpointed_stages)
    apply_tf32(plan.tf32, plan.accelerator)
    stop_nvml_probes_without_cuda()
    apply_compile(parts.net, plan.compile_mode, spec.compile, plan.compile_dynamic)
    if plan.compile_mode != "off" and plan.resize is not None:
        allow_recompiles(len(set(plan.resize.sizes())))
    run.task = TrainingTask(parts.net, parts.definition, plan.optimizer, spec.scheduler,
                            channels_last=plan.channels_last)
    if run.identity.resume_from is not None:
        check_fits(run.identity.resume_from, run.task.state_dict())


def build_trainer(run: Run, measuring_steps: int | None = None, extra_callbacks: Sequence[Callback] = ()) -> Built:
    """The Trainer and its callbacks for the run; with `measuring_steps`, for a measurement of that
    many training steps instead (the diagnosis, the profile): the real loop and callbacks, without
    validation, checkpoints, loggers or progress output."""
    spec, plan, parts, run_dir = run.spec, run.plan, run.parts, run.job.run_dir
    if measuring_steps is not None:
        spec, plan = _measuring(spec, plan, measuring_steps)
        run.task.announces_schedule = False  # its schedule is the run's, not this measurement's length
    definition = parts.definition
    # The meter's unit: the task's own rate unit where it has one (a sequence classifier's tokens).
    rate_unit, units_of = ((definition.rate_unit, definition.rate_units_in) if definition.rate_unit
                           else (plan.unit, definition.units_in))
    meter = ThroughputMeter(flops_per_sample=plan.flops_per_sample, peak_flops=plan.peak_flops,
                            mfu_note=plan.peak_flops_note, unit=rate_unit, units_of=units_of,
                            bf16_peak_flops=plan.bf16_peak_flops)
    losses, logged = LossRecord(), LoggedMetrics()
    curves = Curves(losses, headline_metrics(parts.metrics, objective_of(spec.task, spec.top.objective)))
    stopper = GracefulStop(run.latch if measuring_steps is None else None)
    # The guard goes first: it flags a step from the gradients as backward left them (clipping then
    # sees a skipped step's non-finite norm, counts it and records nothing). StepLog after the three
    # whose values it writes at log steps (their own batch-end work first).
    callbacks: list[Callback] = [parts.guard, parts.clipping, meter, StepLog([parts.guard, parts.clipping, meter]),
                                 losses, curves, stopper, RNGState(), logged]
    checkpoint = build_checkpointing(spec.checkpointing, run_dir)
    callbacks += [c for c in (build_periodic(spec.checkpointing, run_dir), checkpoint) if c is not None]
    if plan.progress == "rich":
        callbacks.append(LogStepRichProgressBar(latest_loss=losses.latest))
    elif plan.progress == "plain":
        callbacks.append(PlainProgress(every_s=spec.top.progress_every_s, latest_loss=losses.latest,
                                       keys=shown_metrics(parts.metrics)))
    loggers = []
    if spec.loggers:
        # wandb's name, group and tags: the run's name; the sweep folder (conf/train.yaml's
        # hydra.sweep.subdir puts each job one level below it); the recipe and group choices.
        labels = run_labels(run.identity.name, run.job.choices, run_dir.parent if run.job.multirun else None,
                            spec.identity.root)
        loggers = build_loggers(spec.loggers, run_dir, run.identity.logger_ids, labels)
        if run.rank_zero:  # a logger that cannot start refuses now, before anything trains
            start_loggers(loggers, spec.loggers)
    if loggers:
        # Every logger gets the lr per step and the resolved config with the plan's derived values.
        callbacks += logger_callbacks(run_hyperparameters(
            spec.resolved, {key: derived.value for key, derived in plan.derived.items()}, spec.choices),
            list(parts.metrics))
    # The callbacks group's (early stopping, EMA, a team's own) run after the framework's at every hook.
    callbacks += build_callbacks(spec.callbacks, has_logger=bool(loggers), accelerator=plan.accelerator)
    callbacks += list(extra_callbacks)  # a measurement's own (the profiler of profile=true)
    if _model_summary_wanted(spec.trainer, callbacks):
        callbacks.append(model_summary())  # Lightning's less its FLOPs; the Trainer is told not to add its own
    target = None
    if spec.target.metric is not None:
        assert spec.target.value is not None  # TargetConfig.check refuses a metric without a value
        mode = mode_of(spec.target.mode, spec.target.metric, parts.metrics)
        target = TargetWatch(spec.target.metric, spec.target.value, mode, plan.global_batch_size,
                             plan.unit, plan.units_per_sample)
        callbacks.append(target)
    trainer = make_trainer(  # what Lightning refuses here ends as one line naming trainer.<key>
        spec.trainer,
        **_trainer_arguments(spec, plan, parts.clipping),
        logger=loggers if loggers else False,
        callbacks=callbacks,
        enable_checkpointing=checkpoint is not None,
        enable_progress_bar=plan.progress == "rich",
        default_root_dir=str(run_dir),
    )
    return Built(trainer, checkpoint, losses, stopper, curves, meter, logged, target)


def _model_summary_wanted(trainer: dict[str, Any], callbacks: Sequence[Callback]) -> bool:
    """Lightning's rule for its default summary: unless switched off (`enable_model_summary`,
    `barebones`) or a summary callback is given (the callbacks group's)."""
    return (trainer.get("enable_model_summary") is not False and not trainer.get("barebones")
            and not any(isinstance(callback, ModelSummary) for callback in callbacks))


def _measuring(spec: RunSpec, plan: Plan, steps: int) -> tuple[RunSpec, Plan]:
    """The run's spec and plan for a measurement of `steps` training steps."""
    spec = dataclasses.replace(
        spec, checkpointing=dataclasses.replace(spec.checkpointing, enabled=False), loggers={},
        top=dataclasses.replace(spec.top, progress="off"),
        trainer={**spec.trainer, "max_steps": steps, "max_epochs": -1, "limit_val_batches": 0,
                 "num_sanity_val_steps": 0, "limit_train_batches": None})
    return spec, dataclasses.replace(plan, probe=dataclasses.replace(plan.probe, progress="off"))


def _trainer_arguments(spec: RunSpec, plan: Plan, clipping: GradientClipping) -> dict[str, Any]:
    """The `trainer` group's arguments, with the accelerator and precision the plan chose, and
    Lightning's own clipping where the clipping rule is one of its two."""
    arguments = {**spec.trainer, **clipping.rule.trainer_arguments()}
    precision = lightning_precision(plan.precision, plan.accelerator, spec.precision)
    # Every checkpoint the Trainer writes or reads goes through SafeCheckpointIO (atomic,
    # weights-only, prefix-free keys) instead of Lightning's TorchCheckpointIO. The person's own
    # plugins (trainer.plugins: cluster environments, layer syncs) come after the framework's.
    plugins = [*precision.pop("plugins", []), SafeCheckpointIO(), *arguments.pop("plugins", [])]
    if plan.slurm_environment:  # without auto-requeue: see trainer/groups/trainer.py slurm_environment
        plugins.append(SLURMEnvironment(auto_requeue=False))
    arguments.update(accelerator=plan.accelerator, devices=plan.probe.devices.trainer_devices, plugins=plugins,
                     benchmark=plan.cudnn_benchmark,
                     enable_model_summary=False, **precision)  # the summary is build_trainer's callback
    if plan.communication.gradient_compression != "none":
        # The configured DDP strategy, made with the compression's hook (fresh for each Trainer).
        arguments["strategy"] = strategy_target(plan.communication, arguments.get("strategy", "auto"))
    return arguments
