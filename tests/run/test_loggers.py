"""The loggers write into the run folder: csv and tensorboard at once, and wandb offline (no
account), which continues its run id when the run is resumed."""

import json
import os

import pytest

from tests.helpers import train_forked

pytestmark = pytest.mark.run

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=5", "checkpointing=off", "progress=plain"]


def test_tensorboard_and_csv_at_once_write_their_files(tmp_path):
    result = train_forked(["logger=[csv,tensorboard]", *SHORT], tmp_path / "run")
    assert result.returncode == 0, result
    events = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and sum(e.stat().st_size for e in events) > 0
    assert (tmp_path / "run" / "csv" / "metrics.csv").stat().st_size > 0
    assert result.summary["metrics"]["val"]["acc"] > 0.1


def test_wandb_offline_keeps_its_run_in_the_run_folder_and_its_id_on_resume(tmp_path):
    offline = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    # Forked children (no second import of torch); wandb's own service process is started by each.
    first = train_forked(["logger=wandb", *SHORT, "checkpointing=default", f"run.root={tmp_path}"],
                         tmp_path / "first", setup=lambda: os.environ.update(offline))
    assert first.returncode == 0, first
    run_id = json.loads((tmp_path / "first" / "run.json").read_text())["logger_ids"]["wandb"]
    runs = list((tmp_path / "first" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    # Resumed for one more epoch in a new folder: wandb continues the same run id.
    second = train_forked(["logger=wandb", *SHORT, "checkpointing=default", f"run.root={tmp_path}",
                           "trainer.max_epochs=2", f"resume={tmp_path / 'first' / 'checkpoints' / 'last.ckpt'}"],
                          tmp_path / "second", setup=lambda: os.environ.update(offline))
    assert second.returncode == 0, second
    assert json.loads((tmp_path / "second" / "run.json").read_text())["logger_ids"]["wandb"] == run_id
    assert list((tmp_path / "second" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert second.summary["steps"] == 10 and second.summary["resumed_from"]["global_step"] == 5
