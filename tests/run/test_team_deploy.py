"""A team's run deploys from any folder (issue 41, item 1): a scaffolded team folder trains its recipe,
the run records the team folder (summary.json's ``team_dirs``), and `python -m trainer.deploy export`
and `serve`, typed in another folder, import the team's network and data from the recorded folder, or
from TRAINER_TEAM_DIRS when the folder has moved since. A class that still does not import is one line
naming both remedies, and a failed export leaves no folder behind (nor changes one that was there).

The training and the exports run as forked `python -m` commands that know no more of the team than a
new interpreter would (`_python_m`); the server is a new interpreter."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import ForkedRun, stop_server
from trainer.configuration.recipes import TEAM_DIRS_VARIABLE
from trainer.deploy import export as export_module
from trainer.deploy.export import export_run, onnx_logits
from trainer.deploy.load import client_samples
from trainer.infra.errors import UserError
from trainer.infra.processes import descendants, free_port, running
from trainer.scaffold import scaffold

pytestmark = pytest.mark.run

#: Its own package name: this module puts the team folder on the test process's sys.path (the
#: in-process export), where a package named like another test's team would be found first.
PACKAGE = "deploy_team"
GONE = "/nonexistent/team-folder-moved-away"


def _env(team_dirs: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (TEAM_DIRS_VARIABLE, "HYDRA_FULL_ERROR")}
    return env | ({TEAM_DIRS_VARIABLE: team_dirs} if team_dirs else {})


def _as_a_new_interpreter() -> None:
    """A `setup` for a forked `python -m ...` (tests.helpers.ForkedRun): what this test process knows of
    the team's package forgotten (the in-process exports below put the team folder on sys.path and
    import it), and the working folder first on sys.path, as `python -m` puts it. The command then
    finds the team's package only as a new interpreter would: from the folder the run recorded, from
    TRAINER_TEAM_DIRS, or from the folder it is typed in."""
    import importlib

    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]
    sys.path[:] = [p for p in sys.path if not (Path(p or ".") / PACKAGE).is_dir()]
    sys.path.insert(0, os.getcwd())
    importlib.invalidate_caches()


def _python_m(args: list[str], cwd: Path, team_dirs: str | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m ARGS` typed in `cwd`, in a forked child of this process (torch and Lightning already
    imported) that knows no more of the team than a new interpreter (`_as_a_new_interpreter`)."""
    with ForkedRun(["-m", *args], setup=_as_a_new_interpreter, cwd=cwd, env=_env(team_dirs)) as child:
        done = child.wait(300)
    return subprocess.CompletedProcess(["-m", *args], done.returncode, done.stdout, done.stderr)


def _deploy(args: list[str], cwd: Path, team_dirs: str | None = None) -> subprocess.CompletedProcess[str]:
    return _python_m(["trainer.deploy", *args], cwd, team_dirs)


@pytest.fixture(scope="module")
def team_run(tmp_path_factory) -> tuple[Path, Path]:
    """(team folder, run folder): the scaffold's digits recipe, one short epoch, trained as a person
    does, from the team folder (`python -m trainer ...`, forked: `_python_m`)."""
    root = tmp_path_factory.mktemp("team_deploy")
    team = root / "team"
    scaffold(team, package=PACKAGE)
    run_dir = root / "run"
    done = _python_m(["trainer", f"+recipe={PACKAGE}_digits", "trainer.max_epochs=1", "trainer.limit_train_batches=4",
                      "trainer.accelerator=cpu", "progress=off", f"hydra.run.dir={run_dir}"], team)
    assert done.returncode == 0, done.stderr[-3000:]
    return team, run_dir


def _copy_run(run_dir: Path, to: Path, team_dirs: list[str] | None = None) -> Path:
    """A copy of the run without its export; `team_dirs` rewrites what it recorded (a team folder that
    has moved since the run)."""
    shutil.copytree(run_dir, to, ignore=shutil.ignore_patterns("export"))
    if team_dirs is not None:
        summary = json.loads((to / "summary.json").read_text())
        summary["team_dirs"] = team_dirs
        (to / "summary.json").write_text(json.dumps(summary))
    return to


def test_the_run_records_its_team_folder(team_run):
    team, run_dir = team_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["team_dirs"] == [str(team.resolve())]
    assert summary["model"]["target"] == f"{PACKAGE}.models.TeamNet"


