"""On a real one-node SLURM (tests/slurm/cluster.py): a run whose training outlasts its time limit
is signalled by SLURM (submitit's USR2, `signal_delay_s` before the limit), writes its checkpoint at
the next step, says `preempted`, is requeued by submitit into the same folder, carries on from that
checkpoint with resume=if_any, and completes, with final weights equal, tensor for tensor, to those
of a run that was never interrupted; its summary counts the requeues and the steps lost (none).
A run preempted during its test (the scheduler's USR2, sent through SLURM once summary.json says
the run is testing) stops at the end of that test batch, is requeued, finds its training over,
tests again and completes with the uninterrupted run's test metrics.
A two-job SLURM multirun ends with its comparison table.

SLURM's signal timing is coarse: slurmctld looks at time limits every 30 s, and a job was seen
signalled 42 s before a one-minute limit with `signal_delay_s` 30, so the signal comes anywhere in the
last `signal_delay_s` + 60 s. Each attempt must have started training before it: a requeued attempt
spends 15-30 s in imports and set-up on a loaded two-core machine, and with a one-minute limit (signal
0-30 s in) a CI run was requeued 8 times, 2 steps an attempt, and never finished. So the limit is two
minutes with the signal 10 s before it (signal 50-110 s into each attempt), and the first attempt is
made to outlast that (a test callback sleeps 2 s per step of it: wall time, not CPU). Nothing here
depends on when exactly the signal arrives, only that at least one does and that every attempt gets
past its set-up.

The requeue test spends two minutes or more waiting on that limit, so its job is submitted as the
module starts (`requeued_job`) and the module's other tests run while it waits, on the same cluster
(two jobs may share a CPU there: tests/slurm/cluster.py); the requeue test, last in the file,
collects it. The other tests start only once the job's first attempt has begun training (its
summary.json says so), so its set-up is as loaded as it was before."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from tests.helpers import ON_CPU, REPO, train_forked

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# Digits, 5 steps an epoch, 14 epochs: 70 steps of 2 s each in the first attempt (140 s of training
# after 15-30 s of set-up), which outlasts the first signal (50 to 110 s into the job: a 120 s limit,
# the signal 10 s before it, looked at every 30 s) by a margin. Deterministic CPU on one thread, as in the SIGKILL test (tests/run/test_resume.py),
# so that an interrupted run can equal an uninterrupted one.
RUN = [*ON_CPU, "trainer.max_epochs=14", "trainer.limit_train_batches=5", "trainer.limit_val_batches=2",
       "trainer.num_sanity_val_steps=1", "trainer.deterministic=true", "progress=plain", "logger=csv"]
FINAL_STEP = 70
SECONDS_PER_STEP = 2.0
#: What the README's requeue recipe sets, with a two-minute limit and the signal 10 s before it.
SLURM_LAUNCHER = ["hydra/launcher=slurm", "hydra.launcher.partition=debug", "hydra.launcher.gpus_per_node=0",
                  "hydra.launcher.timeout_min=2", "hydra.launcher.signal_delay_s=10"]


def submit(slurm, args: list[str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """`python train.py -m ARGS` on the login side, as a person would: it submits and waits."""
    env = {**slurm.env, "OMP_NUM_THREADS": "1"}  # one thread, as the forked reference run
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, str(REPO / "train.py"), "-m", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def weights(path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


REQUEUED = "test_a_run_that_outlasts_its_time_limit_is_requeued_and_equals_an_uninterrupted_one"


class Submission:
    """`python train.py -m ARGS` on the login side, as `submit` runs it, started without waiting: its
    output goes to files (a pipe nobody reads for minutes could fill), and a thread notes when it ends,
    so that the wall time from submission to done is the submission's own, not when a test asked."""

    def __init__(self, slurm, args: list[str], folder: Path) -> None:  # type: ignore[no-untyped-def]
        env = {**slurm.env, "OMP_NUM_THREADS": "1"}  # one thread, as the forked reference run
        env.pop("HYDRA_FULL_ERROR", None)
        self.folder = folder
        self.sweep = folder / "sweep"
        self._out, self._err = open(folder / "login.out", "w+"), open(folder / "login.err", "w+")  # noqa: SIM115
        self.started = time.monotonic()
        self.ended: float | None = None
        self.process = subprocess.Popen([sys.executable, str(REPO / "train.py"), "-m", *args,
                                         f"hydra.sweep.dir={self.sweep}"], cwd=REPO, env=env, stdout=self._out,
                                        stderr=self._err, text=True)
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        self.process.wait()
        self.ended = time.monotonic()

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read()

    def result(self, timeout: float) -> tuple[subprocess.CompletedProcess[str], float]:
        """The finished submission (waited for up to `timeout` s more) and its wall time from submission."""
        self.process.wait(timeout)
        while self.ended is None:
            time.sleep(0.01)
        self._out.seek(0)
        done = subprocess.CompletedProcess(self.process.args, self.process.returncode, self._out.read(), self.stderr())
        return done, self.ended - self.started

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._out.close()
        self._err.close()


