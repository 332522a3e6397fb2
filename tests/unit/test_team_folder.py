"""A team's own folder (trainer/configuration/recipes.py, trainer/scaffold.py): found from the working
directory or TRAINER_TEAM_DIRS without absolute paths in any config, never the shipped folders a
checkout shows at its top; the scaffold writes a complete starter folder (a repository: pyproject.toml,
.gitignore, tests that use only trainer.testing) and refuses to overwrite. A run's recorded team
folders put the team's package on sys.path for deploy.
Its regression example (a task of the team's own, docs/tasks.md) trains through the framework with
every practice applied, and what cannot apply to it is refused in one line. (The scaffolded
folder's own tests run in tests/run/test_installed_wheel.py, against the installed wheel.)"""

from __future__ import annotations

import ast
import sys

import pytest

from trainer.configuration.recipes import CONF_DIR, RECIPES_DIR, import_team_folders, team_folders, team_search_path
from trainer.infra.errors import UserError
from trainer.infra.versions import project_version
from trainer.scaffold import framework_requirement, scaffold
from tests.helpers import REPO, train_forked


def test_the_working_directory_and_the_variable_name_team_folders(tmp_path):
    here, other, plain = tmp_path / "here", tmp_path / "other", tmp_path / "plain"
    (here / "recipes").mkdir(parents=True)
    (other / "conf" / "model").mkdir(parents=True)
    plain.mkdir()
    assert team_folders(here, {}) == [here]
    assert team_folders(plain, {"TRAINER_TEAM_DIRS": f"{other}:{here}:{plain}"}) == [other, here]
    assert team_search_path([here, other]) == [f"recipes://{here / 'recipes'}", f"file://{other / 'conf'}"]


def test_a_checkout_is_not_a_team_folder():
    # Its conf/ and recipes/ are links to the shipped folders, already on the search path.
    assert (REPO / "conf").resolve() == CONF_DIR and (REPO / "recipes").resolve() == RECIPES_DIR
    assert team_folders(REPO, {}) == []


def test_the_scaffold_writes_a_recipe_groups_code_and_a_test(tmp_path):
    written = scaffold(tmp_path / "vision-team")
    names = sorted(str(path.relative_to(tmp_path / "vision-team")) for path in written)
    assert names == [".gitignore", "README.md", "conf/data/diabetes.yaml", "conf/data/vision_team_digits.yaml",
                     "conf/model/mlp.yaml", "conf/model/vision_team_net.yaml", "conf/task/regression.yaml",
                     "pyproject.toml", "recipes/diabetes_regression.yaml", "recipes/vision_team_digits.yaml",
                     "tests/test_recipes.py", "tests/test_regression.py", "vision_team/__init__.py",
                     "vision_team/data.py", "vision_team/models.py", "vision_team/tabular.py",
                     "vision_team/tasks.py"]
    recipe = (tmp_path / "vision-team" / "recipes" / "vision_team_digits.yaml").read_text()
    assert "- digits_quickstart" in recipe and "override /model: vision_team_net" in recipe
    for path in written:
        if path.suffix == ".py":
            compile(path.read_text(), str(path), "exec")
    assert "_target_: vision_team.tasks.Regression" in (tmp_path / "vision-team" / "conf/task/regression.yaml").read_text()


def test_the_scaffold_writes_a_pyproject_that_depends_on_this_framework_series(tmp_path):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from packaging.requirements import Requirement

    scaffold(tmp_path / "Vision Team")
    project = tomllib.loads((tmp_path / "Vision Team" / "pyproject.toml").read_text())
    assert project["project"]["name"] == "vision-team"
    [framework] = [Requirement(r) for r in project["project"]["dependencies"]]
    assert framework.name == "gpu-practice-trainer"
    assert framework.specifier.contains(project_version())  # the version it was scaffolded with
    assert not framework.specifier.contains("1.0.0") and not framework.specifier.contains("0.0.9")
    [pytest_requirement] = [Requirement(r) for r in project["project"]["optional-dependencies"]["test"]]
    assert pytest_requirement.name == "pytest"
    [deploy] = [Requirement(r) for r in project["project"]["optional-dependencies"]["deploy"]]
    assert deploy.extras == {"deploy"} and deploy.specifier == framework.specifier
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["vision_team", "vision_team.*"]


