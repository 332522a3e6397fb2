import os

import pytest

# Opt-in CPU accounting per test file (TEST_CPU_LOG=FILE): tests/cpu_accounting.py.
from tests.cpu_accounting import pytest_configure, pytest_runtest_protocol  # noqa: F401

# Keep tests off any real experiment service and quiet about it.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One compute thread for each of make test's workers and the processes they start: two workers with
    # torch's default of a thread per core each spin OpenMP threads against each other, which made the
    # in-process runs 3-18x slower than the same tests one worker at a time (measured on 2 cores).
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(variable, "1")

#: The real-run modules `make test-quick` adds to the unit tests: a few seconds each, and between them
#: a default run, a failure, the non-finite guard, one optimizer for every measurement, a team's own
#: optimizer and the lr schedule.
QUICK_RUN_MODULES = {"test_default_run.py", "test_failure.py", "test_nonfinite_run.py", "test_one_optimizer.py",
                     "test_team_optimizer.py", "test_lr_schedule.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path
        if (path.parent.name == "unit" and not item.get_closest_marker("slow")) or path.name in QUICK_RUN_MODULES:
            item.add_marker(pytest.mark.quick)
