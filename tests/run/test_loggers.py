"""The tensorboard and wandb (offline, no account) loggers write into the run folder."""

import pytest

from tests.helpers import train

pytestmark = pytest.mark.run

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=5", "checkpointing=off", "progress=plain"]


def test_tensorboard_writes_event_files(tmp_path):
    result = train(["logger=tensorboard", *SHORT], tmp_path / "run")
    assert result.returncode == 0, result
    events = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and sum(e.stat().st_size for e in events) > 0
    assert result.summary["metrics"]["val"]["acc"] > 0.1


def test_wandb_offline_keeps_its_run_in_the_run_folder(tmp_path):
    result = train(["logger=wandb", *SHORT], tmp_path / "run", env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert result.returncode == 0, result
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb"))
