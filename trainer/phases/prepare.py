"""The prepare phase's record: the run, what it resumes from and the plan printed; env.json and
config_resolved.yaml written."""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import OmegaConf

from trainer.infra.atomic import write_text_atomic
from trainer.configuration.spec import RunSpec
from trainer.infra.fingerprint import fingerprint
from trainer.phases.compose import Job
from trainer.phases.identify import Identity
from trainer.phases.plan import Plan
from trainer.infra.atomic import write_json_atomic

log = logging.getLogger("trainer")


def announce(spec: RunSpec, plan: Plan, job: Job, identity: Identity, rank_zero: bool) -> dict[str, Any]:
    """Print the run, what it resumes from and the plan; write env.json and config_resolved.yaml."""
    log.info("run %s, folder %s", identity.name, job.run_dir)
    if identity.resume_from is not None:
        source = identity.resume_from
        log.info("resuming from %s (step %d, epoch %d%s)", source.path, source.global_step, source.epoch,
                 ", mid-epoch" if source.mid_epoch else "")
    for line in plan.lines():
        log.info("  %s", line)
    for warning in plan.warnings:
        log.warning("%s", warning)
    environment = fingerprint()
    if rank_zero:
        write_json_atomic(job.run_dir / "env.json", environment)
        # Hydra's .hydra/config.yaml keeps interpolations as written; this is what the run used.
        write_text_atomic(job.run_dir / "config_resolved.yaml", OmegaConf.to_yaml(spec.resolved))
    return environment
