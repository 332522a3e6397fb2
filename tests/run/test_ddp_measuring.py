"""diagnose=true and profile=true on two CPU processes (gloo, started by Lightning): the all-reduce
gets its figures and its share of the step, every process measures the same steps (else the run
would hang in a collective), and rank 0 alone writes and prints.

Who wrote what in the run folder is recorded by an audit hook: each file opened for writing, renamed
into place there, with the writer's rank. Rank 0 is forked from this pytest process
(tests.helpers.ddp_forked); rank 1, started by Lightning's launcher through a stand-in interpreter, is
forked from this process too: ddp_forked's setup installs the hook in both. The same hook is also a
`sitecustomize` on PYTHONPATH, so any rank started as a new interpreter is audited as well. The arithmetic is
tests/unit/test_ddp_measuring.py."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import Result, ddp_forked

pytestmark = [pytest.mark.run, pytest.mark.slow]

TWO_CPU_PROCESSES = ["trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu", "progress=plain"]

AUDIT = '''
import os, sys
_root, _log = os.environ.get("WRITE_AUDIT_ROOT"), os.environ.get("WRITE_AUDIT_LOG")
if _root and _log:
    _fd = os.open(_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT

    def _written(event, args):
        if event == "open":
            path, mode, flags = args
            if not ((isinstance(mode, str) and any(c in mode for c in "wax+"))
                    or (isinstance(flags, int) and flags & _WRITING)):
                return
        elif event == "os.rename":
            path = args[1]
        elif event == "os.mkdir":
            path = args[0]
        else:
            return
        if isinstance(path, int):
            return
        path = os.path.abspath(os.fsdecode(path))
        if path.startswith(_root):
            rank = os.environ.get("LOCAL_RANK") or os.environ.get("RANK") or "0"
            os.write(_fd, f"{rank}\\t{path}\\n".encode())

    sys.addaudithook(_written)
'''


def _launch(overrides: list[str], root: Path, timeout: float = 180) -> tuple[Result, dict[str, set[str]]]:
    """train.py on two CPU processes under `root`, and the paths under `root` each rank wrote."""
    audit = root / "audit"
    audit.mkdir(parents=True)
    (audit / "sitecustomize.py").write_text(AUDIT)
    runs = root / "runs"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(audit), os.environ.get("PYTHONPATH")])),
           "WRITE_AUDIT_ROOT": str(runs), "WRITE_AUDIT_LOG": str(audit / "writes.tsv")}

    def audit_rank() -> None:  # what the sitecustomize does in a new interpreter; ddp_forked runs it in every rank
        namespace: dict[str, Any] = {}
        exec(AUDIT, namespace)

    result = ddp_forked([*TWO_CPU_PROCESSES, *overrides], root, timeout=timeout, setup=audit_rank, env=env)
    writes: dict[str, set[str]] = {}
    log = audit / "writes.tsv"
    for line in log.read_text().splitlines() if log.exists() else []:
        rank, path = line.split("\t", 1)
        if not Path(path).is_dir():  # every process makes (or finds) the run folder: Hydra's os.makedirs
            writes.setdefault(rank, set()).add(path)
    return result, writes


def _only_run_folder(root: Path) -> Path:
    folders = [p for p in (root / "runs").glob("*/*") if p.is_dir()]
    assert len(folders) == 1, f"one run folder for all ranks, found {folders}"
    return folders[0]


def test_diagnose_under_ddp_times_the_all_reduce_and_rank_zero_alone_writes(tmp_path):
    result, writes = _launch(["diagnose=true", "diagnose_steps=5"], tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    folder = _only_run_folder(tmp_path)
    record = json.loads((folder / "diagnosis.json").read_text())
    full = record["ms_per_step"]["full_step"]
    comm = record["communication"]
    assert comm["processes"] == 2 and comm["backend"] == "gloo" and comm["dtype"] == "float32"
    # Every gradient of the default small CNN, in fp32, once per step.
    assert comm["gradient_bytes"] == 4 * record["context"]["parameters"]
    # The three figures are separately timed medians on two cores the two processes share: no assertion here
    # orders them. CI once saw exposed at -1.39 ms (the backward hid the whole all-reduce) and once at 70 ms
    # against a 51 ms full step (the no_sync steps ran faster than the full ones by more than a step).
    # What is checked is that each is a finite measurement and that every figure derived from them agrees.
    assert comm["alone_ms"] > 0 and math.isfinite(comm["alone_ms"]), comm
    assert comm["alone_share_of_full_step"] == pytest.approx(comm["alone_ms"] / full)
    exposed = comm["exposed_ms"]
    counted = max(0.0, exposed)  # below zero counts as none; the diagnosis says so when within its noise
    assert math.isfinite(exposed), comm
    assert comm["exposed_share_of_full_step"] == pytest.approx(counted / full)
    assert record["shares_of_full_step"].get("all-reduce (exposed)", 0.0) == pytest.approx(counted / full)
    assert record["derived_ms"]["all_reduce_exposed"] == pytest.approx(counted)
    assert ("within its noise" in output) == (exposed <= comm["exposed_noise_ms"]), comm
    # Printed once, by rank 0: the timings per process and the all-reduce's two figures.
    assert output.count("diagnosis at batch 64, each of 2 processes") == 1
    assert output.count("gradient all-reduce (2 processes on gloo") == 1
    assert output.count("exposed (step - step under no_sync)") == 1
    assert (folder / "diagnosis.png").is_file()
    assert writes.get("0") and str(folder / "diagnosis.json") in writes["0"]
    assert not writes.get("1"), f"rank 1 wrote {sorted(writes.get('1', []))}"


def test_profile_under_ddp_puts_the_all_reduce_in_its_category_and_rank_zero_alone_writes(tmp_path):
    result, writes = _launch(["profile=true", "profile_steps=2"], tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    profile = _only_run_folder(tmp_path) / "profile"
    record = json.loads((profile / "profile.json").read_text())
    shares = {c["category"]: c["share"] for c in record["categories"]}
    assert shares.get("communication", 0) > 0, shares
    reduce = record["all_reduce"]
    assert 0 < reduce["ms_per_step"] < record["step_ms"]
    assert reduce["share"] == pytest.approx(reduce["ms_per_step"] / record["step_ms"])
    ops = (profile / "ops.md").read_text()
    line = next(line for line in ops.splitlines() if line.startswith("all-reduce: "))
    assert f"{reduce['ms_per_step']:.2f} ms/step, {reduce['share']:.1%} of the step" in line
    assert "overlapped with backward by DDP's buckets where the device allows" in line
    assert "| communication |" in ops
    assert len(list(profile.glob("*.pt.trace.json"))) == 1  # rank 0's trace alone
    assert output.count("profile written:") == 1 and output.count("profile: all-reduce: ") == 1
    assert writes.get("0") and str(profile / "ops.md") in writes["0"]
    assert not writes.get("1"), f"rank 1 wrote {sorted(writes.get('1', []))}"
