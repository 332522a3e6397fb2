"""The one place that wires a run, as named phases, each a function of one job:

    compose    what Hydra composed (`Job`), checked against every group's schema (`validate`)
    identify   the run's name, the checkpoint it resumes from, run.json; a run asked to resume that
               has already completed says so and ends here
    build      data module, network and callbacks from the config (trainer/build.py)
    resolve    the `Plan`: every derived setting with its derivation (trainer/plan.py)
    prepare    the plan applied to the network, printed, and the run's environment recorded
    diagnose   with diagnose=true: time the parts of a step instead of training (trainer/diagnose.py)
    fit, test  the Lightning Trainer built from the plan; summary.json says which phase the run is in
    record     summary.json, also for a run that fails or is interrupted (trainer/summary.py)
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from trainer import attempts
from trainer.alignment import check_alignment
from trainer.atomic import write_text_atomic
from trainer.build import Built, Parts, build_parts, build_task, build_trainer, device_of
from trainer.callbacks.graceful import SignalLatch, StoppedBySignal
from trainer.signals import is_preemption
from trainer.callbacks.throughput import ThroughputMeter
from trainer.config import RunSpec, validate
from trainer.data.synthetic import SyntheticDataModule
from trainer.devices import count_devices, resolve_accelerator
from trainer.diagnose import diagnose
from trainer.distributed import LaunchRefused, check_launch, is_rank_zero, launched_by, process_count
from trainer.errors import UserError, exception_line, exit_with, full_error_requested
from trainer.failures import check_trial, ending_for, in_multirun, job_failed, objective_value, was_interrupted
from trainer.fingerprint import fingerprint
from trainer.library_logs import quiet_library_warnings, route_library_logs
from trainer.logger import finish_loggers, logger_ids, run_labels
from trainer.models.layers import count_parameters
from trainer.data.base import AUTO_BATCH_START
from trainer.memory import (MemoryPlan, autocast_for, largest_batch_that_runs, largest_batch_within, plan_memory,
                            plot_plan)
from trainer.optimizer import build_optimizer
from trainer.plan import Derived, Plan, resolve
from trainer.precision import compute_dtype
from trainer.profile import StepProfiler, machine_roof, write_report
from trainer.recipes import lineage_record
from trainer.resume import (STOP_KEYS, Checkpoint, Completed, check_fits, completed_run, default_name, identity_of,
                            read_resumable, requested, resolve_resume, write_identity)
from trainer.summary import (RunRecord, log_result, optimizer_param_groups, peak_memory, reset_peak_memory,
                             split_metrics, write_json_atomic)
from trainer.task import ClassificationTask, classification_loss

log = logging.getLogger("trainer")


@dataclass(frozen=True)
class Job:
    """What Hydra composed for this job, and where it runs."""

    cfg: DictConfig
    run_dir: Path
    choices: dict[str, str]
    overrides: list[str]
    multirun: bool = False
    launcher: str = ""
    search_path: tuple[str, ...] = ()

    @classmethod
    def from_hydra(cls, cfg: DictConfig, run_dir: Path | None = None, choices: dict[str, str] | None = None,
                   overrides: list[str] | None = None) -> Job:
        """The current Hydra job; `run_dir`, `choices` and `overrides` given outside a Hydra app."""
        if run_dir is not None and choices is not None:
            return cls(cfg, run_dir, dict(choices), list(overrides or []))
        hydra = HydraConfig.get()
        made = {k: str(v) for k, v in hydra.runtime.choices.items() if not k.startswith("hydra") and v is not None}
        return cls(cfg, run_dir or Path(hydra.runtime.output_dir), dict(choices) if choices is not None else made,
                   list(overrides) if overrides is not None else list(hydra.overrides.task),
                   hydra.mode == RunMode.MULTIRUN, str(hydra.launcher.get("_target_", "")),
                   tuple(str(entry) for entry in hydra.searchpath or []))


class Identity(NamedTuple):
    name: str
    resume_from: Checkpoint | None
    logger_ids: dict[str, str]
    #: The run's attempts before this one (a requeued or resumed run), and this one's record.
    earlier_attempts: list[dict[str, Any]]
    attempt: dict[str, Any]


class Fitted(NamedTuple):
    fit_seconds: float
    metrics: dict[str, dict[str, float]]
    use_best: bool
    peak_memory: dict[str, Any]
    #: The callbacks' records at the end of training, taken before testing the best checkpoint
    #: restores their states as they were when it was written.
    training_records: dict[str, Any]
    #: The checkpoint holding training's final state (None when none does: checkpointing off).
    final_checkpoint: str | None


def run(cfg: DictConfig, run_dir: Path | None = None, group_choices: dict[str, str] | None = None,
        overrides: list[str] | None = None) -> float | None:
    """Train and test as `cfg` says; return the metric named by `objective` (the sweep objective,
    val/acc by default).

    `run_dir`, `group_choices` and `overrides` default to Hydra's for the current job. A mistake in
    the input ends the process with one line and exit code 2 (a traceback with HYDRA_FULL_ERROR=1).
    In a multirun, a job that fails reports to the sweeper instead, so the sweep goes on
    (`trainer.failures.job_failed`).
    """
    try:
        objective = _run(Job.from_hydra(cfg, run_dir, group_choices, overrides))
    except UserError as ex:
        if full_error_requested():
            raise
        if in_multirun() and not isinstance(ex, LaunchRefused):
            return job_failed(ex.line(), None)
        # Exiting here, not raising: Hydra would print its own "Error executing job" line first.
        exit_with(ex.line())
    except Exception as ex:  # noqa: BLE001 - only inside a multirun, see job_failed
        if not in_multirun() or full_error_requested():
            raise
        return job_failed(exception_line(ex), ex)
    check_trial(objective)
    return objective


def _run(job: Job) -> float | None:
    # From here on a stop signal (a scheduler's preemption, SIGTERM, Ctrl-C) is recorded and acted
    # on at the next step boundary (trainer/callbacks/graceful.py).
    latch = SignalLatch()
    latch.install()
    try:
        return _run_phases(job, latch)
    finally:
        latch.uninstall()


def _run_phases(job: Job, latch: SignalLatch) -> float | None:
    started = time.perf_counter()
    spec = validate(job.cfg, job.choices)
    rank_zero = _check_launch(spec, job)
    name = spec.identity.name or default_name(job.choices, job.overrides)
    resume = requested(spec.run.resume)
    if not (spec.run.diagnose or spec.run.profile):
        done = completed_run(resume, name, Path(spec.identity.root), job.run_dir,
                             {key: spec.trainer.get(key) for key in STOP_KEYS})
        if done is not None:
            return _already_completed(done, name, spec, job, rank_zero)
    identity = _identify(spec, job, rank_zero, name, resume)
    route_library_logs()
    L.seed_everything(spec.run.seed, workers=True, verbose=False)
    parts = build_parts(spec, job.run_dir)
    if parts.datamodule.batch_size_auto:
        spec.data["batch_size"] = parts.datamodule.batch_size  # the finder's starting batch, for a first plan
    plan = resolve(spec, parts.datamodule, parts.info, parts.net, parts.clipping)
    if parts.datamodule.batch_size_auto:
        found = _size_batch(spec, plan, parts, job.run_dir, rank_zero)
        parts.datamodule.set_batch_size(found.value)
        spec.data["batch_size"] = found.value
        plan = resolve(spec, parts.datamodule, parts.info, parts.net, parts.clipping, batch_size=found)
    alignment = check_alignment(parts.net, int(spec.data["batch_size"]), plan.accelerator)
    parameters = count_parameters(parts.net)
    memory = _plan_memory(spec, plan, parts, job.run_dir, rank_zero) if spec.run.memory_plan else None
    task = build_task(spec, plan, parts)
    if identity.resume_from is not None:
        check_fits(identity.resume_from, task.state_dict())
    environment = _announce(spec, plan, job, identity, rank_zero)
    for line in memory.lines() if memory is not None else []:
        log.info(line)
    if spec.run.diagnose:
        return _diagnose(spec, plan, parts, task, job.run_dir)
    if spec.run.profile:
        return _profile(spec, plan, parts, task, job.run_dir, identity.name)
    # wandb's name, group and tags: the run's name; the sweep folder (conf/train.yaml's
    # hydra.sweep.subdir puts each job one level below it); the recipe and group choices.
    labels = run_labels(identity.name, job.choices, job.run_dir.parent if job.multirun else None, spec.identity.root)
    built = build_trainer(spec, plan, job.run_dir, parts, identity.logger_ids, latch=latch, labels=labels)
    record = RunRecord(job.run_dir / "summary.json", writes=rank_zero, fields=_what_ran(
        job, spec, plan, identity, parts, built, {"parameters": parameters, "alignment": alignment}, environment))
    if memory is not None:
        record.fields["memory_plan"] = memory.to_dict()
    record.begin()
    try:
        fitted = _fit(built, task, parts, identity.resume_from, device_of(plan))
        record.enter("testing", **_training_fields(built, fitted, identity))
        fitted = _test(built, task, parts, fitted)
    except BaseException as ex:
        ending = _record_failure(ex, spec, built, parts, record, started, identity)
        if ending is None:
            raise
        raise ending from None
    record.enter("recording")
    summary = _record_completion(spec, built, parts, fitted, record, started, identity)
    return objective_value(summary["metrics"], spec.run.objective)


def _check_launch(spec: RunSpec, job: Job) -> bool:
    """Refuse what cannot run as one job before anything starts; whether this process writes the
    run's records (rank 0 of several processes)."""
    accelerator = resolve_accelerator(str(spec.trainer.get("accelerator", "auto")))[0]
    processes = process_count(spec.trainer, count_devices(spec.trainer.get("devices", 1), accelerator))
    check_launch(processes, job.multirun, job.launcher, spec.run.diagnose or spec.run.profile,
                 spec.trainer.get("strategy", "auto"), accelerator,
                 measuring="profile" if spec.run.profile else "diagnose")
    if spec.run.ladder and not job.multirun:
        raise UserError("ladder", f"'{spec.run.ladder}' is a sequence of runs and needs Hydra's multirun",
                        f"python train.py -m +ladder={spec.run.ladder}")
    rank_zero = is_rank_zero()
    if not rank_zero:  # the other ranks train and say only what goes wrong
        log.setLevel(logging.WARNING)
    return rank_zero


