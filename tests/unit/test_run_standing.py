"""Where a run stands, and what a resumed run needs to carry on from anywhere: summary.json's phase
at every write and the phase an attempt stopped in; a completed run is found (newest summary,
same stopping point) only when a resume is asked for; the logged metrics, loss record, throughput
windows, the best checkpoint's score (also across folders) and the training metrics' mid-epoch
states (per process) travel in checkpoints."""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from trainer.callbacks.logged_metrics import LoggedMetrics
from trainer.callbacks.loss_record import LossRecord
from trainer.callbacks.throughput import ThroughputMeter
from trainer.configuration.spec import choice_config
from trainer.groups.checkpointing import LatestAndBest
from trainer.groups.optimizer.build import OptimizerRecipe
from trainer.infra import attempts
from trainer.infra.summary import RunRecord
from trainer.phases.resume import RESOLVED_CONFIG, completed_run, write_identity
from trainer.task import ClassificationTask

STOP = {"max_epochs": 3, "max_steps": -1}


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_summary_says_the_phase_at_every_write_and_where_a_run_stopped(tmp_path):
    path = tmp_path / "summary.json"
    record = RunRecord(path, {"run_name": "x"})
    record.begin()
    assert (read(path)["status"], read(path)["phase"]) == ("running", "training")
    record.enter("testing", steps=18, metrics={"val": {"acc": 0.5}})
    assert (read(path)["status"], read(path)["phase"], read(path)["steps"]) == ("running", "testing", 18)
    before = path.read_bytes()
    record.enter("recording")  # no write of its own: the final write follows
    assert path.read_bytes() == before
    record.end("failed", error="boom")
    assert (read(path)["status"], read(path)["phase"], read(path)["stopped_in"]) == ("failed", "failed", "recording")

    done = RunRecord(tmp_path / "done.json", {})
    done.enter("testing")
    assert "stopped_in" not in done.end("completed") and read(tmp_path / "done.json")["phase"] == "completed"


def test_an_attempt_records_the_phase_it_stopped_in_and_a_killed_one_its_last_written_phase(tmp_path):
    folder = tmp_path / "run"
    (folder / "checkpoints").mkdir(parents=True)
    first = attempts.ended(attempts.this_attempt(1, None), "preempted", 18, stopped_in="testing")
    assert first["stopped_in"] == "testing"
    # killed during its test: the summary's last write said so
    (folder / "summary.json").write_text(json.dumps({"status": "running", "phase": "testing",
                                                     **attempts.totals([attempts.this_attempt(1, None)])}))
    earlier = attempts.earlier_attempts(folder / "checkpoints" / "last.ckpt", 18)
    assert (earlier[0]["status"], earlier[0]["stopped_in"]) == ("killed", "testing")


def finished_run(root: Path, folder: str, name: str, status: str = "completed", stop: dict | None = None) -> Path:
    run_dir = root / folder
    run_dir.mkdir(parents=True)
    write_identity(run_dir, name, None)
    stop = STOP if stop is None else stop
    (run_dir / RESOLVED_CONFIG).write_text("trainer:\n" + "".join(f"  {k}: {v}\n" for k, v in stop.items()))
    (run_dir / "summary.json").write_text(json.dumps({"status": status, "metrics": {"test": {"acc": 0.9}}}))
    return run_dir


def later(path: Path, seconds: float = 5) -> None:
    stamp = time.time() + seconds
    os.utime(path, (stamp, stamp))


def test_a_completed_run_is_found_only_when_a_resume_is_asked_for(tmp_path):
    done = finished_run(tmp_path, "a", "mine")
    new = tmp_path / "new"
    for request in ("auto", "if_any"):
        found = completed_run(request, "mine", tmp_path, new, STOP)
        assert found is not None and found.folder == done and found.summary["metrics"]["test"]["acc"] == 0.9
    assert completed_run(None, "mine", tmp_path, new, STOP) is None  # a fresh start trains again
    assert completed_run(str(done / "checkpoints" / "last.ckpt"), "mine", tmp_path, new, STOP) is None
    assert completed_run("if_any", "other", tmp_path, new, STOP) is None


def test_the_newest_summary_decides_and_another_stopping_point_carries_on(tmp_path):
    finished_run(tmp_path, "a", "mine")
    # the same name started afresh later and killed: not complete
    killed = finished_run(tmp_path, "b", "mine", status="running")
    later(killed / "summary.json")
    assert completed_run("if_any", "mine", tmp_path, tmp_path / "new", STOP) is None
    # ... and then resumed to completion in a third folder
    resumed = finished_run(tmp_path, "c", "mine")
    later(resumed / "summary.json", 10)
    assert completed_run("if_any", "mine", tmp_path, tmp_path / "new", STOP).folder == resumed
    # asked to train longer: carry on from the checkpoint instead
    assert completed_run("if_any", "mine", tmp_path, tmp_path / "new", {**STOP, "max_epochs": 6}) is None


def test_a_requeued_job_finds_its_own_folder_complete(tmp_path):
    own = finished_run(tmp_path / "elsewhere", "job", "mine")
    assert completed_run("if_any", "mine", tmp_path / "root", own, STOP).folder == own


