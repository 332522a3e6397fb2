"""How a run that did not finish ends: a run stopped by a signal exits with the conventional status
(128 + the signal) and one line on stderr; running out of device memory or a loader worker's
failure becomes one line the person can act on; anything else keeps its traceback."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from trainer.callbacks.graceful import StoppedBySignal
from trainer.configuration.spec import RunSpec
from trainer.data.loader import loader_failure
from trainer.infra.errors import UserError, first_line

log = logging.getLogger("trainer")

SIGTERM_EXIT = 128 + 15


def was_interrupted(ex: BaseException) -> bool:
    """A stop the person or the scheduler asked for, not a failure."""
    return isinstance(ex, (KeyboardInterrupt, StoppedBySignal, SIGTERMException))


def ending_for(ex: BaseException, spec: RunSpec, batch_size: int, last_checkpoint: str | None) -> BaseException | None:
    """The exception a failed fit ends the process with, or None to re-raise `ex` as it is (the summary
    and the checkpoints are already written). `batch_size`: the per-device batch the run trained with."""
    if isinstance(ex, SIGTERMException):  # Lightning's, outside the training steps
        sys.stderr.write("stopped by SIGTERM outside a training step; no checkpoint written for it\n")
        return SystemExit(SIGTERM_EXIT)
    if isinstance(ex, StoppedBySignal):
        # A clean stop, not an error: the conventional exit status of a signalled process.
        sys.stdout.flush()
        print(ex, file=sys.stderr, flush=True)
        if ex.hand_over is not None:
            # submitit's handler, now that the checkpoint and summary are written: it saves the
            # job's resubmission, asks SLURM to requeue it and exits (rank 0; the others return).
            log.info("handing the preemption over to the launcher's handler (submitit requeues the job)")
            ex.hand_over()
        return SystemExit(128 + ex.signum)
    if isinstance(ex, torch.cuda.OutOfMemoryError):  # torch.OutOfMemoryError in newer torch
        return out_of_memory(ex, spec, batch_size, last_checkpoint)
    failure = loader_failure(ex)  # a loader worker that raised or died: one line
    return failure if failure is not None and failure is not ex else None


def out_of_memory(ex: BaseException, spec: RunSpec, batch: int, last_checkpoint: str | None) -> UserError:
    """Device memory ran out: one line with the batch size and the switches that need less memory
    (what was saved before stays as it was: checkpoints are only ever replaced atomically)."""
    saved = f"; the last checkpoint is intact: {last_checkpoint}" if last_checkpoint and Path(
        last_checkpoint).is_file() else ""
    reason = first_line(ex, 160) or "out of memory"
    found = " (what data.batch_size=auto found)" if spec.data.get("batch_size") == "auto" else ""
    return UserError("data.batch_size", f"out of device memory at batch size {batch}{found} ({reason}){saved}",
                     f"data.batch_size={max(1, batch // 2)} with trainer.accumulate_grad_batches="
                     f"{2 * int(spec.trainer.get('accumulate_grad_batches', 1))} (same global batch), "
                     "precision=bf16_mixed, model.activation_checkpointing=[STAGE,...], a smaller data.image_size")
