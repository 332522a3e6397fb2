"""When the signal stop and the periodic checkpoint write: at optimizer-step boundaries only."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
import torch

from trainer.callbacks.graceful import GracefulStop, StoppedBySignal
from trainer.groups.checkpointing import PeriodicCheckpoint
from trainer.infra.signals import priority


class FakeTrainer(SimpleNamespace):
    """`other_signal`: a second process, which received that signal number (0: none)."""

    def __init__(self, accumulate: int = 1, other_signal: int | None = None) -> None:
        self.reductions = 0

        def reduce(tensor, reduce_op="sum"):
            assert reduce_op == "max"
            self.reductions += 1
            theirs = priority(other_signal) * 256 + other_signal if other_signal else 0
            return torch.maximum(tensor, torch.tensor([theirs]))

        super().__init__(global_step=0, accumulate_grad_batches=accumulate, num_training_batches=float("inf"), should_stop=False, sanity_checking=False,
                         default_root_dir="/run", saved=[], world_size=1 if other_signal is None else 2,
                         strategy=SimpleNamespace(broadcast=lambda value: value, reduce=reduce))

    def save_checkpoint(self, path: str, weights_only: bool | None = None) -> None:
        self.saved.append((path, self.global_step))


MODULE = SimpleNamespace(device=torch.device("cpu"))


def batches(callback, trainer: FakeTrainer, count: int, steps_on: set[int]) -> None:
    """`count` training batches; the optimizer steps on the batches in `steps_on` (1-based)."""
    for batch in range(1, count + 1):
        if hasattr(callback, "on_train_batch_start"):
            callback.on_train_batch_start(trainer, MODULE, None, batch - 1)
        if batch in steps_on:
            trainer.global_step += 1
        callback.on_train_batch_end(trainer, MODULE, None, None, batch - 1)


def test_a_signal_under_gradient_accumulation_waits_for_the_optimizer_step():
    stop, trainer = GracefulStop(), FakeTrainer(accumulate=4)
    stop.received = signal.SIGTERM  # arrived during the first batch of an accumulation of four
    batches(stop, trainer, 3, steps_on=set())
    assert trainer.saved == [] and not trainer.should_stop  # the summed gradients are in no checkpoint
    with pytest.raises(StoppedBySignal) as stopped:  # Lightning passes it on to fit's caller
        batches(stop, trainer, 1, steps_on={1})
    assert trainer.saved == [("/run/checkpoints/last.ckpt", 1)] and stopped.value.step == 1


def test_with_several_processes_a_signal_to_any_stops_all_at_the_same_step():
    stop, trainer = GracefulStop(), FakeTrainer(accumulate=2, other_signal=0)
    batches(stop, trainer, 4, steps_on={2, 4})  # no signal anywhere: two agreements, no stop
    assert trainer.reductions == 2 and trainer.saved == [] and not trainer.should_stop
    # Only the other process got SIGTERM: this one stops after the same optimizer step.
    other = FakeTrainer(accumulate=2, other_signal=int(signal.SIGTERM))
    with pytest.raises(StoppedBySignal) as stopped:
        batches(stop, other, 2, steps_on={2})
    assert other.reductions == 1 and other.saved == [("/run/checkpoints/last.ckpt", 1)]
    assert stopped.value.signum == signal.SIGTERM


def test_the_processes_agree_on_the_preemption_signal_over_a_plain_sigterm():
    # One process got SIGTERM, another submitit's USR2: all stop for USR2, whose handler requeues.
    stop, other = GracefulStop(), FakeTrainer(other_signal=int(signal.SIGUSR2))
    stop.received = signal.SIGTERM
    with pytest.raises(StoppedBySignal) as stopped:
        batches(stop, other, 1, steps_on={1})
    assert stopped.value.signum == signal.SIGUSR2


def test_a_signal_on_the_last_batch_of_an_epoch_stops_after_the_next_epochs_first_step():
    # Written before the epoch's validation and end, a checkpoint on its last batch may read back as
    # mid-epoch (an epoch cut short by limit_train_batches); the epoch end writes one first.
    stop, trainer = GracefulStop(), FakeTrainer()
    trainer.num_training_batches = 3
    stop.received = signal.SIGUSR2
    batches(stop, trainer, 3, steps_on={3})  # batch 3 of 3: the last of the epoch
    assert trainer.saved == []
    with pytest.raises(StoppedBySignal) as stopped:
        batches(stop, trainer, 1, steps_on={1})  # the next epoch's first batch
    assert trainer.saved == [("/run/checkpoints/last.ckpt", 2)] and stopped.value.step == 2


def test_periodic_checkpoint_every_n_steps_once_per_step():
    periodic, trainer = PeriodicCheckpoint("/run/checkpoints", every_n_steps=2, every_minutes=None), FakeTrainer(2)
    batches(periodic, trainer, 12, steps_on={2, 4, 6, 8, 10, 12})  # accumulation of 2: 6 steps
    assert trainer.saved == [("/run/checkpoints/last.ckpt", 2), ("/run/checkpoints/last.ckpt", 4),
                             ("/run/checkpoints/last.ckpt", 6)]


def test_periodic_checkpoint_by_time(monkeypatch):
    clock = {"now": 1000.0}
    monkeypatch.setattr("trainer.groups.checkpointing.time.monotonic", lambda: clock["now"])
    periodic, trainer = PeriodicCheckpoint("/ckpt", every_n_steps=None, every_minutes=1), FakeTrainer()
    periodic.on_train_start(trainer, None)
    for _ in range(5):  # 25 s a step: due after the third step (75 s), then again 60 s later
        clock["now"] += 25
        batches(periodic, trainer, 1, steps_on={1})
    assert [step for _, step in trainer.saved] == [3]
