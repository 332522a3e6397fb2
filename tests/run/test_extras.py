"""The core trains without any extra, and a feature whose extra is missing stops in one line naming
the pip command (trainer/infra/extras.py). The extras' modules are hidden from the child processes
(a path finder blind to them, installed by a sitecustomize): this environment has them all, as
`make install` installs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from trainer.infra.extras import EXTRAS

pytestmark = [pytest.mark.run, pytest.mark.slow]

HIDDEN = sorted({module for modules in EXTRAS.values() for module in modules} - {"hydra_plugins.hydra_optuna_sweeper",
                                                                              "hydra_plugins.hydra_submitit_launcher"})
HOOK = f'''
import sys
from importlib.machinery import PathFinder

HIDDEN = {HIDDEN!r}


def hidden(name):
    return any(name == module or name.startswith(module + ".") for module in HIDDEN)


class HidingPathFinder:
    """The path finder, blind to the extras' modules: to an import or a find_spec they are absent."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if hidden(name) else PathFinder.find_spec(name, path, target)

    @classmethod
    def invalidate_caches(cls):
        PathFinder.invalidate_caches()


sys.meta_path[:] = [HidingPathFinder if finder is PathFinder else finder for finder in sys.meta_path]
'''


@pytest.fixture(scope="module")
def core_only(tmp_path_factory) -> dict[str, str]:
    hook = tmp_path_factory.mktemp("core_only")
    (hook / "sitecustomize.py").write_text(HOOK)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(REPO)]), "WANDB_MODE": "offline"}


def _train(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_the_hook_hides_the_extras(core_only, tmp_path):
    done = subprocess.run([sys.executable, "-c", "import timm"], env=core_only, capture_output=True, text=True)
    assert done.returncode != 0 and "No module named 'timm'" in done.stderr


def test_the_core_trains_the_default_run(core_only, tmp_path):
    done = _train(["trainer.max_epochs=1", "trainer.limit_train_batches=4", "checkpointing=off", "progress=plain",
                   f"run.root={tmp_path}"], core_only, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    [summary] = list(tmp_path.rglob("summary.json"))
    assert json.loads(summary.read_text())["status"] == "completed"


@pytest.mark.parametrize("args, extra", [
    (["model=timm"], "timm"), (["optimizer=lamb"], "timm"), (["logger=wandb"], "wandb"),
    (["logger=[csv,tensorboard]"], "tensorboard"), (["data=shards", "data.source=/nowhere"], "shards"),
])
def test_a_feature_without_its_extra_is_one_line_with_the_pip_command(core_only, tmp_path, args, extra):
    done = _train([*args, "trainer.max_epochs=1", f"run.root={tmp_path}"], core_only, tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert f"pip install 'gpu-practice-trainer[{extra}]'" in lines[0] and "not installed" in lines[0]


def test_deploy_without_its_extra_is_one_line(core_only, tmp_path):
    done = subprocess.run([sys.executable, "-m", "trainer.deploy", "export", str(tmp_path)], env=core_only,
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "pip install 'gpu-practice-trainer[deploy]'" in done.stderr, done.stderr