def _already_completed(done: Completed, name: str, spec: RunSpec, job: Job, rank_zero: bool) -> float:
    """A run asked to resume that has already completed: one line, nothing trained or written in
    its folder, and its objective for a sweeper. In a multirun the job's folder gets the run's
    summary, unchanged, for the sweep's comparison table."""
    tested = (done.summary.get("metrics") or {}).get("test") or {}
    reached = "  ".join(f"test/{k} {v:.4f}" for k, v in tested.items() if isinstance(v, (int, float)))
    log.info("run '%s' already completed in %s (%s): nothing to do", name, done.folder,
             reached or f"{done.summary.get('steps')} steps")
    if job.multirun and rank_zero and job.run_dir.resolve() != done.folder.resolve():
        write_json_atomic(job.run_dir / "summary.json", done.summary)
    return objective_value(done.summary.get("metrics") or {}, spec.run.objective)


def _identify(spec: RunSpec, job: Job, rank_zero: bool, name: str, resume: str | None) -> Identity:
    """The run's checkpoint to carry on from, and its loggers' run ids (a wandb run continues under
    the id of the run resumed from); run.json records them with the run's stable name."""
    resume_from = resolve_resume(resume, name, Path(spec.identity.root), job.run_dir)
    ids = logger_ids(spec.loggers, identity_of(resume_from.path).get("logger_ids") if resume_from else None)
    resumed_step = resume_from.global_step if resume_from else None
    earlier = attempts.earlier_attempts(resume_from.path if resume_from else None, resumed_step)
    if rank_zero:
        write_identity(job.run_dir, name, str(resume_from.path) if resume_from else None, ids)
    return Identity(name, resume_from, ids, earlier, attempts.this_attempt(len(earlier) + 1, resumed_step))


