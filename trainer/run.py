"""The one place that wires a run: validate, resolve, build, fit, test, summarize."""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from omegaconf import DictConfig, OmegaConf

from trainer.config import INJECTED_MODEL_ARGS, RunSpec, locate_target, validate
from trainer.errors import UserError, exit_with, full_error_requested

log = logging.getLogger("trainer")


def run(cfg: DictConfig, run_dir: Path | None = None, group_choices: dict[str, str] | None = None,
        overrides: list[str] | None = None) -> float | None:
    """Train and test as `cfg` says; return the metric named by `objective` (the sweep objective,
    val/acc by default).

    `run_dir`, `group_choices` and `overrides` default to Hydra's for the current job. A mistake in
    the input ends the process with one line and exit code 2 (a traceback with HYDRA_FULL_ERROR=1).
    In a multirun, a job that fails returns NaN instead, so the sweep goes on (see `_failed_job`).
    """
    try:
        objective = _run(cfg, run_dir, group_choices, overrides)
    except UserError as ex:
        if full_error_requested():
            raise
        from trainer.distributed import LaunchRefused

        if _in_multirun() and not isinstance(ex, LaunchRefused):
            return _failed_job(ex.line(), None)
        # Exiting here, not raising: Hydra would print its own "Error executing job" line first.
        exit_with(ex.line())
    except Exception as ex:  # noqa: BLE001 - only inside a multirun, see below
        if not _in_multirun() or full_error_requested():
            raise
        return _failed_job(f"{type(ex).__name__}: {ex}".splitlines()[0], ex)
    if objective is not None and not math.isfinite(objective) and _in_multirun() and _optuna_sweep():
        raise TrialFailed(f"objective is {objective}: the trial counts as failed")
    return objective


class TrialFailed(Exception):
    """An Optuna trial whose run failed or has no finite objective (see `_failed_job`)."""


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _optuna_sweep() -> bool:
    from hydra.core.hydra_config import HydraConfig

    return "optuna" in str(HydraConfig.get().sweeper.get("_target_", "")).lower()


def _failed_job(line: str, ex: BaseException | None) -> float:
    """One job of a sweep failed: say so (with the traceback of an unexpected error in the job's
    log) and go on with the sweep. The job's summary.json, where it got that far, says failed.

    Hydra's basic sweeper ends the whole sweep after a batch in which a job raised, without the
    comparison table, so there the job returns NaN instead. Hydra's Optuna sweeper (1.3 with optuna
    2.10) crashes on a NaN value (it tells the study twice), but records a job that raised as a
    failed trial and goes on while the failure share is within ``max_failure_rate``, so there it
    raises `TrialFailed`.
    """
    if ex is not None:
        log.error("job failed", exc_info=ex)
    log.error("error: %s", line)
    if _optuna_sweep():
        raise TrialFailed(line)
    return float("nan")


