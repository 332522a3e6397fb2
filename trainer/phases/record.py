"""The record phase: summary.json's fields for what ran, and how the run ended (completed, failed,
preempted or interrupted), also for a run that fails while recording."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import platform
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException

from trainer.callbacks.graceful import StoppedBySignal
from trainer.callbacks.utilisation import device_utilisation
from trainer.configuration.recipes import lineage_record, team_folders
from trainer.groups.logger import finish_loggers
from trainer.infra import attempts
from trainer.infra.distributed import launched_by
from trainer.infra.errors import UserError, exception_line, full_error_requested
from trainer.infra.signals import is_preemption
from trainer.infra.summary import RunRecord, log_result, optimizer_param_groups
from trainer.phases.failures import ending_for, was_interrupted
from trainer.phases.fit import Fitted
from trainer.phases.state import Run

log = logging.getLogger("trainer")


def begin_record(run: Run, memory: dict[str, Any] | None = None) -> None:
    """`run.record`: summary.json begun with what is known before training (`what_ran`), and the
    memory plan's measurement where one was made."""
    run.record = RunRecord(run.job.run_dir / "summary.json", writes=run.rank_zero, fields=what_ran(run))
    if memory is not None:
        run.record.fields["memory_plan"] = memory
    run.record.begin()


def what_ran(run: Run) -> dict[str, Any]:
    """summary.json's fields known before training: the command, choices, recipe, plan and setup."""
    job, spec, plan, identity, environment = run.job, run.spec, run.plan, run.identity, run.environment
    trainer, info, resumed = run.built.trainer, run.parts.info, identity.resume_from
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
        # Absolute: deploy (trainer/deploy/export.py) imports the team's _target_s from them, from any folder.
        "team_dirs": [str(folder) for folder in team_folders()],
        "ladder": spec.top.ladder,
        "seed": spec.top.seed,
        "derived": plan.to_dict(),
        "task": {"target": spec.task["_target_"], "unit": plan.unit, "units_per_sample": plan.units_per_sample,
                 "describe": run.parts.definition.describe()},
        "hyperparameters": {
            "batch_size": plan.batch_size, "global_batch_size": plan.global_batch_size,
            **({f"global_batch_{plan.unit}": plan.global_batch_units} if plan.unit != "samples" else {}),
            "optimizer": spec.optimizer.name, "lr": plan.lr, "weight_decay": plan.weight_decay,
            "scheduler": spec.scheduler.name, "precision": plan.precision,
            "max_epochs": trainer.max_epochs, "max_steps": trainer.max_steps},
        "data": {"target": spec.data["_target_"], **info.summary()},
        "model": {"target": spec.model["_target_"], **run.model_facts,
                  "activation_checkpointing": spec.activation_checkpointing},
        "device": {"accelerator": plan.accelerator, "devices": plan.devices,
                   "name": environment["gpus"][0] if plan.accelerator == "cuda" else environment["cpu"]},
        "processes": {"count": trainer.world_size, "strategy": type(trainer.strategy).__name__,
                      "launched_by": launched_by() or ("lightning" if trainer.world_size > 1 else None)},
        "host": host_at_start(),
    }


def host_at_start() -> dict[str, Any]:
    """When the run began and how busy the machine was then: the provenance a study's jobs file
    keeps, so that a run timed beside other load can be told apart (see `host_at_end`)."""
    return {"name": platform.node(), "cpus": os.cpu_count(), "started": attempts.utc_now(), "load_at_start": _load()}


def host_at_end(record: RunRecord) -> dict[str, Any]:
    """`host` completed at the end of the run: the end time and the load averages (1, 5, 15 min) then."""
    return {**record.fields.get("host", {}), "ended": attempts.utc_now(), "load_at_end": _load()}


