"""How a run that did not finish ends, and how a failed job reports to a sweep.

A run stopped by a signal exits with the conventional status (128 + the signal) and one line on
stderr; running out of device memory or a loader worker's failure becomes one line the person
can act on; anything else keeps its traceback. In a multirun a failed job must not end the sweep:
it returns NaN to Hydra's basic sweeper, or raises `TrialFailed` for the Optuna sweeper.
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.utilities.exceptions import SIGTERMException

from trainer.callbacks.graceful import StoppedBySignal
from trainer.config import RunSpec
from trainer.data.loader import loader_failure
from trainer.errors import UserError, first_line

log = logging.getLogger("trainer")

SIGTERM_EXIT = 128 + 15


class TrialFailed(Exception):
    """An Optuna trial whose run failed or has no finite objective (see `job_failed`)."""


def was_interrupted(ex: BaseException) -> bool:
    """A stop the person or the scheduler asked for, not a failure."""
    return isinstance(ex, (KeyboardInterrupt, StoppedBySignal, SIGTERMException))


def ending_for(ex: BaseException, spec: RunSpec, last_checkpoint: str | None) -> BaseException | None:
    """The exception a failed fit should end the process with, or None to re-raise `ex` as it is.

    The summary and the checkpoints are already written when this is asked: nothing is lost.
    """
    if isinstance(ex, SIGTERMException):  # Lightning's, outside the training steps
        sys.stderr.write("stopped by SIGTERM outside a training step; no checkpoint written for it\n")
        return SystemExit(SIGTERM_EXIT)
    if isinstance(ex, StoppedBySignal):
        # A clean stop, not an error: the conventional exit status of a signalled process.
        sys.stdout.flush()
        sys.stderr.write(f"{ex}\n")
        sys.stderr.flush()
        if ex.hand_over is not None:
            # submitit's handler, now that the checkpoint and summary are written: it saves the
            # job's resubmission, asks SLURM to requeue it and exits (rank 0; the others return).
            log.info("handing the preemption over to the launcher's handler (submitit requeues the job)")
            ex.hand_over()
        return SystemExit(128 + ex.signum)
    if isinstance(ex, torch.cuda.OutOfMemoryError):  # torch.OutOfMemoryError in newer torch
        return out_of_memory(ex, spec, last_checkpoint)
    failure = loader_failure(ex)  # a loader worker that raised or died: one line
    return failure if failure is not None and failure is not ex else None


def out_of_memory(ex: BaseException, spec: RunSpec, last_checkpoint: str | None) -> UserError:
    """Device memory ran out: one line with the batch size and the switches that need less memory
    (what was saved before stays as it was: checkpoints are only ever replaced atomically)."""
    batch = int(spec.data["batch_size"])
    saved = f"; the last checkpoint is intact: {last_checkpoint}" if last_checkpoint and Path(
        last_checkpoint).is_file() else ""
    reason = first_line(ex, 160) or "out of memory"
    return UserError("data.batch_size", f"out of device memory at batch size {batch} ({reason}){saved}",
                     f"data.batch_size={max(1, batch // 2)} with trainer.accumulate_grad_batches="
                     f"{2 * int(spec.trainer.get('accumulate_grad_batches', 1))} (same global batch), "
                     "precision=bf16_mixed, model.activation_checkpointing=[STAGE,...], a smaller data.image_size")


def in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def optuna_sweep() -> bool:
    return "optuna" in str(HydraConfig.get().sweeper.get("_target_", "")).lower()


def job_failed(line: str, ex: BaseException | None) -> float:
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
    if optuna_sweep():
        raise TrialFailed(line)
    return float("nan")


def objective_value(metrics: dict[str, dict[str, float]], name: str) -> float:
    """The metric `name` (``split/metric``) of the finished run; NaN when the run has none."""
    split, _, metric = name.partition("/")
    value = metrics.get(split, {}).get(metric)
    if value is None:
        log.warning("objective %s: the run logged no such metric (it has %s); returning NaN", name,
                    ", ".join(f"{s}/{m}" for s, values in metrics.items() for m in values) or "none")
        return float("nan")
    return float(value)


def check_trial(objective: float | None) -> None:
    """An Optuna trial without a finite objective counts as failed (the sweeper would crash on NaN)."""
    if objective is not None and not math.isfinite(objective) and in_multirun() and optuna_sweep():
        raise TrialFailed(f"objective is {objective}: the trial counts as failed")
