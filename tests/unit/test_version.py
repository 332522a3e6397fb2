"""`python train.py --version` names the project and the libraries a run depends on, not Hydra alone,
and answers without composing a config or importing torch."""

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from trainer.configuration.hydra_setup import version_line

REPO = Path(__file__).resolve().parents[2]


def test_the_version_line_names_the_project_and_its_libraries():
    line = version_line()
    assert line.startswith(f"gpu-practice-trainer {version('gpu-practice-trainer')} (")
    for library in ("torch", "lightning", "hydra-core", "timm"):
        assert f"{library} {version(library)}" in line


def test_train_py_answers_version_with_the_projects_line():
    done = subprocess.run([sys.executable, str(REPO / "train.py"), "--version"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == version_line() and "Hydra" not in done.stdout


def test_a_second_distribution_in_the_trainer_import_package_is_named(monkeypatch):
    import trainer.infra.versions as versions

    monkeypatch.setattr(versions, "packages_distributions",
                        lambda: {"trainer": ["gpu_practice_trainer", "trainer"], "torch": ["torch"]})
    assert versions.import_name_clashes() == ["trainer"]
    monkeypatch.setattr(versions, "packages_distributions", lambda: {"trainer": ["gpu-practice-trainer"]})
    assert versions.import_name_clashes() == []