def _announce(spec: RunSpec, plan: Plan, job: Job, identity: Identity, rank_zero: bool) -> dict[str, Any]:
    """Print the run, what it resumes from and the plan; write env.json and config_resolved.yaml."""
    log.info("run %s, folder %s", identity.name, job.run_dir)
    if identity.resume_from is not None:
        source = identity.resume_from
        log.info("resuming from %s (step %d, epoch %d%s)", source.path, source.global_step, source.epoch,
                 ", mid-epoch" if source.mid_epoch else "")
    for line in plan.lines():
        log.info("  %s", line)
    environment = fingerprint()
    if rank_zero:
        write_json_atomic(job.run_dir / "env.json", environment)
        # Hydra's .hydra/config.yaml keeps interpolations as written; this is what the run used.
        write_text_atomic(job.run_dir / "config_resolved.yaml", OmegaConf.to_yaml(spec.resolved))
    return environment


def _measuring(spec: RunSpec, steps: int) -> RunSpec:
    """The run's spec for a measurement of `steps` training steps: the real loop and callbacks, no
    validation, checkpoints, loggers or progress output."""
    return dataclasses.replace(
        spec, checkpointing=dataclasses.replace(spec.checkpointing, enabled=False), loggers={},
        run=dataclasses.replace(spec.run, progress="off"),
        trainer={**spec.trainer, "max_steps": steps, "max_epochs": -1, "limit_val_batches": 0,
                 "num_sanity_val_steps": 0, "limit_train_batches": None})


