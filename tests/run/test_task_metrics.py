"""A task's own metrics are first-class: a team's task that logs validation AUROC (tests/helpers.py:
DigitIsLarge, a metric the framework does not know) has its best checkpoint picked by it, is stopped
early by it, shows it in every epoch line and draws it in curves.png; a key naming a metric the task
does not log, or a mode that takes the wrong end of it, is one line before anything trains."""

from __future__ import annotations

import logging

import pytest

from tests.helpers import run_in_process, train_forked

pytestmark = pytest.mark.run

TEAM_TASK = ["task._target_=tests.helpers.DigitIsLarge", "progress=plain", "trainer.num_sanity_val_steps=0"]


def test_a_teams_metric_picks_the_best_checkpoint_stops_early_and_is_shown(tmp_path, caplog):
    """min_delta 0.5: no AUROC can improve by that much, so the second validation ends the run (patience
    1); the best checkpoint is the better of the two epochs by AUROC, not by loss."""
    with caplog.at_level(logging.INFO, logger="trainer"):
        summary = run_in_process([*TEAM_TASK, "checkpointing.monitor=val/auroc", "checkpointing.mode=max",
                                  "callbacks=[early_stopping]", "callbacks.early_stopping.monitor=val/auroc",
                                  "callbacks.early_stopping.mode=max", "callbacks.early_stopping.patience=1",
                                  "callbacks.early_stopping.min_delta=0.5", "trainer.max_epochs=6"], tmp_path)
    assert summary["status"] == "completed" and summary["epochs"] == 2 and summary["steps"] == 38
    epoch_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch ")
                   and "/6  step" in r.getMessage()]
    aurocs = [float(line.split("val/auroc ")[1].split()[0]) for line in epoch_lines]
    assert len(aurocs) == 2 and all(0.5 < a <= 1 for a in aurocs), epoch_lines
    assert all("train/loss" in line and "val/loss" in line and "acc" not in line for line in epoch_lines)
    best_epoch = max(range(2), key=lambda i: aurocs[i])
    assert summary["best_checkpoint"].endswith(f"epoch{best_epoch:03d}-step{19 * (best_epoch + 1):06d}.ckpt")
    assert summary["metrics"]["val"]["auroc"] == pytest.approx(aurocs[best_epoch], abs=1e-4)  # the tested weights
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_the_curves_draw_the_tasks_headline_metric():
    """What curves.png's middle panel draws: the objective when it is a validation metric (with its
    training counterpart where logged), else the first validation metric; nothing for losses alone."""
    from tests.helpers import DigitIsLarge
    from trainer.groups.task import headline_metrics, logged_metrics, shown_metrics
    from trainer.tasks.classification import Classification

    team = logged_metrics(DigitIsLarge())
    assert team == {"train/loss": False, "val/loss": False, "val/auroc": True, "test/loss": False, "test/auroc": True}
    assert headline_metrics(team, "val/auroc") == headline_metrics(team, "val/loss") == ("val/auroc",)
    assert shown_metrics(team) == ("train/loss", "val/loss", "val/auroc")
    classes = Classification()
    classes.num_classes = 10
    logged = logged_metrics(classes)
    assert headline_metrics(logged, "val/acc") == ("val/acc", "train/acc")
    assert headline_metrics(logged, "val/acc5") == ("val/acc5",)
    assert headline_metrics({"train/loss": False, "val/loss": False}, "val/loss") == ()


@pytest.mark.parametrize("overrides, line", [
    (["checkpointing.monitor=val/auroc"],
     "error: checkpointing.mode: min takes the lowest val/auroc as the best, but a higher val/auroc is better; "
     "allowed: max"),
    (["checkpointing.monitor=val/acc", "checkpointing.mode=max"],
     "error: checkpointing.monitor: 'val/acc' is not a metric this task logs; allowed: train/loss, val/loss, "
     "val/auroc"),
    (["checkpointing.monitor=test/auroc", "checkpointing.mode=max"],
     "error: checkpointing.monitor: 'test/auroc' is not a metric this task logs in train or val; allowed: "
     "train/loss, val/loss, val/auroc"),
    (["callbacks=[early_stopping]", "callbacks.early_stopping.monitor=val/auroc"],
     "error: callbacks.early_stopping.mode: min takes the lowest val/auroc as the best, but a higher val/auroc "
     "is better; allowed: max"),
    (["target.metric=val/aucroc", "target.value=0.9"],
     "error: target.metric: 'val/aucroc' is not a metric this task logs; allowed: train/loss, val/loss, val/auroc"),
    (["objective=val/acc"],
     "error: objective: 'val/acc' is not a metric this task logs; allowed: train/loss, val/loss, val/auroc, "
     "test/loss, test/auroc"),
])
def test_a_key_naming_a_metric_the_task_does_not_log_is_one_line_and_leaves_no_folder(tmp_path, overrides, line):
    result = train_forked([*TEAM_TASK, *overrides], tmp_path / "run")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == line
    assert not (tmp_path / "run").exists()
