"""The package installs and runs without a checkout: the wheel built from this repository carries the
configs and recipes; installed into a fresh virtual environment, `python -m trainer` and the
`gpu-practice-train` script answer --version and train a recipe from an empty folder elsewhere; a
scaffolded team folder installs as a package of its own (its pyproject.toml, offline), trains its own
recipe, with its own network and data, its tests pass (the one that trains its regression example, a
task of its own, among them), and its model is exported and served from another folder.

The new environment borrows the libraries of the test's own (a path line, so that nothing is
downloaded and torch is not installed twice); the project itself comes from the wheel alone."""

from __future__ import annotations

import io
import json
import os
import site
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import REPO, stop_server
from trainer.configuration.recipes import TEAM_DIRS_VARIABLE
from trainer.deploy.export import onnx_logits
from trainer.infra.processes import free_port

pytestmark = [pytest.mark.run, pytest.mark.slow]


def _run(command: list[str], cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
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


def test_the_wheels_page_is_the_packages_own_with_its_project_urls(installed):
    [wheel] = list((installed.parent / "dist").glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        [metadata] = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode()
    headers, _, description = text.partition("\n\n")
    assert description.strip() == (REPO / "docs" / "package-readme.md").read_text().strip()
    assert "Description-Content-Type: text/markdown" in headers
    assert "Project-URL: Documentation, https://" in headers and "Project-URL: Source, https://" in headers


def test_the_scripts_help_names_the_script_and_its_subcommands(installed, tmp_path):
    text = _run([str(installed / "bin" / "gpu-practice-train"), "--help"], tmp_path).stdout
    assert text.startswith("gpu-practice-train: ")
    assert "train.py" not in text and "python -m trainer" not in text
    assert "gpu-practice-train scaffold " in text and "gpu-practice-train deploy export " in text
    usage = _run([str(installed / "bin" / "gpu-practice-train"), "deploy", "--help"], tmp_path).stdout
    assert usage.startswith("usage: gpu-practice-train deploy ")


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


def test_a_scaffolded_team_folder_installs_trains_tests_and_deploys_its_own_model(installed, tmp_path):
    python, script = str(installed / "bin" / "python"), str(installed / "bin" / "gpu-practice-train")
    _run([python, "-m", "trainer", "scaffold", "vision-team"], tmp_path)
    team = tmp_path / "vision-team"
    # Its pyproject.toml: the framework (the wheel's, installed) and pytest (borrowed) satisfy it
    # offline; the team's package is installed editable beside the framework.
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-index", "--no-build-isolation",
          "-e", ".[test]"], team)
    where = _run([python, "-c", "import vision_team; print(vision_team.__file__)"], tmp_path).stdout
    assert where.strip() == str(team / "vision_team" / "__init__.py")
    _run([script, "+recipe=vision_team_digits", "trainer.max_epochs=1", "trainer.limit_train_batches=4",
          "trainer.accelerator=cpu", "progress=plain", "run.root=runs"], team)
    [summary_path] = list((team / "runs").rglob("summary.json"))
    summary = json.loads(summary_path.read_text())
    recipe = summary["recipe"]
    assert recipe["parent"] == "digits_quickstart"  # a team recipe on a shipped one
    assert recipe["differs_from_parent"]["model._target_"][1] == "vision_team.models.TeamNet"
    assert recipe["differs_from_parent"]["data._target_"][1] == "vision_team.data.NoisyDigits"
    assert summary["team_dirs"] == [str(team)]
    tests = _run([python, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider"], team).stdout
    # The regression test trains diabetes_regression with the wheel's framework and checks its val/r2.
    assert "PASSED tests/test_regression.py::test_the_regression_recipe_beats_predicting_the_mean" in tests, tests
    assert "3 passed" in tests, tests
    # Deployed from another folder, without TRAINER_TEAM_DIRS: the run's recorded team folder is used.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != TEAM_DIRS_VARIABLE}
    run_dir = summary_path.parent
    _run([script, "deploy", "export", str(run_dir)], elsewhere, env=env)
    card = json.loads((run_dir / "export" / "model.json").read_text())
    assert card["model"] == "vision_team.models.TeamNet"
    assert max(card["checked"]["max_abs_diff"].values()) <= card["checked"]["bound"]
    answer, png = _serve_one_digit([script, "deploy", "serve", str(run_dir)], elsewhere, env, tmp_path / "serve.log")
    expected = torch.softmax(onnx_logits(run_dir / "export" / "model.onnx", _preprocessed(png, card)), 1)[0]
    assert answer["top_k"][0]["index"] == int(expected.argmax())
    assert answer["top_k"][0]["probability"] == pytest.approx(float(expected.max()), abs=1e-4)


def _serve_one_digit(command: list[str], cwd: Path, env: dict[str, str], log: Path) -> tuple[dict, bytes]:
    """Start the server on a free port, POST one of scikit-learn's digits as a PNG to /predict, stop
    the server by its pid; (the answer, the PNG)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    picture = Image.fromarray((load_digits().images[0] * 255 / 16).round().astype(np.uint8), "L")
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    port = free_port()
    with open(log, "wb") as out:
        server = subprocess.Popen([*command, "--port", str(port)], cwd=cwd, env=env, stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, f"serve stopped ({server.returncode}): {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"serve not ready: {log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as health:
                    if health.status == 200:
                        break
            except OSError:
                time.sleep(0.25)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/predict", data=buffer.getvalue(),
                                         headers={"Content-Type": "image/png"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
            return json.loads(response.read()), buffer.getvalue()
    finally:
        stop_server(server)


def _preprocessed(png: bytes, card: dict) -> torch.Tensor:
    """The picture as training's preprocessing (the model card's) gives it to the network."""
    from PIL import Image

    steps = card["preprocessing"]
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert(steps["color"]), np.float32)[None] * steps["scale"]
    mean = np.asarray(steps["mean"], np.float32).reshape(-1, 1, 1)
    std = np.asarray(steps["std"], np.float32).reshape(-1, 1, 1)
    return torch.from_numpy((pixels - mean) / std)[None]