def _run(cfg: DictConfig, run_dir: Path | None, group_choices: dict[str, str] | None,
         overrides: list[str] | None) -> float | None:
    started = time.perf_counter()
    multirun, search_path, launcher_target = False, [], ""
    if run_dir is None or group_choices is None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hydra_cfg = HydraConfig.get()
        run_dir = run_dir or Path(hydra_cfg.runtime.output_dir)
        group_choices = group_choices if group_choices is not None else {
            k: str(v) for k, v in hydra_cfg.runtime.choices.items() if not k.startswith("hydra") and v is not None}
        overrides = overrides if overrides is not None else list(hydra_cfg.overrides.task)
        multirun = hydra_cfg.mode == RunMode.MULTIRUN
        launcher_target = str(hydra_cfg.launcher.get("_target_", ""))
        search_path = [str(entry) for entry in hydra_cfg.searchpath or []]
    spec = validate(cfg, group_choices)
    from trainer.distributed import check_launch, is_rank_zero, launched_by, process_count
    from trainer.devices import count_devices, resolve_accelerator

    accelerator = resolve_accelerator(str(spec.trainer.get("accelerator", "auto")))[0]
    processes = process_count(spec.trainer, count_devices(spec.trainer.get("devices", 1), accelerator))
    check_launch(processes, multirun, launcher_target, spec.run.diagnose, spec.trainer.get("strategy", "auto"),
                 accelerator)
    # With several processes (trainer=ddp), the other ranks train and say only what goes wrong;
    # rank 0 writes the run's records into the one run folder.
    rank_zero = is_rank_zero()
    if not rank_zero:
        log.setLevel(logging.WARNING)
    if spec.run.ladder and not multirun:
        raise UserError("ladder", f"'{spec.run.ladder}' is a sequence of runs and needs Hydra's multirun",
                        f"python train.py -m +ladder={spec.run.ladder}")
    from trainer.logger import logger_ids
    from trainer.resume import default_name, identity_of, resolve_resume, write_identity

    name = spec.identity.name or default_name(group_choices, overrides or [])
    resume_from = resolve_resume(spec.run.resume, name, Path(spec.identity.root), run_dir)
    # A logger's run (wandb) carries on under the id of the run resumed from.
    ids = logger_ids(spec.loggers, identity_of(resume_from.path).get("logger_ids") if resume_from else None)
    if rank_zero:
        write_identity(run_dir, name, str(resume_from.path) if resume_from else None, ids)

    import lightning as L
    import torch

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from trainer.callbacks.graceful import StoppedBySignal
    from trainer.fingerprint import fingerprint
    from trainer.plan import Derived, resolve
    from trainer.atomic import write_text_atomic
    from trainer.summary import write_json_atomic

    _route_library_logs()
    L.seed_everything(spec.run.seed, workers=True, verbose=False)
    datamodule, info = _build_data(spec, run_dir)
    plan = resolve(spec, datamodule, info.sample_bytes)
    net = _build_model(spec, info)
    meter = _throughput_meter(net, info, plan)

    from trainer.compile import apply_compile
    from trainer.models.layers import count_parameters
    from trainer.precision import apply_tf32, resolve_channels_last
    from trainer.task import ClassificationTask

    n_params = count_parameters(net)
    if spec.activation_checkpointing:
        from trainer.models.activation_checkpointing import apply_activation_checkpointing

        stages = apply_activation_checkpointing(net, spec.activation_checkpointing)
        plan.derived["model.activation_checkpointing"] = Derived(
            ",".join(stages), "recomputed in backward (non-reentrant), BatchNorm statistics counted once")
    alignment = _alignment(net, spec, plan)
    channels_last, how = resolve_channels_last(spec.precision.channels_last, plan.accelerator, net)
    plan.derived["precision.channels_last"] = Derived(channels_last, how)
    apply_tf32(plan.tf32, plan.accelerator)
    compile_mode, how = apply_compile(net, spec.compile, plan.accelerator)
    plan.derived["compile"] = Derived(compile_mode, how)

    task = ClassificationTask(net, info.num_classes, spec.optimizer, spec.scheduler, plan.lr, plan.weight_decay,
                              optimizer_implementation=plan.optimizer_implementation, channels_last=channels_last)
    built = _build_trainer(spec, plan, run_dir, meter, ids)
    trainer, checkpoint, clipping, losses, guard, stopper = (built.trainer, built.checkpoint, built.clipping,
                                                             built.losses, built.guard, built.stopper)
    plan.derived["clipping"] = Derived(clipping.mode, _describe_clipping(clipping.summary()))

    log.info("run %s, folder %s", name, run_dir)
    if resume_from is not None:
        from trainer.resume import check_fits

        check_fits(resume_from, task.state_dict())
        log.info("resuming from %s (step %d, epoch %d%s)", resume_from.path, resume_from.global_step,
                 resume_from.epoch, ", mid-epoch" if resume_from.mid_epoch else "")
    for line in plan.lines():
        log.info("  %s", line)
    environment = fingerprint()
    if rank_zero:
        write_json_atomic(run_dir / "env.json", environment)
        # Hydra's .hydra/config.yaml keeps interpolations as written; this is what the run used.
        write_text_atomic(run_dir / "config_resolved.yaml", OmegaConf.to_yaml(spec.resolved))
    if spec.run.diagnose:
        return _diagnose(spec, plan, datamodule, task, meter, run_dir)
    recipe = _recipe_lineage(group_choices.get("recipe"), overrides or [], spec.resolved, search_path)

    summary: dict[str, Any] = {
        "status": "running",
        "run_name": name,
        "run_dir": str(run_dir),
        "resumed_from": ({"path": str(resume_from.path), "global_step": resume_from.global_step,
                          "epoch": resume_from.epoch, "mid_epoch": resume_from.mid_epoch} if resume_from else None),
        "command": " ".join([Path(sys.argv[0]).name, *(overrides or [])]),
        "overrides": overrides or [],
        "choices": dict(group_choices),
        "recipe": recipe,
        "ladder": spec.run.ladder,
        "seed": spec.run.seed,
        "derived": plan.to_dict(),
        "hyperparameters": {
            "batch_size": spec.data["batch_size"], "global_batch_size": plan.global_batch_size,
            "optimizer": spec.optimizer.name, "lr": plan.lr, "weight_decay": plan.weight_decay,
            "scheduler": spec.scheduler.name, "precision": plan.precision,
            "max_epochs": trainer.max_epochs, "max_steps": trainer.max_steps,
        },
        "data": {"target": spec.data["_target_"], "num_classes": info.num_classes, "in_channels": info.in_channels,
                 "image_size": list(info.image_size), "sizes": info.sizes, "notes": info.notes},
        "model": {"target": spec.model["_target_"], "parameters": n_params,
                  "activation_checkpointing": spec.activation_checkpointing, "alignment": alignment},
        "device": {"accelerator": plan.accelerator, "devices": plan.devices,
                   "name": environment["gpus"][0] if plan.accelerator == "cuda" else environment["cpu"]},
        "processes": {"count": trainer.world_size, "strategy": type(trainer.strategy).__name__,
                      "launched_by": launched_by() or ("lightning" if trainer.world_size > 1 else None)},
    }
    summary_path = run_dir / "summary.json"
    from trainer.summary import peak_memory, reset_peak_memory, split_metrics

    memory_device = (torch.device("cuda", torch.cuda.current_device()) if plan.accelerator == "cuda"
                     else torch.device("cpu"))
    # The jobs of a multirun share this process: collect the previous job's reference cycles
    # (trainer <-> module) before counting this run's peak, or its model would still be resident.
    gc.collect()
    peak_reset = reset_peak_memory(memory_device)
    fit_started = time.perf_counter()
    try:
        with _quiet_library_warnings():
            trainer.fit(task, datamodule=datamodule, ckpt_path=str(resume_from.path) if resume_from else None,
                        weights_only=True)
            fit_seconds = time.perf_counter() - fit_started
            fit_metrics = {k: v for k, v in trainer.callback_metrics.items()}
            stopped = stopper.outcome()
            if stopped is not None:
                raise stopped
            if trainer.interrupted:
                raise KeyboardInterrupt
            use_best = checkpoint is not None and bool(checkpoint.best_model_path)
            test_results = trainer.test(task, datamodule=datamodule, ckpt_path="best" if use_best else None,
                                        verbose=False, weights_only=True)
    except BaseException as ex:
        # Lightning ends a SIGTERM'd fit with its own SIGTERMException; the checkpoint was written
        # by GracefulStop at the end of that step, so the run stopped cleanly.
        ex = stopper.outcome() or ex
        _finish_loggers(trainer, failed=True)
        if rank_zero:
            _record_bad_files(summary, datamodule)
            _draw_curves(built.curves, run_dir, name)
        summary.update(nonfinite=guard.summary(),
                       status="interrupted" if isinstance(ex, (KeyboardInterrupt, StoppedBySignal, SIGTERMException))
                       else "failed",
                       error=f"{type(ex).__name__}: {ex}".splitlines()[0] if str(ex) else type(ex).__name__,
                       wall_time_s=time.perf_counter() - started, steps=trainer.global_step)
        if rank_zero:
            write_json_atomic(summary_path, summary)
        if isinstance(ex, SIGTERMException):  # Lightning's, outside the training steps
            sys.stderr.write("stopped by SIGTERM outside a training step; no checkpoint written for it\n")
            raise SystemExit(128 + 15) from None
        if isinstance(ex, StoppedBySignal):
            # A clean stop, not an error: the conventional exit status of a signalled process.
            sys.stdout.flush()
            sys.stderr.write(f"{ex}\n")
            sys.stderr.flush()
            raise SystemExit(128 + ex.signum) from None
        if isinstance(ex, torch.cuda.OutOfMemoryError):  # torch.OutOfMemoryError in newer torch
            raise _out_of_memory(ex, spec, checkpoint) from None
        from trainer.data.loader import loader_failure

        failure = loader_failure(ex)  # a loader worker that raised or died: one line
        if failure is not None and failure is not ex:
            raise failure from None
        raise

    metrics = split_metrics(fit_metrics)
    optimizer = trainer.optimizers[0] if trainer.optimizers else None
    param_groups = [{"lr": g.get("initial_lr", g["lr"]), "weight_decay": g["weight_decay"],
                     "tensors": len(g["params"]), "elements": sum(p.numel() for p in g["params"]),
                     "fused": bool(g.get("fused")), "foreach": bool(g.get("foreach"))}
                    for g in (optimizer.param_groups if optimizer else [])]
    metrics.update(split_metrics(test_results[0] if test_results else {}))
    _record_bad_files(summary, datamodule)
    summary.update(
        status="completed",
        metrics=metrics,
        tested_weights=(f"best checkpoint by {spec.checkpointing.monitor} ({Path(checkpoint.best_model_path).name}, "
                        f"{spec.checkpointing.monitor}={float(checkpoint.best_model_score):.4f})" if use_best
                        else "weights at the end of training"),
        best_checkpoint=checkpoint.best_model_path if use_best else None,
        optimizer_param_groups=param_groups,
        throughput=meter.summary(),
        loss=losses.summary(),
        clipping=clipping.summary(),
        nonfinite=guard.summary(),
        peak_memory=peak_memory(memory_device, peak_reset),
        steps=trainer.global_step,
        epochs=trainer.current_epoch,
        fit_time_s=fit_seconds,
        wall_time_s=time.perf_counter() - started,
    )
    _finish_loggers(trainer, failed=False)
    if rank_zero:
        _draw_curves(built.curves, run_dir, name)
        write_json_atomic(summary_path, summary)
        _report(summary)
    return _objective(metrics, spec.run.objective)


