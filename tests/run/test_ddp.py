"""Two processes on CPU (gloo): started by Lightning and by torchrun, one run folder, rank 0 writes.

These start real processes (each imports torch and Lightning), so they are marked slow; CI runs them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, train_forked

pytestmark = [pytest.mark.run, pytest.mark.slow]

TWO_CPU_PROCESSES = ["trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu", "progress=plain"]


def _launch(command: list[str], root: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["OMP_NUM_THREADS"] = "1"  # two processes on two cores: one thread each
    return subprocess.run([*command, f"run.root={root}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _only_run_folder(root: Path) -> Path:
    folders = [p for p in (root / "runs").glob("*/*") if p.is_dir()]
    assert len(folders) == 1, f"one run folder for all ranks, found {folders}"
    return folders[0]


def test_ddp_started_by_lightning_trains_digits_with_the_global_batch_into_one_folder(tmp_path):
    result = _launch([sys.executable, str(REPO / "train.py"), *TWO_CPU_PROCESSES, "trainer.max_epochs=12"],
                     tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = _only_run_folder(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["processes"] == {"count": 2, "strategy": "DDPStrategy", "launched_by": "lightning"}
    # The batch rules see 64 per process x 2 processes: lr 0.004 at 256 -> sqrt(128/256) of it.
    hyper = summary["hyperparameters"]
    assert hyper["global_batch_size"] == 128
    assert math.isclose(hyper["lr"], 0.004 * math.sqrt(128 / 256), rel_tol=1e-9)
    assert math.isclose(hyper["weight_decay"], 0.2 * 128 / 256, rel_tol=1e-9)
    # The training digits (1,257) dealt to 2 processes, 64 each per step: 9 steps per epoch.
    assert summary["steps"] == 12 * (summary["data"]["sizes"]["train"] // 2 // 64) == 108
    # The accuracy band of one process (0.9889 on the test split after the default 30 epochs).
    assert summary["metrics"]["test"]["acc"] >= 0.95, summary["metrics"]
    assert summary["throughput"]["processes"] == 2
    # Rank 0 wrote the records; the other rank wrote no Hydra copy, log file or folder of its own.
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".hydra", "checkpoints", "config_resolved.yaml", "csv", "curves.png", "env.json", "run.json",
        "summary.json", "train.log"]
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert result.stdout.count("done: ") + result.stderr.count("done: ") == 1


def test_torchrun_ranks_agree_on_one_run_folder_and_rank_zero_writes(tmp_path):
    # Each rank starts as its own Hydra run here: without the shared launch time, each would name
    # its folder from its own clock (microseconds apart) and make a second one.
    result = _launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                      str(REPO / "train.py"), *TWO_CPU_PROCESSES, "trainer.max_epochs=1",
                      "trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"],
                     tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = _only_run_folder(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert summary["processes"] == {"count": 2, "strategy": "DDPStrategy", "launched_by": "torchrun"}
    assert summary["hyperparameters"]["global_batch_size"] == 128
    assert not list(run_dir.glob("*ddp_process*")) and len(list(tmp_path.rglob(".hydra"))) == 1
    assert result.stdout.count("done: ") + result.stderr.count("done: ") == 1


def test_a_multirun_of_ddp_jobs_started_here_is_refused_before_any_job_trains(tmp_path):
    sweep = tmp_path / "sweep"
    result = train_forked(["-m", *TWO_CPU_PROCESSES, "optimizer.lr=0.001,0.002", f"hydra.sweep.dir={sweep}"],
                          tmp_path / "x")
    assert result.returncode == 2, result
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(
        "error: trainer.devices: 2 processes per job inside a Hydra multirun started here")
    assert "hydra/launcher=slurm" in lines[0]
    assert not list(sweep.rglob("summary.json")) and not list(sweep.rglob("*.ckpt"))
