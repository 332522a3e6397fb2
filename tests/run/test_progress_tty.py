"""On a terminal the run shows Rich's live progress bar instead of plain lines."""

import os
import pty
import select
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.run


def test_rich_bar_on_a_terminal(tmp_path):
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(COLUMNS="120", TERM="xterm-256color")
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), "trainer.max_epochs=1", "trainer.limit_train_batches=5",
         "checkpointing=off", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO, env=env, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 300)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    os.close(master)
    screen = b"".join(chunks).decode("utf-8", "replace")
    assert proc.returncode == 0, screen[-3000:]
    assert "Epoch 0/0" in screen or "Epoch 0" in screen, screen[-3000:]
    assert "] epoch 1/1" not in screen  # no plain lines on a terminal
    assert (tmp_path / "run" / "summary.json").is_file()
