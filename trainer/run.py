"""The one place that wires a run: the phases of trainer/phases/ called in order over one `Run`
record, and the measurement modes of trainer/modes/ entered by one call each. docs/architecture.md
describes the phases, the modes and what each decides."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
from omegaconf import DictConfig

from trainer.callbacks.graceful import SignalLatch
from trainer.groups.optimizer.schema import LR_FIND
from trainer.groups.task import objective_of
from trainer.groups.sweeps import check_trial, in_multirun, job_failed, objective_value
from trainer.infra.distributed import LaunchRefused, is_rank_zero
from trainer.infra.errors import UserError, exception_line, exit_with, full_error_requested
from trainer.infra.library_logs import route_library_logs
from trainer.modes.batch_finder import find_batch_size
from trainer.modes.diagnosis import run_diagnosis
from trainer.modes.lr_finder import find_lr
from trainer.modes.memory_plan import measure_memory_plan
from trainer.modes.profiling import run_profile
from trainer.phases.build import build_parts, build_task, build_trainer
from trainer.phases.compose import Job, remove_refused_run
from trainer.phases.fit import fit, test_after_fit, training_fields
from trainer.phases.identify import already_completed, check_job, completed_before, identify
from trainer.phases.plan import decide_probe, resolve
from trainer.phases.prepare import announce
from trainer.phases.record import begin_record, record_completion, record_failure
from trainer.phases.state import Run

log = logging.getLogger("trainer")


def run(cfg: DictConfig, run_dir: Path | None = None, group_choices: dict[str, str] | None = None,
        overrides: list[str] | None = None, own_folder: bool | None = None) -> float | None:
    """Train and test as `cfg` says; return the metric named by `objective` (the sweep objective,
    val/acc by default).

    `run_dir`, `group_choices` and `overrides` default to Hydra's for the current job. A mistake in
    the input ends the process with one line and exit code 2 (a traceback with HYDRA_FULL_ERROR=1);
    refused before training, a single run leaves no folder where the folder was its own.
    In a multirun, a job that fails reports to the sweeper instead, so the sweep goes on
    (`trainer.groups.sweeps.job_failed`). `own_folder`: whether the run folder held nothing from
    before this job as it started (`trainer.phases.compose.made_by_this_job`; asked here if not given).
    """
    job = Job.from_hydra(cfg, run_dir, group_choices, overrides, own_folder)
    # A single run's own folder is removed if the run is refused before it trains. A sweep's jobs
    # keep theirs: the sweep reports each failed job by its folder.
    removable = job.own_folder and not job.multirun and not in_multirun() and is_rank_zero()
    try:
        objective = _run(job)
    except UserError as ex:
        if removable:
            remove_refused_run(job.run_dir, job.cfg)
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
        return _run_phases(Run(job, latch))
    finally:
        latch.uninstall()


def plan_run(run: Run) -> None:
    """Where and how a step runs (the probe), the batch and lr finders where asked, and the one
    resolve: `run.plan` (also what benchmarks/hand_loop.py builds its loop from)."""
    probe = decide_probe(run.spec, run.devices, run.parts)
    batch = find_batch_size(run, probe) if run.parts.datamodule.batch_size_auto else None
    lr = find_lr(run, probe, batch) if run.spec.optimizer.lr == LR_FIND else None
    run.plan = resolve(run.spec, probe, run.parts, batch_size=batch, lr=lr)


def _run_phases(run: Run) -> float | None:
    check_job(run)
    done = completed_before(run)
    if done is not None:
        return already_completed(run, done)
    identify(run)
    route_library_logs()
    L.seed_everything(run.spec.top.seed, workers=True, verbose=False)
    build_parts(run)
    plan_run(run)
    memory = measure_memory_plan(run) if run.spec.top.memory_plan else None
    announce(run, memory)
    build_task(run)
    if run.spec.top.diagnose:  # a measurement, not a training run: no objective
        run_diagnosis(run)
        return None
    if run.spec.top.profile:
        run_profile(run)
        return None
    run.built = build_trainer(run)
    begin_record(run, memory.to_dict() if memory is not None else None)
    return _train(run)


def _train(run: Run) -> float | None:
    """Fit and test, with summary.json saying which phase the run is in, and how it ended."""
    try:
        fitted = fit(run)
        run.record.enter("testing", **training_fields(run, fitted))
        fitted = test_after_fit(run, fitted)
    except BaseException as ex:
        ending = record_failure(run, ex)
        if ending is None:
            raise
        raise ending from None
    run.record.enter("recording")
    summary = record_completion(run, fitted)
    return objective_value(summary["metrics"], objective_of(run.spec.task, run.spec.top.objective))
