"""The one place that wires a run, as named phases (trainer/phases/), each a function of one job:

    compose    what Hydra composed (`Job`, phases/compose.py), checked against every group's schema
               (`trainer.configuration.spec.validate`)
    identify   refuse a job that cannot run; the run's name, the checkpoint it resumes from, run.json;
               a run asked to resume that has already completed says so and ends here (phases/identify.py)
    build      data module, network and callbacks from the config (phases/build.py)
    resolve    the `Plan`: every derived setting with its derivation (phases/plan.py)
    prepare    the plan applied to the network (phases/build.py), printed, and the run's environment
               recorded (phases/prepare.py)
    fit, test  the Lightning Trainer built from the plan (phases/fit.py); summary.json says which phase
               the run is in
    record     summary.json, also for a run that fails or is interrupted (phases/record.py)

Instead of fit and test, a measurement mode (trainer/modes/) may run, each entered by one call:

    batch finder   data.batch_size=auto, between build and the final resolve
    lr finder      optimizer.lr=find: Lightning's lr range test, after the batch finder, before the final resolve
    memory plan    memory_plan=true, before prepare (and then training goes on)
    diagnosis      diagnose=true: time the parts of a step instead of training
    profile        profile=true: a few steps under torch.profiler instead of training
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import lightning as L
from omegaconf import DictConfig

from trainer.measure.alignment import check_alignment
from trainer.callbacks.graceful import SignalLatch
from trainer.configuration.spec import LR_FIND, validate
from trainer.infra.distributed import LaunchRefused
from trainer.infra.errors import UserError, exception_line, exit_with, full_error_requested
from trainer.groups.sweeps import check_trial, in_multirun, job_failed, objective_value
from trainer.infra.library_logs import route_library_logs
from trainer.groups.logger import run_labels
from trainer.models.layers import count_parameters
from trainer.modes.batch_finder import find_batch_size
from trainer.modes.diagnosis import run_diagnosis
from trainer.modes.lr_finder import find_lr
from trainer.modes.memory_plan import measure_memory_plan
from trainer.modes.profiling import run_profile
from trainer.phases.build import apply_to_data, build_parts, build_task, build_trainer, device_of
from trainer.phases.compose import Job
from trainer.phases.fit import fit, test_after_fit, training_fields
from trainer.phases.identify import already_completed, check_job, identify
from trainer.phases.plan import resolve
from trainer.phases.prepare import announce
from trainer.phases.record import record_completion, record_failure, what_ran
from trainer.infra.resume import STOP_KEYS, check_fits, completed_run, default_name, requested
from trainer.infra.summary import RunRecord

log = logging.getLogger("trainer")


def run(cfg: DictConfig, run_dir: Path | None = None, group_choices: dict[str, str] | None = None,
        overrides: list[str] | None = None) -> float | None:
    """Train and test as `cfg` says; return the metric named by `objective` (the sweep objective,
    val/acc by default).

    `run_dir`, `group_choices` and `overrides` default to Hydra's for the current job. A mistake in
    the input ends the process with one line and exit code 2 (a traceback with HYDRA_FULL_ERROR=1).
    In a multirun, a job that fails reports to the sweeper instead, so the sweep goes on
    (`trainer.groups.sweeps.job_failed`).
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
    rank_zero = check_job(spec, job)
    name = spec.identity.name or default_name(job.choices, job.overrides)
    resume = requested(spec.top.resume)
    if not (spec.top.diagnose or spec.top.profile):
        done = completed_run(resume, name, Path(spec.identity.root), job.run_dir,
                             {key: spec.trainer.get(key) for key in STOP_KEYS})
        if done is not None:
            return already_completed(done, name, spec, job, rank_zero)
    identity = identify(spec, job, rank_zero, name, resume)
    route_library_logs()
    L.seed_everything(spec.top.seed, workers=True, verbose=False)
    parts = build_parts(spec, job.run_dir)
    found = None
    if parts.datamodule.batch_size_auto:
        found = find_batch_size(spec, parts, job.run_dir, rank_zero)
        parts.datamodule.set_batch_size(found.value)
        spec = dataclasses.replace(spec, data={**spec.data, "batch_size": found.value})
    resumed_from = identity.resume_from.path if identity.resume_from is not None else None
    found_lr = find_lr(spec, parts, job.run_dir, rank_zero, resumed_from) if spec.optimizer.lr == LR_FIND else None
    plan = resolve(spec, parts.datamodule, parts.info, parts.net, parts.clipping, batch_size=found, lr=found_lr)
    apply_to_data(plan, parts.datamodule)
    alignment = check_alignment(parts.net, int(spec.data["batch_size"]), plan.accelerator)
    parameters = count_parameters(parts.net)
    memory = measure_memory_plan(spec, plan, parts, job.run_dir, rank_zero) if spec.top.memory_plan else None
    task = build_task(spec, plan, parts)
    if identity.resume_from is not None:
        check_fits(identity.resume_from, task.state_dict())
    environment = announce(spec, plan, job, identity, rank_zero)
    for line in memory.lines() if memory is not None else []:
        log.info(line)
    if spec.top.diagnose:  # a measurement, not a training run: no objective
        run_diagnosis(spec, plan, parts, task, job.run_dir)
        return None
    if spec.top.profile:
        run_profile(spec, plan, parts, task, job.run_dir, identity.name)
        return None
    # wandb's name, group and tags: the run's name; the sweep folder (conf/train.yaml's
    # hydra.sweep.subdir puts each job one level below it); the recipe and group choices.
    labels = run_labels(identity.name, job.choices, job.run_dir.parent if job.multirun else None, spec.identity.root)
    built = build_trainer(spec, plan, job.run_dir, parts, identity.logger_ids, latch=latch, labels=labels)
    record = RunRecord(job.run_dir / "summary.json", writes=rank_zero, fields=what_ran(
        job, spec, plan, identity, parts, built, {"parameters": parameters, "alignment": alignment}, environment))
    if memory is not None:
        record.fields["memory_plan"] = memory.to_dict()
    record.begin()
    try:
        fitted = fit(built, task, parts, identity.resume_from, device_of(plan))
        record.enter("testing", **training_fields(built, fitted, identity))
        fitted = test_after_fit(built, task, parts, fitted)
    except BaseException as ex:
        ending = record_failure(ex, spec, built, parts, record, started, identity)
        if ending is None:
            raise
        raise ending from None
    record.enter("recording")
    summary = record_completion(spec, built, parts, fitted, record, started, identity)
    return objective_value(summary["metrics"], spec.top.objective)
