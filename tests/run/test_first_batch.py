"""A team's mistakes in its own code are one line before anything trains: one batch goes through
its data module, network and task first (trainer/phases/first_batch.py). Each case below made a
106-140 line traceback with exit 1 before; each is now exit 2, one line naming the part and the
shapes, and no run folder left behind. The same code without the mistake trains."""

from __future__ import annotations

import pytest

from tests.helpers import run_in_process, train_forked

pytestmark = pytest.mark.run

TEAM = ["data._target_=tests.team_table.DigitRows", "~data.val_fraction", "~data.test_fraction", "~data.split_seed",
        "~data.translate", "model=custom", "model._target_=tests.team_table.RowNet",
        "task._target_=tests.team_table.IsLarge", "data.batch_size=50", "progress=off"]


def test_the_teams_table_task_trains(tmp_path):
    summary = run_in_process([*TEAM, "trainer.max_epochs=3", "checkpointing.monitor=val/auroc",
                              "checkpointing.mode=max"], tmp_path)
    assert summary["status"] == "completed"
    assert summary["metrics"]["val"]["auroc"] > 0.9, summary["metrics"]  # chance is 0.5


@pytest.mark.parametrize("overrides, line", [
    (["+data.targets=column"],
     "error: task: IsLarge.loss() failed on outputs 2 x 1 float32 and targets 2 x 1 float32: ValueError: Target "
     "size (torch.Size([2, 1])) must be the same as input size (torch.Size([2]))"),
    (["+data.dtype=float64"],
     "error: data: DigitRows gives inputs 2 x 64 float64 to a network of float32 weights; allowed: float32 inputs "
     "(convert them in the data module)"),
    (["+data.said_features=60"],
     "error: data: DigitRows gives inputs 2 x 64 float32, but its inspect() says a sample is 60 (what the network "
     "was built for); allowed: inputs of N x 60, or a DataInfo that says what setup() gives"),
    (["+model.outputs=2"],
     "error: task: IsLarge.loss() failed on outputs 2 x 2 float32 and targets 2 float32: ValueError: Target size "
     "(torch.Size([2])) must be the same as input size (torch.Size([2, 2]))"),
    (["+data.train_rows=0"],
     "error: data: DigitRows.train_dataloader() gives no batch; allowed: a training split of at least one batch"),
    (["task._target_=tests.team_table.NoLoss"],
     "error: task._target_: tests.team_table.NoLoss does not define loss(outputs, targets, training); allowed: a "
     "TaskDefinition that defines its loss (docs/tasks.md)"),
    (["IMAGES"],
     "error: model: FixedHead: its head gives 2 outputs a sample (outputs 2 x 2), the data have 10 classes; allowed: "
     "one output a class (the model's num_classes)"),
])
def test_a_mistake_in_the_teams_code_is_one_line_and_leaves_no_folder(tmp_path, overrides, line):
    """IMAGES: the framework's classification of the digits' images with a team's network whose head was
    written for two classes (cross-entropy would fail on a label above 1 on the CPU, and on a GPU stop
    the process with a device-side assert)."""
    args = ["model=custom", "model._target_=tests.team_table.FixedHead", "progress=off"] if overrides == ["IMAGES"] \
        else [*TEAM, *overrides]
    result = train_forked(args, tmp_path / "run")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == line
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()
