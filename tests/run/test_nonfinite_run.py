"""The non-finite guard in a real run: a model that emits NaN once trains to the accuracy of a
clean run with one skipped step, counted; NaN from some step on stops the training with one line
naming the first bad parameter, a failed summary and a loadable diagnostic checkpoint of finite
weights."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.helpers import run_in_process

pytestmark = pytest.mark.run

NAN_MODEL = ["model=custom", "model._target_=tests.helpers.NaNMLP", "trainer.max_epochs=2",
             "trainer.num_sanity_val_steps=0", "checkpointing=off", "progress=off"]


def test_a_nan_step_is_skipped_and_the_run_learns_as_without_it(tmp_path):
    clean = run_in_process(NAN_MODEL, tmp_path / "clean")
    summary = run_in_process([*NAN_MODEL, "+model.nan_at=[3]"], tmp_path / "nan")
    assert clean["nonfinite"]["skipped_steps"] == 0
    assert summary["status"] == "completed"
    assert summary["nonfinite"]["skipped_steps"] == 1 and summary["nonfinite"]["skipped_at"] == [2]
    assert summary["nonfinite"]["first_nonfinite"]["parameter"] == "net.net.1.weight"
    assert math.isfinite(summary["loss"]["final"]) and summary["loss"]["non_finite"] == 1
    # one batch fewer of learning, nothing poisoned: the same accuracy within a few test images
    assert abs(summary["metrics"]["test"]["acc"] - clean["metrics"]["test"]["acc"]) <= 0.03


def test_consecutive_nan_steps_stop_with_one_line_and_a_diagnostic_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        run_in_process([*NAN_MODEL, "+model.nan_from=4", "nonfinite.max_consecutive=3"], tmp_path)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    # The guard's counters are read at Lightning's log steps (every 10 by default), so the run stops
    # at step 10 with the run of bad steps that began at step 3 (steps 3-9: 7 in a row).
    assert len(err) == 1 and err[0].startswith("error: training: 7 steps in a row had a non-finite loss")
    assert "net.net.1.weight at step 3" in err[0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    # skipped steps still count as optimizer steps (the schedule advances)
    assert summary["status"] == "failed" and summary["steps"] == 10
    assert summary["nonfinite"]["skipped_at"] == list(range(3, 10))
    path = summary["nonfinite"]["diagnostic_checkpoint"]
    assert path.endswith("nonfinite-step000010.ckpt") and path in err[0]
    saved = torch.load(path, map_location="cpu", weights_only=True)
    assert saved["global_step"] == 10
    assert all(torch.isfinite(v).all() for v in saved["state_dict"].values())  # the last good weights
