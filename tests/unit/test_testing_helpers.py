"""trainer.testing, the public helpers a team's tests use (issue 41, item 5): they compose a team
folder's recipes as the command line does (the folder's recipes/, conf/ and package), run the
framework's checks, and turn a mistake into the command line's one line as an AssertionError; the
environment is as it was after them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import trainer.testing as testing
from trainer.configuration.recipes import TEAM_DIRS_VARIABLE
from trainer.configuration.spec import RunSpec
from trainer.scaffold import scaffold
from trainer.testing import ConfigError, TrainingFailed, check_recipe, compose_recipe, team_recipes, train_recipe, validate

#: Its own package name: the helpers put the folder on this process's sys.path.
PACKAGE = "helpers_team"


@pytest.fixture(scope="module")
def team(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("helpers") / "team"
    scaffold(folder, package=PACKAGE)
    return folder


def test_the_public_names_are_documented():
    assert sorted(testing.__all__) == ["ConfigError", "TrainingFailed", "check_recipe", "compose_recipe",
                                       "team_recipes", "train_recipe", "validate"]
    for name in testing.__all__:
        assert getattr(testing, name).__doc__, name
    assert issubclass(ConfigError, AssertionError) and issubclass(TrainingFailed, AssertionError)


def test_team_recipes_lists_the_folders_recipes(team, tmp_path):
    assert team_recipes(team) == ["diabetes_regression", f"{PACKAGE}_digits"]
    assert team_recipes(str(team)) == team_recipes(team)
    assert team_recipes(tmp_path) == []


def test_a_team_recipe_composes_from_any_folder_and_the_variable_is_restored(team, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the team folder
    monkeypatch.delenv(TEAM_DIRS_VARIABLE, raising=False)
    cfg = compose_recipe(f"{PACKAGE}_digits", ["trainer.max_epochs=2", "model.width=8"], team_dir=team)
    assert cfg.model._target_ == f"{PACKAGE}.models.TeamNet" and cfg.model.width == 8
    assert cfg.data._target_ == f"{PACKAGE}.data.NoisyDigits" and cfg.trainer.max_epochs == 2
    assert "hydra" not in cfg
    assert TEAM_DIRS_VARIABLE not in os.environ
    monkeypatch.setenv(TEAM_DIRS_VARIABLE, "/somewhere/else")
    compose_recipe("diabetes_regression", team_dir=team)
    assert os.environ[TEAM_DIRS_VARIABLE] == "/somewhere/else"


def test_without_team_dir_the_working_directory_is_the_team_folder(team, monkeypatch):
    monkeypatch.chdir(team)
    monkeypatch.delenv(TEAM_DIRS_VARIABLE, raising=False)
    assert compose_recipe("diabetes_regression").model._target_ == f"{PACKAGE}.models.MLP"


def test_check_recipe_validates_with_the_teams_classes(team):
    spec = check_recipe(f"{PACKAGE}_digits", team_dir=team)
    assert isinstance(spec, RunSpec)
    assert spec.model["_target_"] == f"{PACKAGE}.models.TeamNet" and spec.model["width"] == 32
    assert str(team.resolve()) in sys.path  # its package imported for the _target_ checks
    spec = check_recipe("diabetes_regression", ["optimizer.lr=0.02"], team_dir=team)
    assert spec.task["_target_"] == f"{PACKAGE}.tasks.Regression" and spec.resolved["optimizer"]["lr"] == 0.02


@pytest.mark.parametrize("name, overrides, line", [
    ("no_such_recipe", [], "recipe: unknown choice 'no_such_recipe'; allowed: "),
    (f"{PACKAGE}_digits", ["optimizer=nadam"], "optimizer: unknown choice 'nadam'; allowed: adamw, lamb, lars, sgd"),
    (f"{PACKAGE}_digits", ["optimizer.lr=-1"], "optimizer.lr: -1 must be > 0"),
    (f"{PACKAGE}_digits", ["model.width=abc"], "model.width: 'abc' is not an integer"),
    (f"{PACKAGE}_digits", ["model._target_=nosuch.Net"], "model._target_: cannot import 'nosuch.Net': no module "
                                                          "named 'nosuch'"),
])
def test_a_mistake_is_the_command_lines_one_line(team, name, overrides, line):
    with pytest.raises(ConfigError) as raised:
        check_recipe(name, overrides, team_dir=team)
    message = str(raised.value)
    assert message.startswith(line) and "\n" not in message, message
    assert raised.value.__cause__ is None  # no chain of framework exceptions under it


def test_a_team_recipe_is_unknown_without_its_folder(team, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(TEAM_DIRS_VARIABLE, raising=False)
    with pytest.raises(ConfigError, match=f"recipe: unknown choice '{PACKAGE}_digits'"):
        compose_recipe(f"{PACKAGE}_digits")
    with pytest.raises(ConfigError, match="team_dir: .* is not a folder"):
        compose_recipe(f"{PACKAGE}_digits", team_dir=tmp_path / "missing")


def test_validate_checks_a_composed_config(team):
    spec = validate(compose_recipe(None, ["data=digits", "trainer.max_epochs=1"]))
    assert spec.model["_target_"] == "trainer.models.small_cnn.SmallCNN" and spec.trainer["max_epochs"] == 1
    cfg = compose_recipe(f"{PACKAGE}_digits", team_dir=team)
    cfg.optimizer.lr = -1.0  # changed after composing: only validate sees it
    with pytest.raises(ConfigError, match=r"^optimizer\.lr: -1.0 must be > 0"):
        validate(cfg)


def test_a_run_that_fails_is_training_failed_with_its_line(team, tmp_path):
    # Refused before anything trains (a new interpreter: a few seconds).
    with pytest.raises(TrainingFailed) as raised:
        train_recipe(f"{PACKAGE}_digits", tmp_path / "run", ["optimizer=nadam"], team_dir=team)
    message = str(raised.value)
    assert "exit code 2" in message and "error: optimizer: unknown choice 'nadam'" in message, message
