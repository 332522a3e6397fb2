"""What the loggers are told about a run (trainer/groups/logger.py): a wandb run is named after the run,
grouped by the multirun it belongs to and tagged with its recipe and group choices, unless the config
or wandb's own WANDB_* variables say otherwise (tags are added to theirs), and lands in the
WANDB_PROJECT; the hyper-parameters are the resolved config, the group choices and the plan's
derived values, as plain values. wandb runs offline, its files under tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.helpers import compose
from trainer.groups.logger import (RunLabels, build_loggers, finish_loggers, logger_ids, run_hyperparameters,
                                   run_labels, wandb_settings)


def test_labels_name_the_run_group_a_multirun_by_its_folder_and_tag_what_the_run_is(tmp_path):
    root = tmp_path / "outputs"
    sweep = root / "multirun" / "2026-01-02" / "03-04-05-000006"
    choices = {"data": "digits", "model": "small_cnn", "recipe": "team/fast", "ladder": "resnet18_cpu",
               "logger": "wandb", "checkpointing": "default", "hparams_search": "digits_optuna"}
    labels = run_labels("team/fast-lr=0.1", choices, sweep, root)
    assert labels.name == "team/fast-lr=0.1"
    assert labels.group == "multirun/2026-01-02/03-04-05-000006"
    # what the run is, not how it is recorded or launched
    assert labels.tags == ("recipe:team/fast", "ladder:resnet18_cpu", "data:digits", "model:small_cnn")
    assert run_labels("one", choices, None, root).group is None  # a single run has no group
    assert run_labels("one", {}, tmp_path / "elsewhere", root).group == str(tmp_path / "elsewhere")


def test_the_wandb_project_comes_from_WANDB_PROJECT_when_set(monkeypatch):
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    assert compose(["logger=wandb"]).logger.wandb.project == "trainer"
    monkeypatch.setenv("WANDB_PROJECT", "team-vision")
    assert compose(["logger=wandb"]).logger.wandb.project == "team-vision"
    # an explicit setting still wins
    assert compose(["logger=wandb", "logger.wandb.project=mine"]).logger.wandb.project == "mine"


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "team-vision")
    for name in ("WANDB_DIR", "WANDB_NAME", "WANDB_RUN_GROUP", "WANDB_TAGS", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def wandb_spec(*overrides: str) -> dict:
    return OmegaConf.to_container(compose(["logger=wandb", *overrides]).logger, resolve=True)


LABELS = RunLabels("digits-small_cnn", "multirun/2026-01-02/03-04-05-000006", ("data:digits", "model:small_cnn"))


def test_a_wandb_run_gets_the_runs_name_group_tags_and_hyperparameters(tmp_path, offline_wandb):
    [logger] = build_loggers(wandb_spec(), tmp_path, {"wandb": "abcd1234"}, LABELS)
    try:
        run = logger.experiment
        assert (run.project, run.name, run.group, tuple(run.tags)) == (
            "team-vision", LABELS.name, LABELS.group, LABELS.tags)
        assert run.id == "abcd1234"
        logger.log_hyperparams(run_hyperparameters({"optimizer": {"lr": 0.004}}, {"optimizer.lr": 0.0005}))
        assert run.config["optimizer"]["lr"] == 0.004 and run.config["derived"]["optimizer.lr"] == 0.0005
    finally:
        finish_loggers([logger], failed=False)
    assert list((tmp_path / "wandb").glob("offline-run-*-abcd1234"))  # in the run folder


def test_a_name_or_group_set_in_the_config_wins_and_its_tags_are_kept(tmp_path, offline_wandb):
    spec = wandb_spec("logger.wandb.name=mine", "logger.wandb.group=my-group", "logger.wandb.tags=[a,b]")
    [logger] = build_loggers(spec, tmp_path, {"wandb": "efgh5678"}, LABELS)
    try:
        run = logger.experiment
        assert (run.name, run.group, tuple(run.tags)) == ("mine", "my-group", ("a", "b", *LABELS.tags))
    finally:
        finish_loggers([logger], failed=False)


def test_wandbs_own_variables_win_and_its_tags_are_added_to(tmp_path, offline_wandb, monkeypatch):
    monkeypatch.setenv("WANDB_NAME", "from-env")
    monkeypatch.setenv("WANDB_RUN_GROUP", "env-group")
    monkeypatch.setenv("WANDB_TAGS", "nightly, team-a")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    [logger] = build_loggers(wandb_spec(), tmp_path / "run", {"wandb": "ijkl9012"}, LABELS)
    try:
        run = logger.experiment
        assert (run.name, run.group) == ("from-env", "env-group")
        assert tuple(run.tags) == ("nightly", "team-a", *LABELS.tags)
    finally:
        finish_loggers([logger], failed=False)
    assert list((tmp_path / "scratch" / "wandb").glob("offline-run-*-ijkl9012"))  # WANDB_DIR, not the run folder


def test_wandb_settings_fill_in_only_what_neither_the_config_nor_the_environment_sets():
    spec = {"_target_": "lightning.pytorch.loggers.WandbLogger", "name": None, "group": None, "tags": None}
    assert wandb_settings(spec, LABELS, "/runs/1", {}) == {
        "name": LABELS.name, "group": LABELS.group, "save_dir": "/runs/1", "tags": list(LABELS.tags)}
    environ = {"WANDB_NAME": "n", "WANDB_RUN_GROUP": "g", "WANDB_DIR": "/scratch", "WANDB_TAGS": "x,,data:digits"}
    assert wandb_settings(spec, LABELS, "/runs/1", environ) == {
        "name": "n", "group": "g", "save_dir": "/scratch", "tags": ["x", "data:digits", "model:small_cnn"]}
    assert wandb_settings({**spec, "tags": ["mine"]}, RunLabels(), "/runs/1", {})["tags"] == ["mine"]


def test_the_wandb_run_id_is_the_configured_one_then_WANDB_RUN_ID_then_the_resumed_runs():
    spec = {"wandb": {"_target_": "lightning.pytorch.loggers.WandbLogger"}}
    assert logger_ids(spec, {"wandb": "resumed1"}, {"WANDB_RUN_ID": "fromenv1"}) == {"wandb": "fromenv1"}
    assert logger_ids(spec, {"wandb": "resumed1"}, {}) == {"wandb": "resumed1"}
    assert logger_ids({"wandb": {**spec["wandb"], "id": "mine0001"}}, {}, {"WANDB_RUN_ID": "x"}) == {"wandb": "mine0001"}
    assert len(logger_ids(spec, {}, {})["wandb"]) == 8


def test_hyperparameters_are_the_resolved_config_and_the_derived_values_as_plain_values():
    resolved = {"data": {"batch_size": 64, "shape": (3, 32, 32), "root": Path("/data")},
                "optimizer": {"lr": 0.004, "betas": [0.9, 0.999]}, "run": {"name": None}}
    hyperparameters = run_hyperparameters(resolved, {"optimizer.lr": 0.002, "global_batch_size": 128,
                                                     "precision": "bf16-mixed", "data.prefetch_factor": None},
                                          {"data": "digits", "recipe": "team/fast"})
    assert hyperparameters == {
        "data": {"batch_size": 64, "shape": [3, 32, 32], "root": "/data"},
        "optimizer": {"lr": 0.004, "betas": [0.9, 0.999]}, "run": {"name": None},
        "choices": {"data": "digits", "recipe": "team/fast"},
        "derived": {"optimizer.lr": 0.002, "global_batch_size": 128, "precision": "bf16-mixed",
                    "data.prefetch_factor": None}}
