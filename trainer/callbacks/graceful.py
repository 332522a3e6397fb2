"""Stop signals end a run at the next step boundary, after a checkpoint is written (docs/reliability.md,
"Signals and crashes"; docs/scale-out.md, "Preemption and requeue").

`SignalLatch` only records the signal; at the end of the training step `GracefulStop` writes
`checkpoints/last.ckpt` and stops Lightning (the test stops early only when the final state is in a
checkpoint). Submitit's handler exits on the spot, mid-step: the latch keeps it, and
`StoppedBySignal.hand_over` calls it once the run has recorded how it ended."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch

from trainer.callbacks.steps import StepBoundary
from trainer.infra.signals import preemption_signal, priority


class StoppedBySignal(Exception):
    """Training stopped cleanly on a signal; `signum` tells which one. `hand_over`, when set, is the
    handler that was there before the run (submitit's), to be called once everything is recorded."""

    def __init__(self, signum: int, step: int, checkpoint: str,
                 hand_over: Callable[[], None] | None = None) -> None:
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint
        self.hand_over = hand_over
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; checkpoint: {checkpoint}")


class SignalLatch:
    """Records the first stop signal of a run; installed in the main thread only."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._before_run: dict[int, Any] = {}

    def handle(self, signum: int, frame: Any) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop now
        if self.received is None or priority(signum) > priority(self.received):
            self.received = signum

    def install(self) -> None:
        """At the start of the run: from here on a stop signal is recorded, not acted on at once."""
        if threading.current_thread() is threading.main_thread() and not self._before_run:
            self._before_run = self.take_over()

    def take_over(self) -> dict[int, Any]:
        """Put the latch in front of whatever handles the signals now; returns those handlers."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        signals = dict.fromkeys((signal.SIGTERM, signal.SIGINT, preemption_signal()))  # each once
        return {signum: signal.signal(signum, self.handle) for signum in signals}

    @staticmethod
    def put_back(handlers: dict[int, Any]) -> None:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)

    def uninstall(self) -> None:
        self.put_back(self._before_run)
        self._before_run = {}

    def hand_over(self, signum: int) -> Callable[[], None] | None:
        """The handler that was installed before the run for `signum` (submitit's requeue on its
        preemption signal), bound to that signal; None if there was none to call."""
        handler = self._before_run.get(signum)
        if not callable(handler) or handler in (signal.default_int_handler,) or signum != preemption_signal():
            return None
        return lambda: handler(signum, None)


class GracefulStop(StepBoundary):
    def __init__(self, latch: SignalLatch | None = None) -> None:
        self.latch = latch or SignalLatch()
        self.checkpoint: str | None = None
        self.step: int | None = None
        self._displaced: dict[int, Any] = {}
        #: Set once training has ended: the checkpoint that holds its final state, if any.
        self.final_checkpoint: str | None = None

    @property
    def received(self) -> int | None:
        return self.latch.received

    @received.setter
    def received(self, signum: int | None) -> None:
        self.latch.received = signum

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Here, after Lightning's own signal connector: its SIGTERM handling ends the fit with an
        # exception at a moment of its choosing, possibly before this step's checkpoint. Its
        # handlers are put back at train end (or on an exception), before Lightning restores ours.
        self._displaced = self.latch.take_over()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self.checkpoint is not None:
            return
        if self.received is None and trainer.world_size == 1:
            return  # (the usual step: no signal here, and no other process that may have had one)
        if not self.ended_on_optimizer_step(trainer):
            return  # mid-accumulation: the summed gradients are not in a checkpoint; stop after the step
        if self.ends_epoch(trainer, batch_idx):
            return  # the epoch ends (validation, last.ckpt) first; stop after the next epoch's first step
        if not self._agree(trainer, pl_module):
            return
        path = Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"
        trainer.save_checkpoint(str(path), weights_only=False)  # full (resumable); said, not defaulted
        # Raised, not `trainer.should_stop = True`: on should_stop Lightning still validates and ends the
        # epoch, and ModelCheckpoint replaces this mid-epoch last.ckpt with one that says the epoch is
        # over (a resumed run would skip its remaining batches). An exception reaches fit's caller.
        self._stop(str(path), int(trainer.global_step))

    def _agree(self, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        """All processes stop at the same step (or test batch), or the ones still going would wait
        forever in a collective: whichever got the signal (a terminal's Ctrl-C, SLURM and torchrun
        reach every process, but not at the same instant), all agree on it here. One scalar
        all-reduce per optimizer step, only with several processes. Encoded as
        priority * 256 + signal, so the maximum is the signal every process stops for. Whether there
        is a signal to stop for."""
        if trainer.world_size > 1:
            mine = priority(self.received) * 256 + self.received if self.received else 0
            agreed = int(trainer.strategy.reduce(torch.tensor([mine], device=pl_module.device), reduce_op="max").item())
            self.received = agreed % 256 or None
        return self.received is not None

    def on_test_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.final_checkpoint is None or self.checkpoint is not None:
            return  # no final state to carry on from: the test goes on to the end
        batches = trainer.num_test_batches
        if batch_idx + 1 >= (batches[dataloader_idx] if isinstance(batches, list) else batches):
            return  # the last batch: completing costs less than a requeue
        if self._agree(trainer, pl_module):
            self._stop(self.final_checkpoint, int(trainer.global_step))

    def _stop(self, checkpoint: str, step: int) -> None:
        self.checkpoint, self.step = checkpoint, step
        stopped = self.outcome()
        assert stopped is not None
        raise stopped

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        self.latch.put_back(self._displaced)
        self._displaced = {}

    def outcome(self) -> StoppedBySignal | None:
        if self.received is None or self.checkpoint is None or self.step is None:
            return None
        return StoppedBySignal(self.received, self.step, self.checkpoint, self.latch.hand_over(self.received))
