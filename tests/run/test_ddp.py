"""Two processes on CPU (gloo): started by Lightning and by torchrun, one run folder, rank 0 writes.

Started by Lightning, the default run trains digits to test accuracy >= 0.95 in one run folder
with the lr and weight decay of the global batch of 128, rank 0 alone writing. Started by torchrun
and crashed in step 43, it leaves one folder, a failed summary and a mid-epoch last.ckpt, from
which a resumed run ends with weights equal, tensor for tensor, to the uninterrupted run's.
Preempted with USR2 reaching only one of them, both stop at the same step, and the run carries on
from there exactly. Killed outright (both processes at once, as a lost node) at three seeded
moments one after the other, during training, during the resumed run's test and halfway through the
next resume's completed summary, it completes with resume=if_any to the uninterrupted run's weights
and metrics. A multirun of DDP jobs started on this machine is refused in one line before any job trains.

These start real processes (each imports torch and Lightning), so they are marked slow; CI runs them.
The runs started by Lightning have rank 0 forked from this pytest process (tests.helpers.ddp_forked), and
Lightning's launcher starts rank 1 as always, its interpreter a stand-in that forks it from this process
too (no rank imports torch and Lightning again). One of them, the batch-size test,
is launched wholly as a person does (`python train.py`). torchrun's runs are torchrun's (its
rendezvous, its worker processes and their sessions, its report of how they ended), torchrun itself
forked from this process, and the interpreter it starts each rank with a stand-in that forks the rank
from this process too.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, ddp_forked, launch_with_forked_ranks, train_forked

pytestmark = [pytest.mark.run, pytest.mark.slow]

TWO_CPU_PROCESSES = ["trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu", "progress=plain"]


def _launch(command: list[str], root: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["OMP_NUM_THREADS"] = "1"  # two processes on two cores: one thread each
    # A session of its own: a job that kills its process group (KillJobAt) takes only itself.
    return subprocess.run([*command, f"run.root={root}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, start_new_session=True)


def _torchrun(args: list[str], root: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m torch.distributed.run --standalone --nproc-per-node=2 train.py ARGS run.root=ROOT`:
    torchrun in a process group of its own (as `_launch`'s session gave it), starting its two ranks as
    always; it and each rank forked from this process (the ranks through the interpreter torchrun is
    given, PYTHON_EXEC: tests.helpers.launch_with_forked_ranks) rather than new interpreters
    importing torch and Lightning again."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["OMP_NUM_THREADS"] = "1"
    [done] = launch_with_forked_ranks([["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                        str(REPO / "train.py"), *args, f"run.root={root}"]], env, timeout=timeout)
    return done


def _only_run_folder(root: Path) -> Path:
    folders = [p for p in (root / "runs").glob("*/*") if p.is_dir()]
    assert len(folders) == 1, f"one run folder for all ranks, found {folders}"
    return folders[0]


# The default run on two processes, 8 epochs of 9 steps (test accuracy 0.996 measured). The reference is started by Lightning;
# the crashed run by torchrun; the resumed one by Lightning again.
REFERENCE = [*TWO_CPU_PROCESSES, "trainer.max_epochs=8", "trainer.deterministic=true"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ddp_reference")
    result = ddp_forked(REFERENCE, root)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("done: ") + result.stderr.count("done: ") == 1  # rank 0 alone reports
    return _only_run_folder(root)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def test_ddp_started_by_lightning_trains_digits_with_the_global_batch_into_one_folder(reference):
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["processes"] == {"count": 2, "strategy": "DDPStrategy", "launched_by": "lightning"}
    # The batch rules see 64 per process x 2 processes: lr 0.004 at 256 -> sqrt(128/256) of it.
    hyper = summary["hyperparameters"]
    assert hyper["global_batch_size"] == 128
    assert math.isclose(hyper["lr"], 0.004 * math.sqrt(128 / 256), rel_tol=1e-9)
    assert math.isclose(hyper["weight_decay"], 0.2 * math.sqrt(128 / 256), rel_tol=1e-9)
    # The training digits (1,257) dealt to 2 processes, 64 each per step: 9 steps per epoch.
    assert summary["steps"] == 8 * (summary["data"]["sizes"]["train"] // 2 // 64) == 72
    # One process reaches 0.98 or more on the test split in the default 10 epochs; two, a little less.
    assert summary["metrics"]["test"]["acc"] >= 0.95, summary["metrics"]
    assert summary["throughput"]["processes"] == 2
    # Rank 0 wrote the records; the other rank wrote no Hydra copy, log file or folder of its own.
    assert sorted(p.name for p in reference.iterdir()) == [
        ".hydra", "checkpoints", "config_resolved.yaml", "csv", "curves.png", "env.json", "run.json",
        "summary.json", "train.log"]
    assert (reference / "checkpoints" / "last.ckpt").is_file()


def test_crashed_under_torchrun_and_resumed_mid_epoch_equals_the_uninterrupted_run(reference, tmp_path):
    # Started by torchrun, each rank is its own Hydra run: without the shared launch time each would
    # name its folder from its own clock and make a second one. Both ranks crash in step 43; the
    # last checkpoint is of step 40, four steps into the fifth epoch.
    crashed_root = tmp_path / "crashed"
    crashed = _torchrun([*REFERENCE, "model._target_=tests.helpers.ExplodingCNN", "+model.fail_at=43",
                         "checkpointing.every_n_steps=4"], crashed_root)
    assert crashed.returncode != 0 and "simulated crash in the forward pass" in crashed.stderr
    folder = _only_run_folder(crashed_root)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 42
    assert summary["processes"] == {"count": 2, "strategy": "DDPStrategy", "launched_by": "torchrun"}
    assert not list(folder.glob("*ddp_process*")) and len(list(crashed_root.rglob(".hydra"))) == 1
    checkpoint = folder / "checkpoints" / "last.ckpt"
    position = torch.load(checkpoint, map_location="cpu", weights_only=True)["DigitsDataModule"]["train_position"]
    assert position == {"epoch": 4, "batches": 4, "items": 512, "items_per_batch": 64, "replicas": 2, "size": 1257}

    resumed_root = tmp_path / "resumed"
    resumed = ddp_forked([*REFERENCE, f"resume={checkpoint}"], resumed_root)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    folder = _only_run_folder(resumed_root)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["resumed_from"]["global_step"] == 40 and summary["resumed_from"]["mid_epoch"]
    assert summary["steps"] == 72
    expected, got = _weights(reference / "checkpoints" / "last.ckpt"), _weights(folder / "checkpoints" / "last.ckpt")
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected), "resumed weights differ from the reference"


def test_preempting_one_process_stops_both_at_the_same_step_and_the_run_carries_on_exactly(reference, tmp_path):
    # Under torchrun, only rank 1 gets submitit's USR2, during step 23 (the fifth step of epoch 2):
    # both ranks agree at the end of that step, rank 0 writes last.ckpt there, both stop.
    preempted_root = tmp_path / "preempted"
    preempted = _torchrun([*REFERENCE, "model._target_=tests.helpers.PreemptedCNN", "+model.signal_at=23"],
                          preempted_root)
    assert preempted.returncode != 0 and "stopped by SIGUSR2 at step 23" in preempted.stderr, preempted.stderr[-3000:]
    # The one traceback is torchrun's own report of children that exited non-zero (140).
    assert preempted.stderr.count("Traceback") == 1 and "ChildFailedError" in preempted.stderr
    folder = _only_run_folder(preempted_root)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["steps"] == 23
    checkpoint = folder / "checkpoints" / "last.ckpt"
    assert torch.load(checkpoint, map_location="cpu", weights_only=True)["global_step"] == 23

    resumed_root = tmp_path / "resumed"
    resumed = ddp_forked([*REFERENCE, f"resume={checkpoint}"], resumed_root)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((_only_run_folder(resumed_root) / "summary.json").read_text())
    assert summary["steps"] == 72 and summary["steps_lost"] == 0 and summary["requeues"] == 1
    expected = _weights(reference / "checkpoints" / "last.ckpt")
    got = _weights(_only_run_folder(resumed_root) / "checkpoints" / "last.ckpt")
    assert all(torch.equal(expected[k], got[k]) for k in expected), "resumed weights differ from the reference"


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


def test_batch_size_auto_gives_both_processes_rank_zeros_batch(tmp_path):
    """data.batch_size=auto on two CPU processes: rank 0 sizes the batch and writes it into the run
    folder, the other rank reads it (a rank with another batch would run another number of steps per
    epoch, and the run would hang at the epoch's end instead of completing)."""
    result = _launch([sys.executable, str(REPO / "train.py"), *TWO_CPU_PROCESSES, "data.batch_size=auto",
                      "data.memory_budget_gb=0.02", "trainer.max_epochs=2"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    folder = _only_run_folder(tmp_path)
    summary = json.loads((folder / "summary.json").read_text())
    batch = summary["derived"]["data.batch_size"]["value"]
    assert json.loads((folder / "batch_size_auto.json").read_text())["batch_size"] == batch
    assert summary["derived"]["global_batch_size"]["value"] == 2 * batch and summary["status"] == "completed"


@pytest.mark.parametrize("launcher", ["lightning", "torchrun"])
def test_lr_find_gives_both_processes_rank_zeros_lr(tmp_path, launcher):
    """optimizer.lr=find on two CPU processes: rank 0 alone runs the range test, at its batch of 64,
    and writes lr_find.json; the other rank reads it; both train with that lr moved to the global
    batch of 128 by AdamW's sqrt rule. Under torchrun the other rank waits while rank 0 tests (the
    process group exists already, and the test must not use it)."""
    lrs = tmp_path / "lrs"
    args = [*TWO_CPU_PROCESSES, "optimizer.lr=find", "optimizer.find_steps=20", "trainer.max_epochs=1",
            "trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
            "checkpointing=off", "+callbacks.lr._target_=tests.helpers.RecordLr", f"+callbacks.lr.folder={lrs}"]
    if launcher == "lightning":
        result = ddp_forked(args, tmp_path, timeout=180)
    else:
        result = _torchrun(args, tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    folder = _only_run_folder(tmp_path)
    record = json.loads((folder / "lr_find.json").read_text())
    assert record["batch_size"] == 64 and (folder / "lr_find.png").is_file()
    assert (result.stdout + result.stderr).count("Lightning's lr range test, 20 steps") == 1  # rank 0 alone
    lr = record["lr"] * math.sqrt(128 / 64)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["derived"]["optimizer.lr"]["value"] == pytest.approx(lr, abs=1e-10)
    assert summary["derived"]["global_batch_size"]["value"] == 128 and summary["status"] == "completed"
    used = {rank: json.loads((lrs / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    assert used[0] == used[1] == [pytest.approx(lr, rel=1e-12)] * 2


def test_killed_at_three_moments_resumes_to_the_uninterrupted_result(reference, tmp_path):
    """Both processes killed at once (SIGKILL to the job's process group from rank 0) at a drawn
    training step, then, resumed with `resume=if_any`, as a drawn test batch ends, then, resumed
    again, halfway through writing the completed summary; the last resume completes the run with the
    uninterrupted run's final weights and train, validation and test metrics. One chain of four
    launches, not three pairs: each resume but the last must carry its run on to the next moment (a
    resume after a resume), and two launches of two processes are saved. Checkpoints every 4 steps,
    so a resume inside an epoch also restores each process's running training metrics."""
    seed = int(os.environ.get("KILL_SEED") or random.SystemRandom().randrange(10**6))
    draw = random.Random(seed)
    expected = json.loads((reference / "summary.json").read_text())
    # The step from the first checkpoint on (every 4 steps): a kill before it leaves nothing to resume
    # from, the next launch starts afresh and its record has no killed attempt (seen with KILL_SEED=123094,
    # step 1: a failure of the attempts check below, not of the resume).
    step, batch = draw.randint(4, expected["steps"] - 1), draw.randint(1, 3)  # 135 test samples a process: 3 batches
    print(f"\nDDP kill draw: KILL_SEED={seed}: step {step}, test batch {batch}, the summary")
    expected_weights = _weights(Path(expected["final_checkpoint"]))
    root = tmp_path / "killed"
    args = [*REFERENCE, "run.name=killed", "checkpointing.every_n_steps=4"]
    for launch, (moment, number) in enumerate((("step", step), ("test_batch", batch), ("summary", 0))):
        killed = ddp_forked([*args, *(["resume=if_any"] if launch else []), "+callbacks.kill._target_=tests.helpers.KillJobAt",
                             f"+callbacks.kill.moment={moment}", f"+callbacks.kill.number={number}"], root)
        assert killed.returncode == -9, (moment, killed.stderr[-3000:])
    resumed = ddp_forked([*args, "resume=if_any"], root)
    assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    summaries = sorted(root.glob("runs/*/*/summary.json"), key=lambda p: p.stat().st_mtime_ns)
    summary = json.loads(summaries[-1].read_text())
    assert summary["status"] == "completed" and summary["steps"] == expected["steps"]
    # The launches killed in training and in the test are killed attempts; the third was killed after
    # its run had completed (writing the completed summary), which the last launch finds and keeps.
    assert [a["status"] for a in summary["attempts"]][:2] == ["killed", "killed"], summary["attempts"]
    assert {k: v for k, v in summary["metrics"].items() if k != "perf"} == \
        {k: v for k, v in expected["metrics"].items() if k != "perf"}
    got = _weights(Path(summary["final_checkpoint"]))
    assert all(torch.equal(expected_weights[k], got[k]) for k in expected_weights)
