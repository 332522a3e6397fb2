"""The prepare phase: the run, what it resumes from and the plan printed with the start-up warnings
(the studies', the alignment's); env.json and config_resolved.yaml written."""

from __future__ import annotations

import logging

from omegaconf import OmegaConf

from trainer.infra.atomic import write_json_atomic, write_text_atomic
from trainer.infra.fingerprint import fingerprint
from trainer.measure.alignment import check_alignment
from trainer.measure.memory import MemoryPlan
from trainer.models.layers import count_parameters
from trainer.phases.state import Run

log = logging.getLogger("trainer")


def announce(run: Run, memory: MemoryPlan | None = None) -> None:
    """Print the run, what it resumes from, the plan and the memory plan; `run.environment` and
    `run.model_facts` (the network's size and its dimensions' alignment), env.json and
    config_resolved.yaml written."""
    plan, identity = run.plan, run.identity
    log.info("run %s, folder %s", identity.name, run.job.run_dir)
    if identity.resume_from is not None:
        source = identity.resume_from
        log.info("resuming from %s (step %d, epoch %d%s)", source.path, source.global_step, source.epoch,
                 ", mid-epoch" if source.mid_epoch else "")
    for line in plan.lines():
        log.info("  %s", line)
    for warning in plan.warnings:
        log.warning("%s", warning)
    run.model_facts = {"parameters": count_parameters(run.parts.net),
                       "alignment": check_alignment(run.parts.net, plan.batch_size, plan.accelerator)}
    for line in memory.lines() if memory is not None else []:
        log.info(line)
    run.environment = fingerprint()
    if run.rank_zero:
        write_json_atomic(run.job.run_dir / "env.json", run.environment)
        # Hydra's .hydra/config.yaml keeps interpolations as written; this is what the run used.
        write_text_atomic(run.job.run_dir / "config_resolved.yaml", OmegaConf.to_yaml(run.spec.resolved))