@pytest.mark.parametrize("version, requirement", [
    ("0.1.0", "gpu-practice-trainer>=0.1,<0.2"), ("0.12.3.dev1", "gpu-practice-trainer>=0.12,<0.13"),
    ("1.4.2", "gpu-practice-trainer>=1.4,<2"), ("not installed", "gpu-practice-trainer"),
])
def test_the_framework_requirement_is_its_minor_series_before_1_0_and_its_major_after(version, requirement):
    assert framework_requirement(version) == requirement


def test_the_scaffold_ignores_runs_and_caches(tmp_path):
    scaffold(tmp_path / "team")
    ignored = (tmp_path / "team" / ".gitignore").read_text().splitlines()
    assert {"outputs/", "multirun/", "__pycache__/", ".venv/", "*.egg-info/"} <= set(ignored)


def test_the_scaffolds_tests_import_only_the_public_testing_helpers(tmp_path):
    """A team's tests survive a refactoring of the framework: of trainer they import trainer.testing
    alone, and every name they take from it is public."""
    import trainer.testing

    scaffold(tmp_path / "team")
    found = []
    for path in sorted((tmp_path / "team" / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found += [(node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(alias.name, None) for alias in node.names]
    framework = [(module, name) for module, name in found if module == "trainer" or module.startswith("trainer.")]
    assert framework and {module for module, _ in framework} == {"trainer.testing"}, framework
    assert {name for _, name in framework} <= set(trainer.testing.__all__)


def test_a_runs_recorded_team_folders_go_on_sys_path_after_the_present_ones(tmp_path, monkeypatch):
    here, recorded, gone = tmp_path / "here", tmp_path / "recorded", tmp_path / "gone"
    (here / "conf").mkdir(parents=True)
    recorded.mkdir()
    monkeypatch.setattr(sys, "path", list(sys.path))
    folders = import_team_folders([str(recorded), str(gone), str(here)], cwd=here, environ={})
    assert folders == [here, recorded]  # the working directory first, the one gone left out
    assert sys.path[-2:] == [str(here), str(recorded)]
    import_team_folders([str(recorded)], cwd=tmp_path, environ={"TRAINER_TEAM_DIRS": str(here)})
    assert sys.path.count(str(here)) == 1  # never twice


def test_the_scaffold_refuses_a_folder_in_use_and_a_bad_package_name(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="is not empty"):
        scaffold(tmp_path / "used")
    with pytest.raises(UserError, match="not a Python package name"):
        scaffold(tmp_path / "new", package="Our-Team")
    assert (tmp_path / "used" / "notes.txt").read_text() == "keep me"


def test_the_scaffolded_table_declares_its_standardization_for_the_model_card(tmp_path, monkeypatch):
    # What export writes into model.json's preprocessing: the training split's means and deviations
    # of the ten measurements, and of the target (a served prediction goes back into its units).
    import importlib
    import sys

    scaffold(tmp_path / "team")
    monkeypatch.syspath_prepend(str(tmp_path / "team"))
    try:
        declared = importlib.import_module("team.tabular").DiabetesData().inference_preprocessing()
    finally:  # the scaffold's package forgotten: other tests scaffold a "team" of their own
        for name in [name for name in sys.modules if name == "team" or name.startswith("team.")]:
            del sys.modules[name]
    assert set(declared) == {"features", "output"}
    assert len(declared["features"]["mean"]) == len(declared["features"]["std"]) == 10
    assert all(std > 0 for std in declared["features"]["std"]) and declared["output"]["std"] > 0


@pytest.mark.run
def test_the_scaffolded_regression_recipe_trains_with_the_frameworks_practices(tmp_path, monkeypatch):
    # The recipe as written, 10 epochs of 9 steps (seconds); its own test checks the same R2 bound.
    scaffold(tmp_path / "team")
    monkeypatch.setenv("TRAINER_TEAM_DIRS", str(tmp_path / "team"))
    result = train_forked(["+recipe=diabetes_regression", "progress=off"], tmp_path / "run")
    assert result.returncode == 0, result
    summary = result.summary
    assert summary["recipe"]["name"] == "diabetes_regression"
    assert summary["task"] == {"target": "team.tasks.Regression", "unit": "samples", "units_per_sample": 1,
                               "describe": "regression: MSE on standardized targets, MAE and R2; batches in samples"}
    data = summary["data"]
    assert data["kind"] == "features" and data["inputs"] == {"in_features": 10}
    assert data["sizes"] == {"train": 310, "val": 66, "test": 66}
    derived = summary["derived"]
    assert derived["task"]["value"] == "regression"
    # The batch rule in the task's unit (samples): the recipe's lr 0.01 and AdamW's weight decay 0.2,
    # given at 256, moved to the batch of 32.
    assert derived["optimizer.lr"]["how"] == "lr 0.01 at batch 256 -> 0.00353553 at batch 32 (sqrt rule, x0.3536)"
    assert derived["optimizer.weight_decay"]["value"] == pytest.approx(0.2 * (32 / 256) ** 0.5)
    assert [group["weight_decay"] for group in summary["optimizer_param_groups"]] == [
        pytest.approx(0.2 * (32 / 256) ** 0.5), 0.0]  # none on the biases
    assert summary["scheduler"]["name"] == "warmup_cosine" and summary["scheduler"]["optimizer_steps"] == 90
    assert derived["model.flops_per_sample"]["value"] is not None  # counted at example_batch's shape
    clipping = summary["clipping"]
    assert clipping["mode"] == "percentile" and clipping["calibration_steps"] == 30
    assert clipping["steps_observed"] == 90 and clipping["calibrated_threshold"] > 0
    assert summary["nonfinite"]["skipped_steps"] == 0
    assert summary["throughput"]["unit"] == "samples" and summary["throughput"]["samples_per_s"] > 0
    # Time to the recipe's target, counted in the task's unit.
    target = summary["target"]
    assert target["metric"] == "val/r2" and target["mode"] == "max" and target["reached"]
    assert target["samples"] == 32 * target["steps"]
    metrics = summary["metrics"]
    assert set(metrics["val"]) == {"loss", "mae", "r2"} and set(metrics["test"]) == {"loss", "mae", "r2"}
    # Better than predicting the training mean (R2 0, and the data's baseline loss).
    assert metrics["val"]["r2"] > 0.35, metrics
    assert metrics["val"]["loss"] < data["baselines"]["val/loss"]
    assert summary["tested_weights"].startswith("best checkpoint by val/loss")


@pytest.mark.run
@pytest.mark.parametrize("override, line", [
    ("data=digits", "error: task: Regression cannot learn from images (the data module's kind); allowed: data of "
                    "kind features, or another task"),
    ("regularization=label_smoothing", "error: regularization.label_smoothing: Regression has no use for label "
                                       "smoothing; allowed: 0 (regularization=off)"),
    ("task=classification", "error: data: the data module gives no num_classes, which Classification needs; "
                            "allowed: a data module of kind images or features"),
])
def test_what_cannot_apply_to_the_regression_task_is_refused_in_one_line(tmp_path, monkeypatch, override, line):
    scaffold(tmp_path / "team")
    monkeypatch.setenv("TRAINER_TEAM_DIRS", str(tmp_path / "team"))
    result = train_forked(["+recipe=diabetes_regression", "progress=off", override], tmp_path / "run")
    assert result.returncode == 2 and result.stderr.strip() == line, result
