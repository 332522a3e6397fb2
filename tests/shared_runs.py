"""Trained runs made once per test session and shared by the test files that read them, across
pytest-xdist's workers: the first file to ask trains the run (under a file lock in the session's
temporary folder, which the workers share), the others wait for it and read the same folder.

A shared run is read-only: a test that writes into a run (an export, a load report) works on a copy
(`copy_run`). A run that failed is not trained again by every file that asks: the next ones fail
with its message. Without xdist the session's own temporary folder holds them.

The recipes' own tests train the runs as a person would (tests/run/test_language_model.py,
tests/run/test_sequence_classification_run.py); the tests that only need "a trained GPT" or "a
trained encoder" (serving, generation, export) read the same runs instead of training their own.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

#: The tiny GPT recipe shortened to 80 of its 427 steps, on the CPU: val perplexity 376 measured
#: against the corpus's unigram baseline of 565 (tests/run/test_language_model.py holds it to three
#: quarters of the baseline), with a target perplexity so that time to target is recorded.
GPT_RECIPE_SHORT = ["+recipe=gpt_tiny_text", "trainer.accelerator=cpu", "trainer.max_steps=80",
                    "trainer.val_check_interval=40", "progress=off"]
GPT_TARGET = ["target.metric=val/perplexity", "target.value=450"]


def session_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder every worker of this session shares: the parent of a worker's basetemp under xdist
    (<session>/popen-gwN), the basetemp itself without it."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_run(tmp_path_factory: pytest.TempPathFactory, name: str, train: Callable[[Path], None]) -> Path:
    """The run folder `name`, trained by `train(folder)` once for the session (`train` raises when
    the run failed); returned once it is complete."""
    from filelock import FileLock

    root = session_folder(tmp_path_factory) / "shared-runs"
    root.mkdir(exist_ok=True)
    folder, complete, failed = root / name, root / f"{name}.complete", root / f"{name}.failed"
    with FileLock(str(root / f"{name}.lock")):
        if failed.exists():
            raise AssertionError(f"the shared run {name} failed in another test file:\n{failed.read_text()}")
        if not complete.exists():
            if folder.exists():
                shutil.rmtree(folder)  # left half made by a worker that was killed
            try:
                train(folder)
            except BaseException as ex:
                failed.write_text(f"{type(ex).__name__}: {ex}"[-5000:])
                raise
            complete.touch()
    return folder


def copy_run(run_dir: Path, to: Path) -> Path:
    """A copy of the run folder at `to`, its summary.json and run.json naming the copy's paths (its
    best checkpoint among them) as if it had been trained there."""
    shutil.copytree(run_dir, to, symlinks=True)
    for name in ("summary.json", "run.json"):
        record = to / name
        if record.is_file():
            record.write_text(record.read_text().replace(str(run_dir), str(to)))
    return to


def summary_of(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def gpt_recipe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shortened tiny GPT recipe (GPT_RECIPE_SHORT, with GPT_TARGET), trained in this process
    as train.py would run it (the corpus tokenized into the default cache, as a person's run)."""
    from tests.helpers import run_in_process

    def train(folder: Path) -> None:
        summary = run_in_process([*GPT_RECIPE_SHORT, *GPT_TARGET], folder)
        assert summary is not None and summary["status"] == "completed", summary

    return shared_run(tmp_path_factory, "gpt_tiny_text_short", train)


class TrainedRun:
    """A run trained by `python train.py` (forked): its folder and what it printed."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.stdout = (run_dir.parent / f"{run_dir.name}.stdout").read_text()
        self.stderr = (run_dir.parent / f"{run_dir.name}.stderr").read_text()

    @property
    def summary(self) -> dict[str, Any]:
        return summary_of(self.run_dir)


def encoder_recipe_run(tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    """The tiny encoder recipe whole, as a person runs it (`python train.py +recipe=encoder_tiny_text
    progress=plain`, forked, on the CPU), its prepared data in a cache beside it."""
    from tests.helpers import train_forked

    def train(folder: Path) -> None:
        cache = folder.parent / f"{folder.name}-cache"
        done = train_forked(["+recipe=encoder_tiny_text", "progress=plain", f"data.cache_dir={cache}"], folder,
                            timeout=600)
        (folder.parent / f"{folder.name}.stdout").write_text(done.stdout)
        (folder.parent / f"{folder.name}.stderr").write_text(done.stderr)
        assert done.returncode == 0, done

    return TrainedRun(shared_run(tmp_path_factory, "encoder_tiny_text", train))
