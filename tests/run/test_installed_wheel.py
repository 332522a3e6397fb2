"""The package installs and runs without a checkout: the wheel built from this repository carries the
configs and recipes; installed into a fresh virtual environment, `python -m trainer` and the
`gpu-practice-train` script answer --version and train a recipe from an empty folder elsewhere; a
scaffolded team folder trains its own recipe, with its own network and data, and its tests pass (the
one that trains its regression example, a task of its own, among them).

The new environment borrows the libraries of the test's own (a path line, so that nothing is
downloaded and torch is not installed twice); the project itself comes from the wheel alone."""

from __future__ import annotations

import json
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = [pytest.mark.run, pytest.mark.slow]


def _run(command: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding the wheel (no dependencies), with this environment's libraries on its path."""
    scratch = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
          str(scratch / "dist"), str(REPO)], scratch)
    [wheel] = list((scratch / "dist").glob("gpu_practice_trainer-*.whl"))
    venv = scratch / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], scratch)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)], scratch)
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        scratch).stdout.strip())
    # The libraries, not the project: a path line does not run the .pth files of the folder it names,
    # so this environment's editable install of the checkout stays out.
    borrowed = [p for p in {sysconfig.get_paths()["purelib"], *site.getsitepackages()} if Path(p).is_dir()]
    (purelib / "borrowed_libraries.pth").write_text("\n".join(sorted(borrowed)) + "\n")
    return venv


def test_the_wheel_carries_the_configs_and_recipes(installed):
    [wheel] = list((installed.parent / "dist").glob("*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"trainer/conf/train.yaml", "trainer/conf/optimizer/adamw.yaml", "trainer/conf/hydra/help/trainer.yaml",
            "trainer/recipes/digits_quickstart.yaml", "trainer/py.typed"} <= names
    shipped = {n for n in names if n.startswith("trainer/conf/") and n.endswith(".yaml")}
    assert len(shipped) == len(list((REPO / "trainer" / "conf").rglob("*.yaml")))


def test_python_m_trainer_and_the_script_answer_from_any_folder(installed, tmp_path):
    python, script = installed / "bin" / "python", installed / "bin" / "gpu-practice-train"
    where = _run([str(python), "-c", "import trainer; print(trainer.__file__)"], tmp_path).stdout
    assert where.startswith(str(installed))  # the wheel's copy, not the checkout
    for command in ([str(python), "-m", "trainer", "--version"], [str(script), "--version"]):
        assert _run(command, tmp_path).stdout.startswith("gpu-practice-trainer ")


def test_an_installed_package_trains_a_recipe_in_an_empty_folder(installed, tmp_path):
    done = _run([str(installed / "bin" / "gpu-practice-train"), "+recipe=digits_quickstart", "trainer.max_epochs=1",
                 "trainer.limit_train_batches=4", "checkpointing=off", "progress=plain", "run.root=runs"], tmp_path)
    [summary] = list((tmp_path / "runs").rglob("summary.json"))
    result = json.loads(summary.read_text())
    assert result["status"] == "completed" and result["recipe"]["name"] == "digits_quickstart", done.stdout[-2000:]
    assert (summary.parent / "train.log").is_file()


def test_a_scaffolded_team_folder_trains_its_own_recipe_and_passes_its_test(installed, tmp_path):
    python = str(installed / "bin" / "python")
    _run([python, "-m", "trainer", "scaffold", "vision-team"], tmp_path)
    team = tmp_path / "vision-team"
    _run([str(installed / "bin" / "gpu-practice-train"), "+recipe=vision_team_digits", "trainer.max_epochs=1",
          "trainer.limit_train_batches=4", "checkpointing=off", "progress=plain", "run.root=runs"], team)
    [summary] = list((team / "runs").rglob("summary.json"))
    recipe = json.loads(summary.read_text())["recipe"]
    assert recipe["parent"] == "digits_quickstart"  # a team recipe on a shipped one
    assert recipe["differs_from_parent"]["model._target_"][1] == "vision_team.models.TeamNet"
    assert recipe["differs_from_parent"]["data._target_"][1] == "vision_team.data.NoisyDigits"
    tests = _run([python, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "tests"], team).stdout
    # The regression test trains diabetes_regression with the wheel's framework and checks its val/r2.
    assert "PASSED tests/test_regression.py::test_the_regression_recipe_beats_predicting_the_mean" in tests, tests
    assert "3 passed" in tests, tests