def _objective(metrics: dict[str, dict[str, float]], name: str) -> float:
    """The metric `name` (``split/metric``) of the finished run; NaN when the run has none."""
    split, _, metric = name.partition("/")
    value = metrics.get(split, {}).get(metric)
    if value is None:
        log.warning("objective %s: the run logged no such metric (it has %s); returning NaN", name,
                    ", ".join(f"{s}/{m}" for s, values in metrics.items() for m in values) or "none")
        return float("nan")
    return float(value)


def _finish_loggers(trainer: Any, failed: bool) -> None:
    from trainer.logger import finish_loggers

    try:
        finish_loggers(list(trainer.loggers), failed)
    except Exception as ex:  # noqa: BLE001 - a logger's shutdown must not cost the run its summary
        log.warning("could not finish a logger's run: %s", str(ex).splitlines()[0] if str(ex) else type(ex).__name__)


def _draw_curves(curves: Any, run_dir: Path, name: str) -> None:
    """curves.png in the run folder; a failure to draw is a warning, never the run's end."""
    try:
        curves.write_png(run_dir / "curves.png", title=name)
    except Exception as ex:  # noqa: BLE001 - a plot must not cost the run its summary
        log.warning("could not draw curves.png: %s", str(ex).splitlines()[0] if str(ex) else type(ex).__name__)