@pytest.fixture(scope="module", autouse=True)
def requeued_job(slurm, request: pytest.FixtureRequest,  # type: ignore[no-untyped-def]
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Submission | None]:
    """The requeue test's job, submitted before the module's first test (None where that test is not
    run): it spends two minutes or more waiting on its time limit, during which the other tests run.
    They start once its first attempt has begun training (summary.json written, phase training), so
    that its set-up, which must end well before the first signal, competes with no more than before."""
    if not any(item.name == REQUEUED for item in request.session.items):
        yield None
        return
    folder = tmp_path_factory.mktemp("requeued")
    submission = Submission(slurm, [*SLURM_LAUNCHER, "hydra.launcher.cpus_per_task=2",
                                    "hydra.launcher.max_num_timeout=8", "resume=if_any", *RUN,
                                    f"run.root={folder}", "run.name=requeued",
                                    "+callbacks.pace._target_=tests.slurm.pace.StepPace",
                                    f"+callbacks.pace.seconds_per_step={SECONDS_PER_STEP}"], folder)
    try:
        _wait_for_phase(submission.sweep / "0" / "summary.json", "training", submission.process.poll,
                        submission.stderr, timeout=600)
        yield submission
    finally:
        submission.stop()


def test_a_run_preempted_during_its_test_is_requeued_tests_again_and_completes(slurm, tmp_path):
    sweep = tmp_path / "sweep"
    # 4 epochs of 5 steps at full speed; the first attempt's 5 test batches take 3 s each.
    run = [*RUN, "trainer.max_epochs=4", f"run.root={tmp_path}", "run.name=tested"]
    env = {**slurm.env, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    login = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), "-m", *SLURM_LAUNCHER, "hydra.launcher.timeout_min=10",
         "hydra.launcher.cpus_per_task=2", "resume=if_any", *run, "+callbacks.pace._target_=tests.slurm.pace.StepPace",
         "+callbacks.pace.seconds_per_test_batch=3", f"hydra.sweep.dir={sweep}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        job_id = _wait_for_phase(sweep / "0" / "summary.json", "testing", login.poll, lambda: login.stderr.read(),
                                 timeout=600)
        slurm.command("scancel", "--signal=USR2", job_id)  # what SLURM sends a job it preempts (submitit's signal)
        out, err = login.communicate(timeout=600)
    finally:
        if login.poll() is None:
            login.kill()
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((sweep / ".submitit").rglob("*.err")))
    assert login.returncode == 0, f"{err[-3000:]}\n{logs}\n{slurm.log_tail()}"

    summary = json.loads((sweep / "0" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 20, summary["attempts"]
    first, second = summary["attempts"]
    assert (first["status"], first["stopped_in"], first["signal"], first["steps"]) == (
        "preempted", "testing", "SIGUSR2", 20), first
    assert second["resumed_from_step"] == 20 and second["slurm_job_id"] == first["slurm_job_id"] == job_id
    assert summary["requeues"] == 1 and summary["steps_lost"] == 0

    reference_root = tmp_path / "reference"
    reference = train_forked([*RUN, "trainer.max_epochs=4", f"run.root={reference_root}", "run.name=reference",
                              "progress=off"], reference_root / "run")
    assert reference.returncode == 0, reference
    assert summary["metrics"]["test"] == reference.summary["metrics"]["test"]
    assert summary["metrics"]["val"] == reference.summary["metrics"]["val"]


def _wait_for_phase(path, phase: str, ended: Callable[[], int | None], said: Callable[[], str],  # type: ignore[no-untyped-def]
                    timeout: float) -> str:
    """Poll a job's summary.json until it says `phase`; the SLURM job id of that attempt. `ended` is the
    submission's poll (not None: it ended first), `said` its stderr."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert ended() is None, f"the submission ended first: {said()[-3000:]}"
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            summary = {}
        if summary.get("phase") == phase:
            return str(summary["attempts"][-1]["slurm_job_id"])
        time.sleep(0.2)
    raise TimeoutError(f"{path} never said phase {phase} within {timeout} s")


def test_a_two_job_slurm_multirun_ends_with_its_comparison_table(slurm, tmp_path):
    sweep = tmp_path / "sweep"
    done = submit(slurm, [*SLURM_LAUNCHER, "hydra.launcher.timeout_min=5", "hydra.launcher.cpus_per_task=1",
                          *ON_CPU, "trainer.max_epochs=1", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1",
                          "trainer.limit_test_batches=1", "checkpointing=off", "progress=off", "seed=1,2",
                          f"run.root={tmp_path}", f"hydra.sweep.dir={sweep}"], timeout=600)
    assert done.returncode == 0, f"{done.stderr[-3000:]}\n{slurm.log_tail()}"
    for job in ("0", "1"):
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["attempts"][0]["slurm_job_id"]
    table = (sweep / "comparison.md").read_text()
    assert "seed=1" in table and "seed=2" in table


def test_a_run_that_outlasts_its_time_limit_is_requeued_and_equals_an_uninterrupted_one(slurm, requeued_job,
                                                                                         tmp_path):
    # Submitted as the module started (requeued_job), as `python train.py -m ...` on the login side.
    # The uninterrupted reference trains first, while the job still waits on its time limit; then the
    # submission is waited for, however long its requeues take.
    reference_root = tmp_path / "reference"
    reference = train_forked([*RUN, f"run.root={reference_root}", "run.name=reference", "progress=off"],
                             reference_root / "run")
    sweep = requeued_job.sweep
    done, wall = requeued_job.result(timeout=900)
    job = sweep / "0"
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((sweep / ".submitit").rglob("*.err")))
    assert done.returncode == 0, f"{done.stderr[-3000:]}\n{logs}\n{slurm.log_tail()}"

    summary = json.loads((job / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == FINAL_STEP, summary["attempts"]
    attempts = summary["attempts"]
    assert summary["requeues"] >= 1 and summary["requeues"] == len(attempts) - 1, attempts
    assert summary["preemptions"] == summary["requeues"]
    assert attempts[0]["steps"] < FINAL_STEP  # the first attempt was cut short by the time limit
    assert all(a["status"] == "preempted" and a["signal"] == "SIGUSR2" for a in attempts[:-1]), attempts
    assert summary["steps_lost"] == 0  # each checkpoint was written at the step the attempt stopped at
    assert len({a["slurm_job_id"] for a in attempts}) == 1  # one SLURM job, requeued
    for before, after in zip(attempts, attempts[1:]):
        assert after["resumed_from_step"] == before["steps"] > 0
    assert [a["attempt"] for a in attempts] == list(range(1, len(attempts) + 1))

    assert reference.returncode == 0, reference
    final, expected = weights(job / "checkpoints" / "last.ckpt"), weights(reference_root / "run" / "checkpoints"
                                                                          / "last.ckpt")
    assert final.keys() == expected.keys()
    different = [k for k in final if not torch.equal(final[k], expected[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"

    # The figures docs/scale-out.md quotes, from this test's run (pytest -s shows them).
    figures = {"time_limit_min": 2, "signal_delay_s": 10, "steps": FINAL_STEP, "seconds_per_step": SECONDS_PER_STEP,
               "requeues": summary["requeues"], "steps_lost": summary["steps_lost"],
               "stopped_at_steps": [a["steps"] for a in attempts[:-1]], "wall_time_s": round(wall, 1)}
    (tmp_path / "figures.json").write_text(json.dumps(figures, indent=2))
    print(f"\nSLURM requeue figures: {json.dumps(figures)}")
