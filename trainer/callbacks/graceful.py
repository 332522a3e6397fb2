"""SIGTERM and SIGINT stop a run at the next step boundary, after a checkpoint is written.

A scheduler's SIGTERM (preemption, a requeue, `scancel`) or a person's Ctrl-C should not cost the
work since the last epoch's checkpoint: the signal only sets a flag; at the end of the current
training step (the optimizer step, under gradient accumulation) the callback writes
`checkpoints/last.ckpt` (atomically, see trainer/checkpoint.py) and asks Lightning to stop; the run
carries on exactly from there with ``resume=auto``. A second SIGINT while it finishes the step interrupts at once.
The handlers are installed while training steps run (not during the sanity check, validation at the
end or testing), and only in the main thread.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch

from trainer.callbacks.steps import StepBoundary


class StoppedBySignal(Exception):
    """Training stopped cleanly on a signal; `signum` tells which one."""

    def __init__(self, signum: int, step: int, checkpoint: str) -> None:
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; checkpoint: {checkpoint}")


class GracefulStop(StepBoundary):
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self.checkpoint: str | None = None
        self.step: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop now
        self.received = signum

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Installed here, after Lightning's own signal connector: its SIGTERM handling ends the fit
        # with an exception at a moment of its choosing, possibly before this step's checkpoint.
        # Restored at train end (or on an exception), before Lightning puts back the originals.
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self.checkpoint is not None:
            return
        if not self.ended_on_optimizer_step(trainer):
            return  # mid-accumulation: the summed gradients are not in a checkpoint; stop after the step
        if trainer.world_size > 1:
            # All processes stop at the same step, or the ones still training would wait forever
            # in a collective: whichever got the signal (a terminal's Ctrl-C, SLURM and torchrun
            # reach every process, but not at the same instant), all agree on it here. One scalar
            # all-reduce per optimizer step, only with several processes.
            signum = torch.tensor([self.received or 0], device=pl_module.device)
            self.received = int(trainer.strategy.reduce(signum, reduce_op="max").item()) or None
        if self.received is None:
            return
        path = Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"
        trainer.save_checkpoint(str(path), weights_only=False)  # full (resumable); said, not defaulted
        self.checkpoint, self.step = str(path), int(trainer.global_step)
        trainer.should_stop = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def outcome(self) -> StoppedBySignal | None:
        if self.received is None or self.checkpoint is None or self.step is None:
            return None
        return StoppedBySignal(self.received, self.step, self.checkpoint)