def _record_bad_files(summary: dict[str, Any], datamodule: Any) -> None:
    """Files a data module found unreadable (image folders: by the scan and while loading)."""
    report = getattr(datamodule, "bad_files_summary", None)
    if report is not None:
        summary["data"]["bad_files"] = report()


def _out_of_memory(ex: BaseException, spec: RunSpec, checkpoint: Any) -> UserError:
    """Device memory ran out: one line with the batch size and the switches that need less memory
    (what was saved before stays as it was: checkpoints are only ever replaced atomically)."""
    batch = int(spec.data["batch_size"])
    saved = ""
    last = getattr(checkpoint, "last_model_path", "") if checkpoint is not None else ""
    if last and Path(last).is_file():
        saved = f"; the last checkpoint is intact: {last}"
    reason = str(ex).strip().splitlines()[0][:160] if str(ex).strip() else "out of memory"
    return UserError("data.batch_size", f"out of device memory at batch size {batch} ({reason}){saved}",
                     f"data.batch_size={max(1, batch // 2)} with trainer.accumulate_grad_batches="
                     f"{2 * int(spec.trainer.get('accumulate_grad_batches', 1))} (same global batch), "
                     "precision=bf16_mixed, model.activation_checkpointing=[STAGE,...], a smaller data.image_size")