def _diagnose(spec: RunSpec, plan: Plan, parts: Parts, task: ClassificationTask, run_dir: Path) -> None:
    """`diagnose=true`: time the parts of a step on the composed config instead of training. The
    full step runs the real loop and callbacks, only shorter: no validation, checkpoints, loggers or
    progress output, and just enough steps for the throughput meter's windows."""
    steps = spec.run.diagnose_steps
    built = build_trainer(_measuring(spec, ThroughputMeter.WARMUP_STEPS + 1 + steps), plan, run_dir, parts)
    device = device_of(plan)
    task.to(device)
    optimizer = build_optimizer(task.net, spec.optimizer, plan.lr, plan.weight_decay, plan.optimizer_implementation)

    def full_step() -> tuple[float | None, list[float]]:
        with quiet_library_warnings():
            built.trainer.fit(task, datamodule=parts.datamodule)
        return built.meter.summary()["samples_per_s"], list(built.meter.window_rates)

    context = {"accelerator": plan.accelerator, "precision": plan.precision, "tf32": plan.tf32,
               "channels_last": plan.channels_last, "compile": plan.compile_mode,
               "optimizer_implementation": plan.optimizer_implementation,
               "num_workers": plan.loader.num_workers, "pin_memory": plan.loader.pin_memory,
               "device_normalize": getattr(parts.datamodule, "device_normalize", True),
               "decode": plan.derived["data.decode"].value,
               "activation_checkpointing": list(plan.checkpointed_stages),
               "convolutional": any(isinstance(m, torch.nn.Conv2d) for m in task.modules())}
    precision = built.trainer.precision_plugin
    diagnose(parts.datamodule, task, optimizer, precision.forward_context, getattr(precision, "scaler", None),
             device, full_step, context, run_dir, steps=steps,
             sweep=not isinstance(parts.datamodule, SyntheticDataModule))
    return None


class _MemoryInputs(NamedTuple):
    device: torch.device
    make_batch: Any
    optimizer_for: Any


def _memory_inputs(spec: RunSpec, plan: Plan, parts: Parts) -> _MemoryInputs:
    """What the memory measurements run: random batches of the data's shape on the run's device (in
    its memory format) and the run's optimizer; the loss is the task's (`classification_loss`)."""
    device = device_of(plan)
    info = parts.info
    memory_format = torch.channels_last if plan.channels_last else torch.contiguous_format

    def make_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randn(size, info.in_channels, *info.image_size, device=device)
        labels = torch.randint(0, info.num_classes, (size,), device=device)
        return images.contiguous(memory_format=memory_format), labels

    def optimizer_for(implementation: str) -> Any:
        return lambda net: build_optimizer(net, spec.optimizer, plan.lr, plan.weight_decay, implementation)

    return _MemoryInputs(device, make_batch, optimizer_for)


