"""The studies' jobs forked from the pytest worker: `benchmarks/sweep_jobs.run_command` (the one place
a study starts `python train.py -m ...`) replaced by `tests.helpers.python_forked`, the same command
in a forked child that already imported torch and Lightning (about 8 s of CPU saved per multirun on
the 2-core CI machine). For the studies' tests, whose claim is their design, jobs and report, not how
an interpreter starts."""

from __future__ import annotations

import subprocess
from typing import Sequence

import pytest

from tests.helpers import benchmark, python_forked


def fork_study_jobs(monkeypatch: pytest.MonkeyPatch, timeout: float = 600) -> None:
    def forked(command: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return python_forked(list(command)[1:], timeout=timeout)  # command[0] is the interpreter

    monkeypatch.setattr(benchmark("sweep_jobs"), "run_command", forked)