@contextlib.contextmanager
def _quiet_library_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        # The loader settings were chosen and printed with their reasons above; Lightning's
        # generic "few workers" hint would only contradict them (e.g. in-memory data).
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        # Lightning 2.6 calls a torch pytree API that newer torch deprecates: nothing to act on.
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
        # The data modules keep the place in the data order themselves (trainer/data/base.py),
        # which Lightning cannot see; and the resume line says which checkpoint was read.
        warnings.filterwarnings("ignore", message=".*your dataloader is not resumable.*")
        warnings.filterwarnings("ignore", message=".*The dirpath has changed from.*")
        yield


class _DropAdverts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip:" not in str(record.msg)


def _route_library_logs() -> None:
    """Send library messages through the run's own handlers (console and the run folder's log
    file) once, instead of also through the stream handlers Lightning installs for itself, and
    drop its advertising tips."""
    root = logging.getLogger()
    if not root.handlers:
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "torchmetrics"):
        library_log = logging.getLogger(name)
        for handler in list(library_log.handlers):
            if type(handler) is logging.StreamHandler:
                library_log.removeHandler(handler)
        library_log.propagate = True
    for handler in root.handlers:
        if not any(isinstance(f, _DropAdverts) for f in handler.filters):
            handler.addFilter(_DropAdverts())


def _build_data(spec: RunSpec, run_dir: Path) -> tuple[Any, Any]:
    from hydra.utils import instantiate

    datamodule = _construct("data", lambda: instantiate(spec.data, _convert_="all"))
    datamodule.attach_run(run_dir, spec.run.seed)
    info = datamodule.inspect()
    train_size = info.sizes.get("train", 0)
    if train_size < datamodule.batch_size:
        raise UserError("data.batch_size", f"{datamodule.batch_size} is larger than the training split "
                        f"({train_size} samples); the last partial batch is dropped, so no step would run",
                        f"at most {train_size}")
    return datamodule, info


def _build_model(spec: RunSpec, info: Any) -> Any:
    from hydra.utils import instantiate
    from torch import nn

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
    net = _construct("model", lambda: instantiate(spec.model, _convert_="all", **injected))
    if not isinstance(net, nn.Module):
        raise UserError("model._target_", f"'{spec.model['_target_']}' returned {type(net).__name__}, not an nn.Module",
                        "a class or function that returns a torch.nn.Module")
    return net


def _construct(group: str, build: Any) -> Any:
    """Instantiate a group's `_target_`; its own argument checks become one-line errors."""
    from hydra.errors import InstantiationException

    try:
        return build()
    except UserError:
        raise
    except InstantiationException as ex:
        cause = ex.__cause__ or ex
        if isinstance(cause, UserError):
            raise cause from None
        if isinstance(cause, (TypeError, ValueError)):
            raise UserError(group, f"the {group} constructor rejected its arguments: {cause}") from None
        raise


def _throughput_meter(net: Any, info: Any, plan: Any) -> Any:
    """The meter, told the model's FLOPs per sample (counted before activation checkpointing and
    compile change the module) and the device's peak, where both are known, for MFU."""
    import torch

    from trainer.callbacks.throughput import ThroughputMeter
    from trainer.mfu import peak_flops, training_flops_per_sample
    from trainer.plan import Derived

    flops, how = training_flops_per_sample(net, (info.in_channels, *info.image_size))
    plan.derived["model.flops_per_sample"] = Derived(f"{flops / 1e9:.4g} GFLOP" if flops else None, how)
    if plan.accelerator == "cuda":
        peak, peak_how = peak_flops(torch.cuda.get_device_name(), plan.precision, plan.tf32)
    else:
        peak, peak_how = None, f"no known peak for the {plan.accelerator.upper()}: MFU left out"
    plan.derived["device.peak_flops"] = Derived(f"{peak / 1e12:.1f} TFLOP/s" if peak else None, peak_how)
    return ThroughputMeter(flops_per_sample=flops, peak_flops=peak, mfu_note=peak_how)


