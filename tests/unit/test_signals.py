"""The stop signals: which one a run stops for, submitit's handler kept and called once the run has
recorded its end, loader workers that leave the signals to the training process, and the attempts
of a preempted and requeued run counted in its summary."""

from __future__ import annotations

import json
import os
import signal

import pytest

from trainer.infra import attempts
from trainer.callbacks.graceful import SignalLatch
from trainer.data.loader import WorkerStart
from trainer.infra.signals import preemption_signal


@pytest.fixture
def restored_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_the_preemption_signal_is_submitits(monkeypatch):
    monkeypatch.delenv("SUBMITIT_PREEMPT_SIGNAL", raising=False)
    assert preemption_signal() == signal.SIGUSR2
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR1")
    assert preemption_signal() == signal.SIGUSR1


def test_the_latch_records_signals_and_hands_the_preemption_to_the_handler_before_it(restored_handlers):
    calls = []
    signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append(signum))  # as submitit's would be
    latch = SignalLatch()
    latch.install()
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGUSR2)
    assert latch.received == signal.SIGUSR2 and calls == []  # recorded, not acted on; USR2 outranks SIGTERM
    assert latch.hand_over(signal.SIGTERM) is None  # SIGTERM: nobody to hand over to
    latch.hand_over(signal.SIGUSR2)()
    assert calls == [signal.SIGUSR2]
    os.kill(os.getpid(), signal.SIGINT)
    assert latch.received == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):  # asked twice: at once
        os.kill(os.getpid(), signal.SIGINT)
    latch.uninstall()
    os.kill(os.getpid(), signal.SIGUSR2)
    assert calls == [signal.SIGUSR2, signal.SIGUSR2]  # the handler from before the run is back


def test_loader_workers_ignore_the_schedulers_signals(restored_handlers):
    WorkerStart(rank=0)(worker_id=0)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    assert signal.getsignal(preemption_signal()) == signal.SIG_IGN


def test_attempts_of_a_preempted_requeued_and_killed_run(tmp_path):
    folder = tmp_path / "run"
    (folder / "checkpoints").mkdir(parents=True)
    checkpoint = folder / "checkpoints" / "last.ckpt"
    assert attempts.earlier_attempts(None, None) == []

    first = attempts.ended(attempts.this_attempt(1, None), "preempted", 40, signal.SIGUSR2)
    (folder / "summary.json").write_text(json.dumps({"status": "preempted", **attempts.totals([first])}))
    earlier = attempts.earlier_attempts(checkpoint, 40)  # the checkpoint of the step it stopped at
    assert earlier[0]["steps_lost"] == 0 and earlier[0]["signal"] == "SIGUSR2"

    second = attempts.this_attempt(2, 40)  # killed outright: its summary still says running
    (folder / "summary.json").write_text(json.dumps({"status": "running", **attempts.totals([*earlier, second])}))
    earlier = attempts.earlier_attempts(checkpoint, 50)
    assert [a["status"] for a in earlier] == ["preempted", "killed"] and earlier[1]["steps_lost"] is None

    final = attempts.totals([*earlier, attempts.ended(attempts.this_attempt(3, 50), "completed", 90)])
    assert final["requeues"] == 2 and final["preemptions"] == 1 and final["steps_lost"] is None
    assert [a["attempt"] for a in final["attempts"]] == [1, 2, 3]


def test_steps_lost_count_the_work_done_past_the_checkpoint_resumed_from(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed", "steps": 57}))  # an older summary
    earlier = attempts.earlier_attempts(tmp_path / "checkpoints" / "last.ckpt", 50)
    assert earlier == [{"status": "failed", "steps": 57, "steps_lost": 7}]
    assert attempts.totals([*earlier, attempts.this_attempt(2, 50)])["steps_lost"] == 7
