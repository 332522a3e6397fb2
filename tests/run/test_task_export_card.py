"""A team's table task (tests/team_table.py: 64 features a row, one logit, validation AUROC) exported:
the model card states what a model of features takes and gives (inputs and outputs with their
shapes and dtypes, the batch dimension free), the task and every metric it recorded, the
preprocessing its data module declares, and no image fields; the image server refuses it in one
line naming its inputs."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_in_process

pytestmark = pytest.mark.run

TABLE = ["data._target_=tests.team_table.DigitRows", "~data.val_fraction", "~data.test_fraction", "~data.split_seed",
         "~data.translate", "model=custom", "model._target_=tests.team_table.RowNet",
         "task._target_=tests.team_table.IsLarge", "data.batch_size=50", "progress=off", "trainer.max_epochs=1",
         "trainer.accelerator=cpu"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from trainer.deploy.export import export_run

    run_dir = tmp_path_factory.mktemp("table_run")
    summary = run_in_process(TABLE, run_dir)
    assert summary is not None and summary["status"] == "completed"
    export_run(run_dir)
    return run_dir, summary, json.loads((run_dir / "export" / "model.json").read_text())


def test_the_card_states_the_tables_inputs_outputs_task_and_metrics(exported):
    _, summary, card = exported
    assert card["task"] == "tests.team_table.IsLarge" and card["kind"] == "features"
    assert card["inputs"] == [{"name": "input", "shape": ["batch", 64], "dtype": "float32"}]
    assert card["outputs"] == [{"name": "output", "shape": ["batch", 1], "dtype": "float32"}]
    assert card["metrics"]["val"]["auroc"] == pytest.approx(summary["metrics"]["val"]["auroc"])
    assert set(card["metrics"]) == {"val", "test"} and "loss" in card["metrics"]["test"]
    assert card["preprocessing"] == {"features": {"scale": 1 / 16}}  # what DigitRows declares
    assert not {"classes", "input", "accuracy"} & set(card)  # nothing of an image classifier


def test_the_image_server_refuses_the_table_in_one_line_naming_its_inputs(exported):
    from trainer.deploy.serve import read_card
    from trainer.infra.errors import UserError

    run_dir, _, _ = exported
    with pytest.raises(UserError) as caught:
        read_card(run_dir / "export")
    assert "is a model of features (input float32 batchx64): this server answers images" in str(caught.value)