def test_logged_metrics_travel_in_the_checkpoint_and_this_attempts_values_win():
    trainer = SimpleNamespace(callback_metrics={"val/acc": torch.tensor(0.75), "train/loss_epoch": torch.tensor(0.5),
                                                "flag": "text"})
    metrics = LoggedMetrics()
    metrics.setup(trainer, None, "fit")  # type: ignore[arg-type]
    state = metrics.state_dict()
    assert state == {"metrics": {"val/acc": 0.75, "train/loss_epoch": 0.5}}

    resumed = LoggedMetrics()
    resumed.load_state_dict(state)
    nothing_logged = SimpleNamespace(callback_metrics={})
    assert resumed.final(nothing_logged) == {"val/acc": 0.75, "train/loss_epoch": 0.5}
    assert resumed.final(SimpleNamespace(callback_metrics={"val/acc": torch.tensor(0.8)}))["val/acc"] == \
        pytest.approx(0.8)


def test_loss_record_and_throughput_windows_survive_a_resume():
    record = LossRecord(first_steps=2, last_steps=3)
    for v in (5.0, 4.0, 3.0, 2.0):
        record.on_train_batch_end(None, None, {"loss": torch.tensor(v)}, None, 0)
    carried = LossRecord(first_steps=2, last_steps=3)
    carried.load_state_dict(record.state_dict())
    carried.on_train_batch_end(None, None, {"loss": torch.tensor(1.0)}, None, 0)
    assert carried.summary()["first"] == [5.0, 4.0] and carried.summary()["final"] == 1.0
    assert carried.summary()["last_steps"] == 3

    meter = ThroughputMeter()
    meter.window_rates = [100.0, 120.0]
    again = ThroughputMeter()
    again.load_state_dict(meter.state_dict())
    assert again.summary()["samples_per_s"] == 110.0 and again.summary()["windows"] == 2


def test_the_best_score_survives_a_resume_into_another_folder(tmp_path):
    first = LatestAndBest(dirpath=tmp_path / "a" / "checkpoints", monitor="val/loss", mode="min", save_last=True)
    best = str(tmp_path / "a" / "checkpoints" / "epoch001.ckpt")
    first.best_model_path, first.best_model_score = best, torch.tensor(0.3)
    first.best_k_models = {best: torch.tensor(0.3)}
    first.kth_best_model_path, first.kth_value = best, torch.tensor(0.3)
    first.last_model_path = str(tmp_path / "a" / "checkpoints" / "last.ckpt")
    second = LatestAndBest(dirpath=tmp_path / "b" / "checkpoints", monitor="val/loss", mode="min", save_last=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Lightning's "won't be reloaded" warning would fail here
        second.load_state_dict(first.state_dict())
    assert second.best_model_path == best and float(second.best_model_score) == pytest.approx(0.3)
    assert set(second.best_k_models) == {best} and second.last_model_path == first.last_model_path
    assert Path(second.dirpath) == tmp_path / "b" / "checkpoints"  # new checkpoints go to its own folder


def fake_trainer(processed: int, completed: int, world_size: int = 1, rank: int = 0) -> SimpleNamespace:
    progress = SimpleNamespace(current=SimpleNamespace(processed=processed, completed=completed))
    return SimpleNamespace(fit_loop=SimpleNamespace(epoch_progress=progress), world_size=world_size,
                           global_rank=rank)


def make_task() -> ClassificationTask:
    net = nn.Linear(4, 3)
    return ClassificationTask(net, 3, OptimizerRecipe.for_network(net, choice_config("optimizer", "adamw"), 1e-3, 0.0),
                              choice_config("scheduler", "constant"))


def test_the_training_metrics_running_states_travel_in_a_mid_epoch_checkpoint(monkeypatch):
    task = make_task()
    task.train_loss(torch.tensor(2.0))
    task.train_loss(torch.tensor(4.0))
    task.metrics_of("train")["acc"](torch.tensor([[1.0, 0, 0], [0, 1.0, 0]]), torch.tensor([0, 2]))
    monkeypatch.setattr(ClassificationTask, "trainer", fake_trainer(processed=1, completed=1))
    checkpoint: dict = {}
    task.on_save_checkpoint(checkpoint)  # inside epoch 1

    resumed = make_task()
    resumed.on_load_checkpoint(checkpoint)
    resumed.train_loss(torch.tensor(6.0))
    assert float(resumed.train_loss.compute()) == pytest.approx(4.0)  # the mean over all three steps
    assert float(resumed.metrics_of("train")["acc"].compute()) == pytest.approx(0.5)

    at_epoch_end: dict = {}
    monkeypatch.setattr(ClassificationTask, "trainer", fake_trainer(processed=2, completed=1))
    task.on_save_checkpoint(at_epoch_end)
    assert ClassificationTask.TRAIN_METRICS_KEY not in at_epoch_end  # the next epoch starts afresh anyway

    # another number of processes: the epoch's mean starts afresh rather than from another share
    monkeypatch.setattr(ClassificationTask, "trainer", fake_trainer(processed=1, completed=1, world_size=2, rank=1))
    other = make_task()
    other.on_load_checkpoint(checkpoint)
    assert other.train_loss._update_count == 0
