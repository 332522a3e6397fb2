"""The run record every phase reads and adds to: `Run`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from trainer.callbacks.graceful import SignalLatch
from trainer.configuration.spec import RunSpec
from trainer.infra.devices import Devices
from trainer.infra.summary import RunRecord
from trainer.phases.compose import Job
from trainer.phases.plan import Plan
from trainer.phases.products import Built, Identity, Parts
from trainer.task import TrainingTask


@dataclass
class Run:
    """One run as it goes through the phases (trainer/run.py; docs/architecture.md, "A run"): the job
    Hydra composed, then what each phase adds. A field is there once its phase has run; reading it
    earlier is an AttributeError."""

    job: Job
    latch: SignalLatch
    started: float = field(default_factory=time.perf_counter)
    spec: RunSpec = field(init=False)
    devices: Devices = field(init=False)
    #: Whether this process writes the run's records (rank 0 of several).
    rank_zero: bool = field(init=False)
    identity: Identity = field(init=False)
    parts: Parts = field(init=False)
    plan: Plan = field(init=False)
    task: TrainingTask = field(init=False)
    #: What the prepare phase recorded: the environment fingerprint, the network's size and alignment.
    environment: dict[str, Any] = field(init=False)
    model_facts: dict[str, Any] = field(init=False)
    built: Built = field(init=False)
    record: RunRecord = field(init=False)