def test_export_from_another_folder_imports_the_recorded_team_folder(team_run, tmp_path):
    """No TRAINER_TEAM_DIRS, the working directory elsewhere: the recorded folder is enough; the
    exported model gives the team network's logits (the export's own check, within its bound)."""
    _, run_dir = team_run
    run = _copy_run(run_dir, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = _deploy(["export", str(run)], elsewhere)
    assert done.returncode == 0, done.stderr[-3000:]
    card = json.loads((run / "export" / "model.json").read_text())
    assert card["model"] == f"{PACKAGE}.models.TeamNet" and card["classes"] == [str(d) for d in range(10)]
    assert max(card["checked"]["max_abs_diff"].values()) <= card["checked"]["bound"]
    assert card["checked"]["images"] == 64
    assert list(elsewhere.iterdir()) == []  # nothing written where the command was typed


def test_a_missing_team_class_is_one_line_naming_the_remedies_and_leaves_no_export(team_run, tmp_path):
    """The recorded folder gone and no TRAINER_TEAM_DIRS: one line that names the variable and the
    recorded folder; no export/ folder is left, and the run folder holds what it held before."""
    _, run_dir = team_run
    run = _copy_run(run_dir, tmp_path / "run", team_dirs=[GONE])
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    done = _deploy(["export", str(run)], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"error: data._target_: cannot import '{PACKAGE}.data.NoisyDigits': no module named "
                           f"'{PACKAGE}'")
    assert TEAM_DIRS_VARIABLE in line and f"{GONE} no longer exists" in line
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_serve_without_an_export_imports_from_trainer_team_dirs(team_run, tmp_path):
    """`serve` of a run without an export, from another folder, the team folder moved since the run
    (the recorded one is gone): TRAINER_TEAM_DIRS finds it; the export made on the way serves one
    posted digit with the probabilities ONNX Runtime gives the same picture."""
    team, run_dir = team_run
    moved = tmp_path / "moved-team"
    shutil.copytree(team, moved)
    run = _copy_run(run_dir, tmp_path / "run", team_dirs=[GONE])
    [sample] = client_samples(run_dir, count=1)  # a test digit as a PNG file (from the original run)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    port = free_port()
    log = tmp_path / "serve.log"
    # A new interpreter, not a forked one: the server starts LitServe's processes, and a fork of a fork of
    # this multi-threaded pytest can hang in a lock it inherited (tests/run/test_serve.py).
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "trainer.deploy", "serve", str(run), "--port", str(port)],
                                  cwd=elsewhere, env=_env(str(moved)), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_ready(server, f"http://127.0.0.1:{port}/health", log)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/predict", data=sample.body,
                                         headers={"Content-Type": sample.content_type})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
            answer = json.loads(response.read())
    finally:
        children = descendants(server.pid)
        stop_server(server)
    card = json.loads((run / "export" / "model.json").read_text())
    assert card["model"] == f"{PACKAGE}.models.TeamNet"
    expected = torch.softmax(onnx_logits(run / "export" / "model.onnx", _preprocessed(sample.body, card)), 1)[0]
    top = answer["top_k"][0]
    assert top["index"] == int(expected.argmax())
    assert top["probability"] == pytest.approx(float(expected.max()), abs=1e-4)
    # Stopped by its pid, with exit code 0; its children end on their own once it is gone (the resource
    # tracker when its pipe closes): up to 30 s on a busy machine.
    assert server.returncode == 0, log.read_text()[-3000:]
    deadline = time.monotonic() + 30
    while running(children) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert not running(children)



def _wait_ready(server: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"serve stopped ({server.returncode}): {log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"serve not ready after {timeout_s} s: {log.read_text()[-3000:]}")


def _preprocessed(png: bytes, card: dict) -> torch.Tensor:
    """The picture as training's preprocessing gives it to the network (the card's scale, mean, std;
    the digit is already at the network's size)."""
    from PIL import Image

    steps = card["preprocessing"]
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert(steps["color"]), np.float32)[None] * steps["scale"]
    mean = np.asarray(steps["mean"], np.float32).reshape(-1, 1, 1)
    std = np.asarray(steps["std"], np.float32).reshape(-1, 1, 1)
    return torch.from_numpy((pixels - mean) / std)[None]


class _Failed(Exception):
    pass


@pytest.mark.parametrize("existing", [False, True], ids=["new", "over-an-earlier-export"])
def test_an_export_that_fails_while_writing_leaves_nothing_behind(team_run, tmp_path, monkeypatch, existing):
    """A failure after the first files are written (the torch.export step): no export folder where
    there was none, an earlier export byte for byte as it was, and no partial folder beside it."""
    _, run_dir = team_run
    run = _copy_run(run_dir, tmp_path / "run")
    earlier = {"model.json": b'{"earlier": true}\n', "model.onnx": b"earlier onnx", "notes.txt": b"mine"}
    if existing:
        (run / "export").mkdir()
        for name, body in earlier.items():
            (run / "export" / name).write_bytes(body)

    def failing(net, images, path, *limits):  # limits: an encoder's max_length
        path.write_bytes(b"half a program")
        raise _Failed("the exporter failed")

    monkeypatch.setattr(export_module, "write_program", failing)
    with pytest.raises(_Failed):
        export_run(run)
    if existing:
        assert {p.name: p.read_bytes() for p in (run / "export").iterdir()} == earlier
    else:
        assert not (run / "export").exists()
    assert [p.name for p in run.iterdir() if p.name.startswith(".export")] == []
    # A nested --out whose parents did not exist: none of them is left.
    with pytest.raises(_Failed):
        export_run(run, out=tmp_path / "new" / "nested" / "export")
    assert not (tmp_path / "new").exists()


def test_an_export_over_an_earlier_one_replaces_its_files_and_keeps_the_others(team_run, tmp_path):
    _, run_dir = team_run
    run = _copy_run(run_dir, tmp_path / "run")
    (run / "export").mkdir()
    (run / "export" / "model.onnx").write_bytes(b"earlier onnx")
    (run / "export" / "notes.txt").write_text("mine")
    exported = export_run(run)
    assert exported.folder == run / "export" and exported.files["onnx"] == run / "export" / "model.onnx"
    assert (run / "export" / "notes.txt").read_text() == "mine"
    assert (run / "export" / "model.onnx").read_bytes() != b"earlier onnx"
    card = json.loads((run / "export" / "model.json").read_text())
    assert card["model"] == f"{PACKAGE}.models.TeamNet"
    assert [p.name for p in run.iterdir() if p.name.startswith(".export")] == []


def test_a_user_error_names_the_final_folder_not_the_staging_one(team_run, tmp_path, monkeypatch):
    """The export's own check failing (logits that differ): the line names the export folder."""
    _, run_dir = team_run
    run = _copy_run(run_dir, tmp_path / "run")
    monkeypatch.setattr(export_module, "program_logits", lambda path, images: torch.full((len(images), 10), 1e3))
    with pytest.raises(UserError) as raised:
        export_run(run)
    assert raised.value.where == str(run / "export" / "model.pt2") and "differ from PyTorch's" in raised.value.problem
    assert not (run / "export").exists()
