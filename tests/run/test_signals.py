"""SIGTERM, the scheduler's preemption signal (submitit's USR2) and SIGINT sent to a training
`train.py` stop it at the next step, after writing a checkpoint that loads: exit status 128 + the
signal, a last stderr line saying at which step, no traceback, a summary with status preempted
(SIGTERM, USR2: a scheduler's) or interrupted (SIGINT: a person's), and a last.ckpt whose step
equals the summary's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO

pytestmark = pytest.mark.run


@pytest.mark.parametrize("signum,status", [(signal.SIGTERM, "preempted"), (signal.SIGUSR2, "preempted"),
                                           (signal.SIGINT, "interrupted")], ids=["SIGTERM", "USR2", "SIGINT"])
def test_a_signal_stops_the_run_gracefully_with_a_checkpoint(tmp_path, signum, status):
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "SUBMITIT_PREEMPT_SIGNAL")}
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), "trainer.max_epochs=30", "progress=plain", "progress_every_s=0.01",
         f"hydra.run.dir={run_dir}"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # wait until training is under way (a progress line per step)
            if re.search(r"epoch \d+\s+batch \d+/", line):
                break
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err[-2000:]
    name = signal.Signals(signum).name
    assert err.strip().splitlines()[-1].startswith(f"stopped by {name} at step ")
    assert "Traceback" not in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == status
    assert summary["attempts"][-1]["signal"] == name and summary["requeues"] == 0
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == summary["steps"] >= 1
