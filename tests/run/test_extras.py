"""The core trains without any extra, and a feature whose extra is missing stops in one line naming
the pip command (trainer/infra/extras.py). The extras' modules are hidden from the child processes
(a path finder blind to them, installed by a sitecustomize): this environment has them all, as
`make install` installs them.

The commands run in forked children of one interpreter started for the module with that
sitecustomize (`HiddenExtras`), which has imported hydra, torch and Lightning once (not the ~6 s of
CPU a new interpreter spends on them before a refusal); the extras are as hidden there as in a new
interpreter, since the path finder is blind to them from its start. What the hook itself does at an
interpreter's start is tested on a new one."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

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


#: The interpreter `HiddenExtras` starts: it imports what every command imports first, then runs each
#: request (a JSON line on its stdin: argv, cwd, env and the files for stdout and stderr) in a forked
#: child as `python ARGV` would (tests.helpers.run_as_python) and answers the child's exit status.
SERVER = '''
import json, os, sys
from pathlib import Path

import hydra, lightning, torch  # noqa: F401 - imported once, inherited by every command

from tests.helpers import run_as_python

for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setpgid(0, 0)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            code = run_as_python(request["argv"], Path(request["cwd"]), request["env"], script_path=True)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)
'''


class HiddenExtras:
    """`python ARGS` with the extras hidden, each in a forked child of one interpreter that has the
    hook (see the module's docstring)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self._tmp = tempfile.TemporaryDirectory(prefix="hidden-extras-")
        self.server = subprocess.Popen([sys.executable, "-c", SERVER], env=env, cwd=REPO, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)

    def _answer(self, deadline: float) -> dict:
        import time

        assert self.server.stdout is not None
        ready, _, _ = select.select([self.server.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = self.server.stdout.readline() if ready else ""
        assert line, "the hidden-extras interpreter ended or did not answer in time"
        return json.loads(line)

    def run(self, python_args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
        import time

        assert self.server.stdin is not None
        out, err = Path(self._tmp.name) / "stdout", Path(self._tmp.name) / "stderr"
        self.server.stdin.write(json.dumps({"argv": python_args, "cwd": str(cwd), "env": self.env,
                                            "stdout": str(out), "stderr": str(err)}) + "\n")
        self.server.stdin.flush()
        deadline = time.monotonic() + timeout
        pid = self._answer(deadline)["pid"]
        try:
            status = self._answer(deadline)["status"]
        except AssertionError:
            os.killpg(pid, signal.SIGKILL)
            raise
        return subprocess.CompletedProcess(python_args, status, out.read_text(), err.read_text())

    def close(self) -> None:
        assert self.server.stdin is not None
        self.server.stdin.close()
        try:
            self.server.wait(60)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()
        self._tmp.cleanup()


@pytest.fixture(scope="module")
def core_only(tmp_path_factory) -> dict[str, str]:
    hook = tmp_path_factory.mktemp("core_only")
    (hook / "sitecustomize.py").write_text(HOOK)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(REPO)]), "WANDB_MODE": "offline"}


@pytest.fixture(scope="module")
def hidden(core_only) -> Iterator[HiddenExtras]:
    commands = HiddenExtras(core_only)
    try:
        yield commands
    finally:
        commands.close()


def _train(args: list[str], hidden: HiddenExtras, cwd: Path) -> subprocess.CompletedProcess:
    return hidden.run([str(REPO / "train.py"), *args], cwd)


def test_the_hook_hides_the_extras(core_only, hidden, tmp_path):
    """In a new interpreter started with the hook, and in the forked commands of the module's one."""
    done = subprocess.run([sys.executable, "-c", "import timm"], env=core_only, capture_output=True, text=True)
    assert done.returncode != 0 and "No module named 'timm'" in done.stderr
    done = hidden.run(["-m", "timm"], tmp_path)
    assert done.returncode != 0 and "No module named timm" in done.stderr, done.stderr[-2000:]


def test_the_core_trains_the_default_run(hidden, tmp_path):
    done = _train(["trainer.max_epochs=1", "trainer.limit_train_batches=4", "checkpointing=off", "progress=plain",
                   f"run.root={tmp_path}"], hidden, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    [summary] = list(tmp_path.rglob("summary.json"))
    assert json.loads(summary.read_text())["status"] == "completed"


@pytest.mark.parametrize("args, extra", [
    (["model=timm"], "timm"), (["optimizer=lamb"], "timm"), (["logger=wandb"], "wandb"),
    (["logger=[csv,tensorboard]"], "tensorboard"), (["data=shards", "data.source=/nowhere"], "shards"),
])
def test_a_feature_without_its_extra_is_one_line_with_the_pip_command(hidden, tmp_path, args, extra):
    done = _train([*args, "trainer.max_epochs=1", f"run.root={tmp_path}"], hidden, tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert f"pip install 'gpu-practice-trainer[{extra}]'" in lines[0] and "not installed" in lines[0]


def test_deploy_without_its_extra_is_one_line(hidden, tmp_path):
    done = hidden.run(["-m", "trainer.deploy", "export", str(tmp_path)], REPO, timeout=120)
    assert done.returncode == 2 and "pip install 'gpu-practice-trainer[deploy]'" in done.stderr, done.stderr