def _recipe_lineage(name: str | None, overrides: list[str], resolved: dict[str, Any],
                    search_path: list[str]) -> dict[str, Any] | None:
    """The recipe, its parent, and the keys in which this run differs from the parent's run."""
    from trainer.recipes import lineage

    def compose_plain(parent_overrides: list[str]) -> dict[str, Any]:
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        from trainer.config import to_plain

        if search_path:  # a team's recipes folder: the parent may live there
            parent_overrides = [*parent_overrides, f"hydra.searchpath=[{','.join(search_path)}]"]

        if GlobalHydra.instance().is_initialized():
            cfg = compose(config_name="train", overrides=parent_overrides)
        else:  # called outside a Hydra app (tests, notebooks)
            with initialize_config_dir(config_dir=str(Path(__file__).resolve().parent.parent / "conf"),
                                       version_base="1.3"):
                cfg = compose(config_name="train", overrides=parent_overrides)
        plain = to_plain(cfg)
        plain.pop("hydra", None)
        return plain

    try:
        return lineage(name, overrides, resolved, compose_plain, search_path)
    except Exception as ex:  # noqa: BLE001 - the record is informative; the run must not die of it
        log.warning("could not compare recipe %s with its parent: %s", name, str(ex).splitlines()[0])
        return {"name": name, "error": str(ex).splitlines()[0]}


class _Built(NamedTuple):
    """The Trainer and the callbacks the run reads back from."""

    trainer: Any
    checkpoint: Any
    clipping: Any
    losses: Any
    guard: Any
    stopper: Any
    curves: Any


def _build_trainer(spec: RunSpec, plan: Any, run_dir: Path, meter: Any,
                   logger_ids: dict[str, str] | None = None) -> _Built:
    import lightning as L

    from trainer.callbacks.graceful import GracefulStop
    from trainer.callbacks.loss_record import LossRecord
    from trainer.callbacks.progress import PlainProgress
    from trainer.callbacks.curves import Curves
    from trainer.callbacks.rng import RNGState
    from trainer.checkpoint import SafeCheckpointIO, build_checkpointing, build_periodic
    from trainer.logger import build_loggers

    from hydra.utils import instantiate

    losses = LossRecord()
    stopper = GracefulStop()
    clipping = _construct("clipping", lambda: instantiate(spec.clipping, _convert_="all"))
    guard = _construct("nonfinite", lambda: instantiate(spec.nonfinite, _convert_="all"))
    # The guard goes first: a step it skips has no gradients left for clipping to record.
    curves = Curves()
    # RNGState: the random generators' states go into every checkpoint and come back on resume.
    callbacks: list[Any] = [guard, clipping, meter, losses, curves, stopper, RNGState()]
    periodic = build_periodic(spec.checkpointing, run_dir)
    if periodic is not None:
        callbacks.append(periodic)
    checkpoint = build_checkpointing(spec.checkpointing, run_dir)
    if checkpoint is not None:
        callbacks.append(checkpoint)
    progress = spec.run.progress
    if progress == "auto":
        progress = "rich" if sys.stdout.isatty() else "plain"
    if progress == "rich":
        from lightning.pytorch.callbacks import RichProgressBar

        callbacks.append(RichProgressBar())
    elif progress == "plain":
        callbacks.append(PlainProgress(every_s=spec.run.progress_every_s))
    loggers = build_loggers(spec.loggers, run_dir, logger_ids)
    from trainer.precision import lightning_precision

    trainer_kwargs = dict(spec.trainer)
    trainer_kwargs.update(accelerator=plan.accelerator, **lightning_precision(plan.precision, plan.accelerator,
                                                                               spec.precision))
    # Every checkpoint the Trainer writes or reads goes through SafeCheckpointIO (atomic,
    # weights-only, prefix-free keys) instead of Lightning's TorchCheckpointIO.
    trainer_kwargs["plugins"] = [*trainer_kwargs.get("plugins", []), SafeCheckpointIO()]
    if plan.tf32 and trainer_kwargs.get("benchmark") is None:
        trainer_kwargs["benchmark"] = True  # cuDNN autotuning goes with TF32 (both off when deterministic)
    trainer = L.Trainer(
        **trainer_kwargs,
        logger=loggers if loggers else False,
        callbacks=callbacks,
        enable_checkpointing=checkpoint is not None,
        enable_progress_bar=progress == "rich",
        default_root_dir=str(run_dir),
    )
    return _Built(trainer, checkpoint, clipping, losses, guard, stopper, curves)


