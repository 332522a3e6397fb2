"""SIGTERM, the scheduler's preemption signal (submitit's USR2) and SIGINT sent to a training
`train.py` stop it at the next step, after writing a checkpoint that loads: exit status 128 + the
signal, a last stderr line saying at which step, no traceback, a summary with status preempted
(SIGTERM, USR2: a scheduler's) or interrupted (SIGINT: a person's), and a last.ckpt whose step
equals the summary's.

The run is `python train.py` in a forked child of this process (tests.helpers.ForkedRun, on the CPU),
with the signal dispositions a new interpreter starts with: what is tested is how the run handles a
signal sent to its process, not the interpreter's start (which `train.py`'s other tests cover), and a
fork saves each case its import of torch and Lightning."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
import torch

from tests.helpers import ForkedRun, new_interpreter_signals, train_py_argv

pytestmark = pytest.mark.run


@pytest.mark.parametrize("signum,status", [(signal.SIGTERM, "preempted"), (signal.SIGUSR2, "preempted"),
                                           (signal.SIGINT, "interrupted")], ids=["SIGTERM", "USR2", "SIGINT"])
def test_a_signal_stops_the_run_gracefully_with_a_checkpoint(tmp_path, signum, status):
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "SUBMITIT_PREEMPT_SIGNAL")}
    argv = train_py_argv(["trainer.max_epochs=30", "progress=plain", "progress_every_s=0.01"], run_dir)
    with ForkedRun(argv, run_dir, setup=new_interpreter_signals, env=env) as child:
        deadline = time.monotonic() + 120
        # wait until training is under way (a progress line per step)
        while not re.search(r"epoch \d+\s+batch \d+/", child.output()):
            assert not child.done() and time.monotonic() < deadline, "no progress line before the run ended"
            time.sleep(0.02)
        child.send_signal(signum)
        done = child.wait(timeout=120)
    err = done.stderr
    assert done.returncode == 128 + signum, err[-2000:]
    name = signal.Signals(signum).name
    assert err.strip().splitlines()[-1].startswith(f"stopped by {name} at step ")
    assert "Traceback" not in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == status
    assert summary["attempts"][-1]["signal"] == name and summary["requeues"] == 0
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == summary["steps"] >= 1
