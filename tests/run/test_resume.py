"""A run killed with SIGKILL at any moment and resumed with resume=auto ends with the same weights
as a run that was never interrupted (deterministic CPU settings: one thread, the same seed). It is
killed at four moments: two mid-epoch, halfway through writing a checkpoint, just after an
epoch's checkpoint; the weights are compared tensor for tensor. resume=auto with nothing to find,
and a checkpoint of another model, are one line each."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Callable

import pytest
import torch

from tests.helpers import ON_CPU, kill_during_save, train_forked

pytestmark = pytest.mark.run

# Digits, 5 batches an epoch, 3 epochs; last.ckpt every 2 steps inside epochs, and at each epoch end
# (with the best checkpoint). The device-side random shifts draw from the global torch RNG, so an
# RNG state that is not restored shows up in the weights. Bit-identical weights are a CPU claim
# (CUDA kernels need not be deterministic), so the runs are pinned there.
RUN = [*ON_CPU, "trainer.max_epochs=3", "trainer.limit_train_batches=5", "trainer.limit_val_batches=2",
       "trainer.num_sanity_val_steps=1", "trainer.deterministic=true", "checkpointing.every_n_steps=2",
       "progress=off", "logger=csv"]
FINAL_STEP = 15


def kill_at_step(step: int) -> Callable[[], None]:
    """SIGKILL the process at the end of training step `step` (no handler runs, nothing is flushed)."""
    def setup() -> None:
        from trainer.callbacks.graceful import GracefulStop

        original = GracefulStop.on_train_batch_end

        def on_train_batch_end(self, trainer, *args, **kwargs):  # type: ignore[no-untyped-def]
            original(self, trainer, *args, **kwargs)
            if trainer.global_step == step:
                os.kill(os.getpid(), signal.SIGKILL)

        GracefulStop.on_train_batch_end = on_train_batch_end  # type: ignore[method-assign]
    return setup


def preempt_at_step(step: int) -> Callable[[], None]:
    """Send submitit's preemption signal (USR2) as training step `step` ends: the run writes
    last.ckpt there and stops."""
    def setup() -> None:
        from trainer.callbacks.graceful import GracefulStop

        original = GracefulStop.on_train_batch_end

        def on_train_batch_end(self, trainer, *args, **kwargs):  # type: ignore[no-untyped-def]
            if trainer.global_step == step:
                os.kill(os.getpid(), signal.SIGUSR2)
            original(self, trainer, *args, **kwargs)

        GracefulStop.on_train_batch_end = on_train_batch_end  # type: ignore[method-assign]
    return setup


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    root = tmp_path_factory.mktemp("reference")
    result = train_forked([*RUN, f"run.root={root}", "run.name=reference"], root / "run")
    assert result.returncode == 0, result
    assert result.summary["steps"] == FINAL_STEP
    return weights(root / "run" / "checkpoints" / "last.ckpt")


KILLED = (-signal.SIGKILL, "running")  # no handler ran: the summary still says what it said at the start
CASES = {
    # killed at step 3: last.ckpt of step 2, two batches into epoch 0
    "mid-epoch 0": (kill_at_step(3), 2, True, KILLED),
    # killed at step 7: last.ckpt of step 6, one batch into epoch 1
    "mid-epoch 1": (kill_at_step(7), 6, True, KILLED),
    # killed while writing the 4th file (last.ckpt at the end of epoch 0, just after the best
    # checkpoint of step 5): the torn temporary is passed over, the best one of step 5 is newest
    "during a checkpoint write": (kill_during_save(4), 5, False, KILLED),
    # killed at step 11: last.ckpt written after validation at the end of epoch 1 (step 10)
    "after an epoch end": (kill_at_step(11), 10, False, KILLED),
    # preempted (USR2) at the end of step 7: last.ckpt of step 7, two batches into epoch 1, and
    # nothing after it (no validation, no epoch-end checkpoint) that would say the epoch was over
    "preempted mid-epoch": (preempt_at_step(7), 7, True, (128 + signal.SIGUSR2, "preempted")),
    # preempted at the end of step 10, the last batch of epoch 1 (cut to 5 batches by
    # limit_train_batches): the epoch ends first (validation, last.ckpt), then the run stops after
    # the first step of epoch 2 with last.ckpt of step 11
    "preempted on an epoch's last batch": (preempt_at_step(10), 11, True, (128 + signal.SIGUSR2, "preempted")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_killed_and_resumed_equals_uninterrupted(tmp_path, uninterrupted, case):
    kill, resumed_step, mid_epoch, (returncode, status) = CASES[case]
    args = [*RUN, f"run.root={tmp_path}", "run.name=killed"]
    killed = train_forked(args, tmp_path / "first", setup=kill)
    assert killed.returncode == returncode, killed
    assert json.loads((tmp_path / "first" / "summary.json").read_text())["status"] == status

    resumed = train_forked([*args, "resume=auto"], tmp_path / "second")
    assert resumed.returncode == 0, resumed
    summary = resumed.summary
    assert summary["resumed_from"]["global_step"] == resumed_step
    assert summary["resumed_from"]["mid_epoch"] is mid_epoch
    assert summary["steps"] == FINAL_STEP
    assert summary["requeues"] == 1 and summary["attempts"][0]["status"] == ("killed" if status == "running" else status)
    assert summary["steps_lost"] == (0 if status == "preempted" else None)  # a kill's lost steps are unknown
    identity = json.loads((tmp_path / "second" / "run.json").read_text())
    assert identity["name"] == "killed" and identity["resumed_from"] == summary["resumed_from"]["path"]

    final = weights(tmp_path / "second" / "checkpoints" / "last.ckpt")
    assert final.keys() == uninterrupted.keys()
    different = [k for k in final if not torch.equal(final[k], uninterrupted[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def test_resume_asked_for_and_nothing_found_is_one_line_not_a_fresh_start(tmp_path):
    result = train_forked(["resume=auto", "run.name=never-ran", f"run.root={tmp_path}"], tmp_path / "run")
    assert result.returncode == 2, result
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: resume: auto found no readable checkpoint of run 'never-ran'")
    assert "Traceback" not in result.stderr and not (tmp_path / "run" / "checkpoints").exists()


def test_resume_from_a_checkpoint_of_another_model_is_one_line(tmp_path, uninterrupted):
    other = tmp_path / "other.ckpt"
    torch.save({"state_dict": {"net.w": torch.zeros(2)}, "optimizer_states": [], "global_step": 3, "epoch": 0,
                "loops": {}}, other)
    result = train_forked([f"resume={other}", "progress=off"], tmp_path / "run")
    assert result.returncode == 2, result
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: resume: {other} was written by another model") and "Traceback" not in result.stderr


def test_one_cycle_with_a_found_lr_killed_and_resumed_equals_uninterrupted(tmp_path):
    """scheduler=one_cycle comes back from the checkpoint where it was; with optimizer.lr=find the
    resumed run (in a new folder) takes the range test's answer of the run it carries on, and does
    not test again."""
    args = [*RUN, "scheduler=one_cycle", "optimizer.lr=find", "optimizer.find_steps=20", f"run.root={tmp_path}"]
    reference = train_forked([*args, "run.name=reference"], tmp_path / "reference")
    assert reference.returncode == 0, reference
    killed = train_forked([*args, "run.name=killed"], tmp_path / "first", setup=kill_at_step(7))
    assert killed.returncode == -signal.SIGKILL, killed
    resumed = train_forked([*args, "run.name=killed", "resume=auto"], tmp_path / "second")
    assert resumed.returncode == 0, resumed
    assert resumed.summary["resumed_from"]["global_step"] == 6 and resumed.summary["steps"] == FINAL_STEP
    log = (tmp_path / "second" / "train.log").read_text()
    assert "the range test's answer of the run resumed" in log and "Lightning's lr range test, 20 steps" not in log
    record = json.loads((tmp_path / "first" / "lr_find.json").read_text())
    assert json.loads((tmp_path / "second" / "lr_find.json").read_text()) == record
    assert (tmp_path / "second" / "lr_find.png").is_file()
    assert resumed.summary["hyperparameters"]["lr"] == pytest.approx(record["lr"], rel=1e-12)  # batch 64, one process
    final = weights(tmp_path / "second" / "checkpoints" / "last.ckpt")
    expected = weights(tmp_path / "reference" / "checkpoints" / "last.ckpt")
    assert [k for k in expected if not torch.equal(final[k], expected[k])] == []
