"""Which signals stop a run, and which of them come from a scheduler.

A SLURM job under submitit gets USR2 (or the signal `SUBMITIT_PREEMPT_SIGNAL` names) ahead of its
time limit or a preemption, and SIGTERM when it is stopped; a person sends SIGINT (Ctrl-C). The
training process acts on them at a step boundary (trainer/callbacks/graceful.py); loader workers
leave them to it (trainer/data/loader.py)."""

from __future__ import annotations

import os
import signal

PREEMPT_SIGNAL_ENV = "SUBMITIT_PREEMPT_SIGNAL"


def preemption_signal() -> signal.Signals:
    """The signal a scheduler sends ahead of preempting or timing out a job: submitit's, USR2 unless
    `SUBMITIT_PREEMPT_SIGNAL` names another (as submitit itself reads it)."""
    name = os.environ.get(PREEMPT_SIGNAL_ENV, "USR2").upper()
    return getattr(signal.Signals, name if name.startswith("SIG") else f"SIG{name}", signal.SIGUSR2)


def is_preemption(signum: int) -> bool:
    """A scheduler taking the machine back (the job may come back), not a person stopping it."""
    return signum in (signal.SIGTERM, preemption_signal())


def priority(signum: int) -> int:
    """Which of two signals a run stops for: a person's Ctrl-C over the scheduler's preemption signal
    (which may requeue the job) over a plain SIGTERM."""
    return {signal.SIGINT: 3, preemption_signal(): 2, signal.SIGTERM: 1}.get(signal.Signals(signum), 0)