def _plan_memory(spec: RunSpec, plan: Plan, parts: Parts, run_dir: Path, rank_zero: bool) -> MemoryPlan:
    """`memory_plan=true`: where a step's memory goes at the run's batch, measured on a copy of the
    network before it is compiled or checkpointed (trainer/memory.py); drawn, and kept for the
    start-up lines and summary.json."""
    inputs = _memory_inputs(spec, plan, parts)
    device = inputs.device
    half = autocast_for("bf16-mixed", device) if compute_dtype(plan.precision) == torch.float32 else None
    memory = plan_memory(parts.net, inputs.optimizer_for(plan.optimizer_implementation), inputs.make_batch,
                         classification_loss, autocast_for(plan.precision, device), device,
                         int(spec.data["batch_size"]), half_context=half,
                         make_fused=None if plan.optimizer_implementation == "fused" else inputs.optimizer_for("fused"))
    if plan.checkpointed_stages:
        memory.notes.append(f"measured without the configured checkpointing of {', '.join(plan.checkpointed_stages)}")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if rank_zero:
        plot_plan(memory, run_dir / "memory_plan.png", f"{spec.model['_target_'].rsplit('.', 1)[-1]}, "
                                                       f"{plan.precision}, {plan.optimizer_implementation} optimizer")
    return memory


#: data.batch_size=auto: rank 0 writes what it found here; the other ranks read it, so every rank
#: trains with the same batch (each rank measuring its own device could differ on CUDA).
AUTO_BATCH_FILE = "batch_size_auto.json"


