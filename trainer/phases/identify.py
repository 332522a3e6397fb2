"""The identify phase: the config validated and the devices decided (once, for every phase after),
a job that cannot run refused before anything starts, the checkpoint a run carries on from found
(or the run found already completed), and run.json written."""

from __future__ import annotations

import logging
from pathlib import Path

from trainer.configuration.spec import validate
from trainer.groups.communication import check_measurable
from trainer.groups.communication import decide as decide_communication
from trainer.groups.logger import check_loggers, logger_ids
from trainer.groups.task import objective_of
from trainer.groups.sweeps import objective_value
from trainer.infra import attempts
from trainer.infra.atomic import write_json_atomic
from trainer.infra.command import invoked_as
from trainer.infra.devices import decide_devices
from trainer.infra.distributed import check_launch, is_rank_zero
from trainer.infra.errors import UserError
from trainer.phases.products import Identity
from trainer.phases.resume import (STOP_KEYS, Completed, completed_run, default_name, identity_of, requested,
                                   resolve_resume, write_identity)
from trainer.phases.state import Run

log = logging.getLogger("trainer")


def check_job(run: Run) -> None:
    """`run.spec`, `run.devices` and `run.rank_zero`; what cannot run as one job is refused here."""
    run.spec = spec = validate(run.job.cfg, run.job.choices)
    run.devices = devices = decide_devices(spec.trainer)
    strategy = spec.trainer.get("strategy", "auto")
    check_launch(devices.processes, run.job.multirun, run.job.launcher, strategy, devices.accelerator)
    if spec.top.diagnose or spec.top.profile:
        check_measurable(strategy, devices.processes, "profile" if spec.top.profile else "diagnose")
    # Refused here, before anything is built; the plan records the same decision (trainer/phases/plan.py).
    decide_communication(spec.communication, strategy, devices.processes, devices.accelerator)
    if spec.top.ladder and not run.job.multirun:
        raise UserError("ladder", f"'{spec.top.ladder}' is a sequence of runs and needs Hydra's multirun",
                        f"{invoked_as()} -m +ladder={spec.top.ladder}")
    run.rank_zero = is_rank_zero()
    if not run.rank_zero:  # the other ranks train and say only what goes wrong
        log.setLevel(logging.WARNING)


def run_name(run: Run) -> str:
    return run.spec.identity.name or default_name(run.job.choices, run.job.overrides)


def completed_before(run: Run) -> Completed | None:
    """The run, asked to resume, found already completed (measurements are never skipped)."""
    spec = run.spec
    if spec.top.diagnose or spec.top.profile:
        return None
    return completed_run(requested(spec.top.resume), run_name(run), Path(spec.identity.root), run.job.run_dir,
                         {key: spec.trainer.get(key) for key in STOP_KEYS})


def already_completed(run: Run, done: Completed) -> float:
    """A run asked to resume that has already completed: one line, nothing trained or written in
    its folder, and its objective for a sweeper. In a multirun the job's folder gets the run's
    summary, unchanged, for the sweep's comparison table."""
    tested = (done.summary.get("metrics") or {}).get("test") or {}
    reached = "  ".join(f"test/{k} {v:.4f}" for k, v in tested.items() if isinstance(v, (int, float)))
    log.info("run '%s' already completed in %s (%s): nothing to do", run_name(run), done.folder,
             reached or f"{done.summary.get('steps')} steps")
    if run.job.multirun and run.rank_zero and run.job.run_dir.resolve() != done.folder.resolve():
        write_json_atomic(run.job.run_dir / "summary.json", done.summary)
    return objective_value(done.summary.get("metrics") or {},
                           objective_of(run.spec.task, run.spec.top.objective))


def identify(run: Run) -> None:
    """`run.identity`: the run's stable name, the checkpoint to carry on from, and its loggers' run
    ids (a wandb run continues under the id of the run resumed from); run.json records them."""
    spec, job, name = run.spec, run.job, run_name(run)
    if run.rank_zero and not (spec.top.diagnose or spec.top.profile):  # a measurement logs nothing
        check_loggers(spec.loggers)  # a wandb run with no API key: one line now, not a traceback at fit
    resume_from = resolve_resume(spec.top.resume, name, Path(spec.identity.root), job.run_dir)
    ids = logger_ids(spec.loggers, identity_of(resume_from.path).get("logger_ids") if resume_from else None)
    resumed_step = resume_from.global_step if resume_from else None
    earlier = attempts.earlier_attempts(resume_from.path if resume_from else None, resumed_step)
    if run.rank_zero:
        write_identity(job.run_dir, name, str(resume_from.path) if resume_from else None, ids)
    run.identity = Identity(name, resume_from, ids, earlier, attempts.this_attempt(len(earlier) + 1, resumed_step))
