"""How a run that did not finish ends.

A run stopped by a signal exits with the conventional status (128 + the signal) and one line on
stderr; running out of device memory or a loader worker's failure becomes one line the person
can act on; anything else keeps its traceback. A run refused before it trained leaves no folder
behind where the folder is its own (`trainer.phases.compose.made_by_this_job`,
`remove_refused_folder`). How a failed job
of a sweep reports to its sweeper is trainer/groups/sweeps.py's.
"""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from trainer.callbacks.graceful import StoppedBySignal
from trainer.configuration.spec import RunSpec
from trainer.data.loader import loader_failure
from trainer.infra.errors import UserError, first_line
from trainer.phases.compose import HYDRA_RECORD, HYDRA_START

log = logging.getLogger("trainer")

SIGTERM_EXIT = 128 + 15


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


#: What a run writes into its folder before it trains, after Hydra's own (identify: run.json;
#: prepare: env.json and config_resolved.yaml). Anything else (checkpoints, summary.json, a logger's
#: or a data set's files, bad_files.tsv) means the folder holds more than a refused start and is kept.
RUN_START = HYDRA_START | {"run.json", "env.json", "config_resolved.yaml"}


def remove_refused_folder(run_dir: Path) -> bool:
    """A run refused before it trained (bad input): remove the folder this job made, where it still
    holds only what the start wrote (`RUN_START`), so a mistake leaves no folder to mistake for a
    run. The caller asks `made_by_this_job` first; a folder holding anything else is kept. True when
    removed."""
    try:
        entries = {entry.name for entry in run_dir.iterdir()}
    except OSError:
        return False
    if not entries <= RUN_START or any((run_dir / name).is_symlink() for name in entries):
        return False
    record = run_dir / ".hydra"
    if record.exists() and (not record.is_dir() or not {e.name for e in record.iterdir()} <= HYDRA_RECORD):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return not run_dir.exists()


def remove_empty_parents(run_dir: Path, root: Path) -> None:
    """The folders between `root` and a removed run folder that are now empty (the day's folder of
    runs/DATE/TIME after the day's first run was refused). Only empty folders go, one at a time:
    one that another run has just started in is no longer empty and stays."""
    try:
        below = run_dir.resolve().parent.relative_to(root.resolve())
    except (OSError, ValueError):
        return  # a folder outside run.root: its parents are the person's
    folder = root.resolve() / below
    while folder != root.resolve():
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent
