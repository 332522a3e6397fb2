"""The identify phase: refuse a job that cannot run before anything starts, find the checkpoint a
run carries on from (or that it has already completed), and write run.json."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

from trainer.infra import attempts
from trainer.configuration.spec import RunSpec
from trainer.infra.devices import count_devices, resolve_accelerator
from trainer.infra.distributed import check_launch, is_rank_zero, process_count
from trainer.infra.errors import UserError
from trainer.groups.sweeps import objective_value
from trainer.groups.logger import logger_ids
from trainer.phases.compose import Job
from trainer.infra.resume import Checkpoint, Completed, identity_of, resolve_resume, write_identity
from trainer.infra.atomic import write_json_atomic

log = logging.getLogger("trainer")


class Identity(NamedTuple):
    name: str
    resume_from: Checkpoint | None
    logger_ids: dict[str, str]
    #: The run's attempts before this one (a requeued or resumed run), and this one's record.
    earlier_attempts: list[dict[str, Any]]
    attempt: dict[str, Any]


def check_job(spec: RunSpec, job: Job) -> bool:
    """Refuse what cannot run as one job before anything starts; whether this process writes the
    run's records (rank 0 of several processes)."""
    accelerator = resolve_accelerator(str(spec.trainer.get("accelerator", "auto")))[0]
    processes = process_count(spec.trainer, count_devices(spec.trainer.get("devices", 1), accelerator))
    check_launch(processes, job.multirun, job.launcher, spec.top.diagnose or spec.top.profile,
                 spec.trainer.get("strategy", "auto"), accelerator,
                 measuring="profile" if spec.top.profile else "diagnose")
    if spec.top.ladder and not job.multirun:
        raise UserError("ladder", f"'{spec.top.ladder}' is a sequence of runs and needs Hydra's multirun",
                        f"python train.py -m +ladder={spec.top.ladder}")
    rank_zero = is_rank_zero()
    if not rank_zero:  # the other ranks train and say only what goes wrong
        log.setLevel(logging.WARNING)
    return rank_zero


def already_completed(done: Completed, name: str, spec: RunSpec, job: Job, rank_zero: bool) -> float:
    """A run asked to resume that has already completed: one line, nothing trained or written in
    its folder, and its objective for a sweeper. In a multirun the job's folder gets the run's
    summary, unchanged, for the sweep's comparison table."""
    tested = (done.summary.get("metrics") or {}).get("test") or {}
    reached = "  ".join(f"test/{k} {v:.4f}" for k, v in tested.items() if isinstance(v, (int, float)))
    log.info("run '%s' already completed in %s (%s): nothing to do", name, done.folder,
             reached or f"{done.summary.get('steps')} steps")
    if job.multirun and rank_zero and job.run_dir.resolve() != done.folder.resolve():
        write_json_atomic(job.run_dir / "summary.json", done.summary)
    return objective_value(done.summary.get("metrics") or {}, spec.top.objective)


def identify(spec: RunSpec, job: Job, rank_zero: bool, name: str, resume: str | None) -> Identity:
    """The run's checkpoint to carry on from, and its loggers' run ids (a wandb run continues under
    the id of the run resumed from); run.json records them with the run's stable name."""
    resume_from = resolve_resume(resume, name, Path(spec.identity.root), job.run_dir)
    ids = logger_ids(spec.loggers, identity_of(resume_from.path).get("logger_ids") if resume_from else None)
    resumed_step = resume_from.global_step if resume_from else None
    earlier = attempts.earlier_attempts(resume_from.path if resume_from else None, resumed_step)
    if rank_zero:
        write_identity(job.run_dir, name, str(resume_from.path) if resume_from else None, ids)
    return Identity(name, resume_from, ids, earlier, attempts.this_attempt(len(earlier) + 1, resumed_step))