def _diagnose(spec: RunSpec, plan: Any, datamodule: Any, task: Any, meter: Any, run_dir: Path) -> None:
    """`diagnose=true`: time the parts of a step on the composed config instead of training."""
    import dataclasses

    import torch

    from trainer.diagnose import diagnose
    from trainer.optimizer import build_optimizer

    steps = spec.run.diagnose_steps
    # The full step runs the real loop and callbacks, only shorter: no validation, checkpoints,
    # loggers or progress output, and just enough steps for the meter's windows.
    short = dataclasses.replace(
        spec, checkpointing=dataclasses.replace(spec.checkpointing, enabled=False), loggers={},
        run=dataclasses.replace(spec.run, progress="off"),
        trainer={**spec.trainer, "max_steps": meter.warmup_steps + 1 + steps, "max_epochs": -1,
                 "limit_val_batches": 0, "num_sanity_val_steps": 0, "limit_train_batches": None})
    trainer = _build_trainer(short, plan, run_dir, meter).trainer
    device = torch.device("cuda", torch.cuda.current_device()) if plan.accelerator == "cuda" else torch.device(
        plan.accelerator)
    task.to(device)
    optimizer = build_optimizer(task.net, spec.optimizer, plan.lr, plan.weight_decay, plan.optimizer_implementation)
    precision_plugin = trainer.precision_plugin

    def full_step() -> float | None:
        with _quiet_library_warnings():
            trainer.fit(task, datamodule=datamodule)
        return meter.summary()["samples_per_s"]

    context = {"accelerator": plan.accelerator, "precision": plan.precision, "tf32": plan.tf32,
               "channels_last": task.channels_last, "compile": plan.derived["compile"].value,
               "optimizer_implementation": plan.optimizer_implementation,
               "num_workers": plan.loader.num_workers, "pin_memory": plan.loader.pin_memory,
               "device_normalize": getattr(datamodule, "device_normalize", True),
               "activation_checkpointing": spec.activation_checkpointing,
               "convolutional": any(isinstance(m, torch.nn.Conv2d) for m in task.modules())}
    from trainer.data.synthetic import SyntheticDataModule

    diagnose(datamodule, task, optimizer, precision_plugin.forward_context, getattr(precision_plugin, "scaler", None),
             device, full_step, context, run_dir, steps=steps, sweep=not isinstance(datamodule, SyntheticDataModule))
    return None


def _describe_clipping(state: dict[str, Any]) -> str:
    mode = state["mode"]
    if mode == "percentile":
        text = f"clip to the {state['percentile']:g}th percentile of the first {state['calibration_steps']} steps' norms"
        if state.get("rolling_window"):
            text += f", then of the last {state['rolling_window']} (AutoClip)"
        return text
    if mode == "fixed_norm":
        return f"clip the global norm to {state['max_norm']:g}"
    if mode == "value":
        return f"clamp each gradient to +-{state['clip_value']:g}"
    return "no clipping"


def _alignment(net: Any, spec: RunSpec, plan: Any) -> list[str]:
    """Layer widths and batch sizes that are not multiples of 8 waste tensor-core tiles: warned on
    CUDA, recorded everywhere."""
    from trainer.alignment import alignment_report, format_report, report_applies

    items = alignment_report(net, int(spec.data["batch_size"]))
    lines = format_report(items, limit=len(items) or 1)
    fixable = [item for item in items if not item.fixed_by_data]
    if report_applies(plan.accelerator) and fixable:
        log.warning("dimensions not multiples of 8 (tensor cores run them padded):")
        for line in format_report(fixable, limit=10):
            log.warning("  %s", line)
    return lines


def _report(summary: dict[str, Any]) -> None:
    metrics = summary["metrics"]
    throughput = summary["throughput"]
    parts = [f"{split}/{name} {value:.4f}" for split in ("val", "test") for name, value in metrics.get(split, {}).items()]
    log.info("done: %s", "  ".join(parts))
    rate = throughput.get("samples_per_s")
    log.info("training throughput %s samples/s (%s; %s)", f"{rate:.0f}" if rate else "n/a",
             throughput["method"], throughput["includes"])
    log.info("wall time %.1f s (fit %.1f s); summary: %s", summary["wall_time_s"], summary["fit_time_s"],
             Path(summary["run_dir"]) / "summary.json")