def _load() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the system has none)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def record_failure(run: Run, ex: BaseException) -> BaseException | None:
    """summary.json of a run that failed, was preempted or was interrupted (Lightning ends a
    SIGTERM'd fit with its own SIGTERMException: the checkpoint was written by GracefulStop at the
    end of that step, so the run stopped cleanly); the exception to end with, or None to re-raise."""
    built, record, identity = run.built, run.record, run.identity
    ex = built.stopper.outcome() or ex
    status = _ending_status(ex)
    steps = built.trainer.global_step
    signum = ex.signum if isinstance(ex, StoppedBySignal) else None
    _wrap_up(run, failed=True)
    record.end(status, error=exception_line(ex), nonfinite=run.parts.guard.summary(),
               device_utilisation=device_utilisation(built.trainer.callbacks),  # type: ignore[attr-defined]
               wall_time_s=time.perf_counter() - run.started, steps=steps, host=host_at_end(record),
               **attempts.totals([*identity.earlier_attempts,
                                  attempts.ended(identity.attempt, status, steps, signum, record.working)]))
    last = built.checkpoint.last_model_path if built.checkpoint is not None else None
    return ending_for(ex, run.spec, run.plan.batch_size, last)


def _ending_status(ex: BaseException) -> str:
    """preempted (a scheduler's signal: the job may come back), interrupted (a person), or failed."""
    if isinstance(ex, SIGTERMException) or (isinstance(ex, StoppedBySignal) and is_preemption(ex.signum)):
        return "preempted"
    return "interrupted" if was_interrupted(ex) else "failed"


def record_completion(run: Run, fitted: Fitted) -> dict[str, Any]:
    """summary.json of a completed run: metrics, which weights were tested, cost; printed. A failure
    while recording is recorded as that, in one line: the checkpoints already written stay valid,
    and the run's next start (resume=if_any) tests and records it again."""
    record, identity = run.record, run.identity
    try:
        summary = _write_completion(run, fitted)
    except Exception as ex:  # noqa: BLE001 - recorded and reported as one line, see the docstring
        if full_error_requested():
            raise
        problem = f"recording the completed run failed ({exception_line(ex, 300)})"
        steps = run.built.trainer.global_step
        with contextlib.suppress(Exception):  # the summary cannot be written either: the line says it all
            record.end("failed", error=problem, **attempts.totals(
                [*identity.earlier_attempts, attempts.ended(identity.attempt, "failed", steps, stopped_in="recording")]))
        raise UserError(str(record.path), problem,
                        "the same command with resume=if_any, which tests and records the run again from its "
                        f"final checkpoint ({fitted.final_checkpoint or 'none was written'})") from None
    if record.writes:
        try:
            log_result(summary)
        except Exception as ex:  # noqa: BLE001 - the summary is written; only its printout failed
            log.warning("could not print the result (%s); it is in %s", exception_line(ex), record.path)
    return summary


def _tested_weights(run: Run, fitted: Fitted) -> str:
    checkpoint, monitor = run.built.checkpoint, run.spec.checkpointing.monitor
    if not (fitted.use_best and checkpoint):
        return "weights at the end of training"
    score = checkpoint.best_model_score
    shown = f", {monitor}={float(score):.4f}" if score is not None else ""
    return f"best checkpoint by {monitor} ({Path(checkpoint.best_model_path).name}{shown})"


def _write_completion(run: Run, fitted: Fitted) -> dict[str, Any]:
    trainer, checkpoint, identity = run.built.trainer, run.built.checkpoint, run.identity
    _wrap_up(run, failed=False)
    return run.record.end(
        "completed", metrics=fitted.metrics, tested_weights=_tested_weights(run, fitted),
        best_checkpoint=checkpoint.best_model_path if fitted.use_best and checkpoint else None,
        final_checkpoint=fitted.final_checkpoint,
        optimizer_param_groups=optimizer_param_groups(trainer.optimizers), **fitted.training_records,
        peak_memory=fitted.peak_memory, steps=trainer.global_step, epochs=trainer.current_epoch,
        fit_time_s=fitted.fit_seconds, wall_time_s=time.perf_counter() - run.started, host=host_at_end(run.record),
        **attempts.totals([*identity.earlier_attempts, attempts.ended(identity.attempt, "completed", trainer.global_step)]))


def _wrap_up(run: Run, failed: bool) -> None:
    """What every ending does before its summary is written: the loggers' runs finished,
    curves.png drawn (as far as training got), and the files the data module found unreadable
    (image folders: by the scan and while loading) noted."""
    built, record = run.built, run.record
    finish_loggers(list(built.trainer.loggers), failed=failed)
    if record.writes:
        built.curves.try_write_png(record.path.parent / "curves.png", title=run.identity.name)
    report = getattr(run.parts.datamodule, "bad_files_summary", None)
    if report is not None:
        record.fields["data"]["bad_files"] = report()