def _size_batch(spec: RunSpec, plan: Plan, parts: Parts, run_dir: Path, rank_zero: bool) -> Derived:
    """data.batch_size=auto: the largest per-device batch, a multiple of 8, that fits (on CUDA, real
    steps until out of memory; on a CPU, data.memory_budget_gb against the measured memory plan)."""
    record = run_dir / AUTO_BATCH_FILE
    if not rank_zero:
        return _batch_of_rank_zero(record)
    inputs = _memory_inputs(spec, plan, parts)
    datamodule = parts.datamodule
    budget = datamodule.memory_budget_gb
    limit = max(AUTO_BATCH_START, parts.info.sizes.get("train", 0) // max(1, plan.devices))
    context = autocast_for(plan.precision, inputs.device)
    optimizer = inputs.optimizer_for(plan.optimizer_implementation)
    try:
        if inputs.device.type == "cuda":
            batch, how = largest_batch_that_runs(parts.net, optimizer, inputs.make_batch, classification_loss,
                                                 context, inputs.device, AUTO_BATCH_START, limit)
        elif budget is None:
            raise UserError("data.memory_budget_gb", "missing: data.batch_size=auto on a CPU sizes the batch to a "
                            "memory budget", "the GiB one training step may use, e.g. data.memory_budget_gb=4")
        if budget is not None:
            memory = plan_memory(parts.net, optimizer, inputs.make_batch, classification_loss, context, inputs.device,
                                 AUTO_BATCH_START, measure_peak=False, with_practices=False)
            within, within_how = largest_batch_within(memory, budget * 2**30, AUTO_BATCH_START, limit)
            if inputs.device.type != "cuda" or within < batch:
                batch, how = within, within_how
    except ValueError as ex:
        raise UserError("data.batch_size", f"auto: not even {AUTO_BATCH_START} samples fit: {ex}",
                        "a larger data.memory_budget_gb, a smaller model or image size, or a fixed batch_size"
                        ) from None
    write_json_atomic(record, {"batch_size": batch, "how": how})
    return Derived(batch, how)


def _batch_of_rank_zero(record: Path, timeout_s: float = 600.0) -> Derived:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            found = json.loads(record.read_text())
            return Derived(int(found["batch_size"]), f"{found['how']} (rank 0's)")
        except (OSError, ValueError, KeyError):
            time.sleep(0.2)
    raise UserError("data.batch_size", f"auto: rank 0 wrote no {record} within {timeout_s:.0f} s",
                    "a fixed data.batch_size, or check rank 0's log")


def _profile(spec: RunSpec, plan: Plan, parts: Parts, task: ClassificationTask, run_dir: Path, name: str) -> None:
    """`profile=true`: a few steps of the real loop under torch.profiler instead of training
    (trainer/profile.py); like the diagnosis, no validation, checkpoints, loggers or progress output."""
    steps = spec.run.profile_steps
    device = device_of(plan)
    folder = run_dir / "profile"
    folder.mkdir(parents=True, exist_ok=True)
    profiler = StepProfiler(folder, steps, on_device=device.type == "cuda")
    built = build_trainer(_measuring(spec, profiler.total + 1), plan, run_dir, parts, extra_callbacks=[profiler])
    with quiet_library_warnings():
        built.trainer.fit(task, datamodule=parts.datamodule)
    if profiler.events is None:
        raise UserError("profile_steps", f"the run ended before {profiler.total} training steps were recorded",
                        "a data set with more batches per epoch, or fewer profile_steps")
    dtype = compute_dtype(plan.precision)
    roof = machine_roof(device, plan.precision, plan.tf32, torch.float32 if dtype == torch.float32 else torch.bfloat16)
    record = write_report(profiler.events, folder, device.type == "cuda", dtype.itemsize, roof,
                          f"{name} on {plan.accelerator}, batch {spec.data['batch_size']}, {plan.precision}")
    top = ", ".join(f"{c['category']} {c['share']:.0%}" for c in record["categories"][:4])
    log.info("profile: %.2f ms per step over %d steps; %s; memory-bound operators %.0f%% of the step",
             record["step_ms"], record["steps"], top, 100 * record["memory_bound_share"])
    for flag in record["unusual"]:
        log.info("profile: unusual: %s", flag)
    log.info("profile written: %s (ops.md, profile.json, roofline.png, the trace for Perfetto or TensorBoard)", folder)
    return None


def _what_ran(job: Job, spec: RunSpec, plan: Plan, identity: Identity, parts: Parts, built: Built,
              model: dict[str, Any], environment: dict[str, Any]) -> dict[str, Any]:
    """summary.json's fields known before training: the command, choices, recipe, plan and setup."""
    trainer, info, resumed = built.trainer, parts.info, identity.resume_from
    return {
        "run_name": identity.name,
        "run_dir": str(job.run_dir),
        **attempts.totals([*identity.earlier_attempts, identity.attempt]),
        "resumed_from": ({"path": str(resumed.path), "global_step": resumed.global_step, "epoch": resumed.epoch,
                          "mid_epoch": resumed.mid_epoch} if resumed else None),
        "command": " ".join([Path(sys.argv[0]).name, *job.overrides]),
        "overrides": job.overrides,
        "choices": dict(job.choices),
        "recipe": lineage_record(job.choices.get("recipe"), job.overrides, spec.resolved, job.search_path),
        "ladder": spec.run.ladder,
        "seed": spec.run.seed,
        "derived": plan.to_dict(),
        "hyperparameters": {
            "batch_size": spec.data["batch_size"], "global_batch_size": plan.global_batch_size,
            "optimizer": spec.optimizer.name, "lr": plan.lr, "weight_decay": plan.weight_decay,
            "scheduler": spec.scheduler.name, "precision": plan.precision,
            "max_epochs": trainer.max_epochs, "max_steps": trainer.max_steps},
        "data": {"target": spec.data["_target_"], "num_classes": info.num_classes, "in_channels": info.in_channels,
                 "image_size": list(info.image_size), "sizes": info.sizes, "notes": info.notes},
        "model": {"target": spec.model["_target_"], **model, "activation_checkpointing": spec.activation_checkpointing},
        "device": {"accelerator": plan.accelerator, "devices": plan.devices,
                   "name": environment["gpus"][0] if plan.accelerator == "cuda" else environment["cpu"]},
        "processes": {"count": trainer.world_size, "strategy": type(trainer.strategy).__name__,
                      "launched_by": launched_by() or ("lightning" if trainer.world_size > 1 else None)},
    }


def _fit(built: Built, task: ClassificationTask, parts: Parts, resume_from: Checkpoint | None,
         memory_device: torch.device) -> Fitted:
    """Fit, from the checkpoint resumed from if any; a signal stop or an interruption raises. A run
    resumed after its training had ended fits nothing: what its training reached comes from that
    checkpoint (trainer/callbacks/logged_metrics.py)."""
    trainer = built.trainer
    # The jobs of a multirun share this process: collect the previous job's reference cycles
    # (trainer <-> module) before counting this run's peak, or its model would still be resident.
    gc.collect()
    peak_reset = reset_peak_memory(memory_device)
    with quiet_library_warnings():
        started = time.perf_counter()
        trainer.fit(task, datamodule=parts.datamodule, ckpt_path=str(resume_from.path) if resume_from else None,
                    weights_only=True)
        fit_seconds = time.perf_counter() - started
    if trainer.interrupted:
        raise KeyboardInterrupt
    records = {"throughput": built.meter.summary(), "loss": built.losses.summary(),
               "clipping": parts.clipping.summary(), "nonfinite": parts.guard.summary()}
    if built.target is not None:
        records["target"] = built.target.summary()
        log.info(built.target.line())
    use_best = built.checkpoint is not None and bool(built.checkpoint.best_model_path)
    final = _final_checkpoint(built, resume_from)
    # From here a stop signal ends the test early, as the final state is kept (GracefulStop).
    built.stopper.final_checkpoint = final
    return Fitted(fit_seconds, split_metrics(built.logged.final(trainer)), use_best,
                  peak_memory(memory_device, peak_reset), records, final)


def _final_checkpoint(built: Built, resume_from: Checkpoint | None) -> str | None:
    """The checkpoint that holds training's final state: the last one written, or (a run resumed
    after its training had ended) the one it resumed from."""
    step = int(built.trainer.global_step)
    last = built.checkpoint.last_model_path if built.checkpoint is not None else ""
    for path in [p for p in (last, resume_from.path if resume_from else None) if p]:
        try:
            if read_resumable(Path(path)).global_step == step:
                return str(path)
        except UserError:
            continue
    return None


def _training_fields(built: Built, fitted: Fitted, identity: Identity) -> dict[str, Any]:
    """What the fit reached, written into summary.json as the test starts (with the steps this
    attempt reached: an attempt killed from here on has lost none)."""
    steps = built.trainer.global_step
    return {"metrics": fitted.metrics, **fitted.training_records, "steps": steps,
            "epochs": built.trainer.current_epoch, "fit_time_s": fitted.fit_seconds,
            "final_checkpoint": fitted.final_checkpoint,
            **attempts.totals([*identity.earlier_attempts, {**identity.attempt, "steps": steps}])}


def _test(built: Built, task: ClassificationTask, parts: Parts, fitted: Fitted) -> Fitted:
    """Test the best checkpoint (or the final weights without checkpointing)."""
    with quiet_library_warnings():
        tested = built.trainer.test(task, datamodule=parts.datamodule, ckpt_path="best" if fitted.use_best else None,
                                    verbose=False, weights_only=True)
    return fitted._replace(metrics={**fitted.metrics, **split_metrics(tested[0] if tested else {})})


def _record_failure(ex: BaseException, spec: RunSpec, built: Built, parts: Parts, record: RunRecord,
                    started: float, identity: Identity) -> BaseException | None:
    """summary.json of a run that failed, was preempted or was interrupted (Lightning ends a
    SIGTERM'd fit with its own SIGTERMException: the checkpoint was written by GracefulStop at the
    end of that step, so the run stopped cleanly); the exception to end with, or None to re-raise."""
    ex = built.stopper.outcome() or ex
    status = _ending_status(ex)
    steps = built.trainer.global_step
    signum = ex.signum if isinstance(ex, StoppedBySignal) else None
    _wrap_up(built, parts, record, identity.name, failed=True)
    record.end(status, error=exception_line(ex), nonfinite=parts.guard.summary(),
               wall_time_s=time.perf_counter() - started, steps=steps,
               **attempts.totals([*identity.earlier_attempts,
                                  attempts.ended(identity.attempt, status, steps, signum, record.working)]))
    last = built.checkpoint.last_model_path if built.checkpoint is not None else None
    return ending_for(ex, spec, last)


def _ending_status(ex: BaseException) -> str:
    """preempted (a scheduler's signal: the job may come back), interrupted (a person), or failed."""
    if isinstance(ex, SIGTERMException) or (isinstance(ex, StoppedBySignal) and is_preemption(ex.signum)):
        return "preempted"
    return "interrupted" if was_interrupted(ex) else "failed"


def _record_completion(spec: RunSpec, built: Built, parts: Parts, fitted: Fitted, record: RunRecord,
                       started: float, identity: Identity) -> dict[str, Any]:
    """summary.json of a completed run: metrics, which weights were tested, cost; printed. A failure
    while recording is recorded as that, in one line: the checkpoints already written stay valid,
    and the run's next start (resume=if_any) tests and records it again."""
    try:
        summary = _write_completion(spec, built, parts, fitted, record, started, identity)
    except Exception as ex:  # noqa: BLE001 - recorded and reported as one line, see the docstring
        if full_error_requested():
            raise
        problem = f"recording the completed run failed ({exception_line(ex, 300)})"
        steps = built.trainer.global_step
        try:
            record.end("failed", error=problem, **attempts.totals(
                [*identity.earlier_attempts, attempts.ended(identity.attempt, "failed", steps, stopped_in="recording")]))
        except Exception:  # noqa: BLE001 - the summary cannot be written either: the line says it all
            pass
        raise UserError(str(record.path), problem,
                        "the same command with resume=if_any, which tests and records the run again from its "
                        f"final checkpoint ({fitted.final_checkpoint or 'none was written'})") from None
    if record.writes:
        try:
            log_result(summary)
        except Exception as ex:  # noqa: BLE001 - the summary is written; only its printout failed
            log.warning("could not print the result (%s); it is in %s", exception_line(ex), record.path)
    return summary


def _tested_weights(spec: RunSpec, built: Built, fitted: Fitted) -> str:
    checkpoint, monitor = built.checkpoint, spec.checkpointing.monitor
    if not (fitted.use_best and checkpoint):
        return "weights at the end of training"
    score = checkpoint.best_model_score
    shown = f", {monitor}={float(score):.4f}" if score is not None else ""
    return f"best checkpoint by {monitor} ({Path(checkpoint.best_model_path).name}{shown})"


def _write_completion(spec: RunSpec, built: Built, parts: Parts, fitted: Fitted, record: RunRecord,
                      started: float, identity: Identity) -> dict[str, Any]:
    trainer, checkpoint = built.trainer, built.checkpoint
    _wrap_up(built, parts, record, identity.name, failed=False)
    summary = record.end(
        "completed", metrics=fitted.metrics, tested_weights=_tested_weights(spec, built, fitted),
        best_checkpoint=checkpoint.best_model_path if fitted.use_best and checkpoint else None,
        final_checkpoint=fitted.final_checkpoint,
        optimizer_param_groups=optimizer_param_groups(trainer.optimizers), **fitted.training_records,
        peak_memory=fitted.peak_memory, steps=trainer.global_step, epochs=trainer.current_epoch,
        fit_time_s=fitted.fit_seconds, wall_time_s=time.perf_counter() - started,
        **attempts.totals([*identity.earlier_attempts, attempts.ended(identity.attempt, "completed", trainer.global_step)]))
    return summary


def _wrap_up(built: Built, parts: Parts, record: RunRecord, name: str, failed: bool) -> None:
    """What every ending does before its summary is written: the loggers' runs finished,
    curves.png drawn (as far as training got), and the files the data module found unreadable
    (image folders: by the scan and while loading) noted."""
    finish_loggers(list(built.trainer.loggers), failed=failed)
    if record.writes:
        built.curves.try_write_png(record.path.parent / "curves.png", title=name)
    report = getattr(parts.datamodule, "bad_files_summary", None)
    if report is not None:
        record.fields["data"]["bad_files"] = report()
