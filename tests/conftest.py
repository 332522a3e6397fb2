import os

import pytest

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

#: Under pytest-xdist (make test runs two workers, --dist loadgroup) a module's tests stay on one
#: worker, so that its module fixtures are made once; so do modules that share more than that: the
#: SLURM cluster the slurm tests start, the digits run the deployment tests train once, the
#: checkout's build/ folder that both wheel tests build in, and the S3 servers on loopback ports that
#: each shard test picks free and then binds (two at once could pick the same).
SHARED = {"slurm": "slurm", "test_deploy.py": "digits_run", "test_serve.py": "digits_run",
          "test_installed_wheel.py": "wheel", "test_extras.py": "wheel",
          "test_shards_run.py": "s3", "test_shard_pipeline_benchmark.py": "s3"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path
        if (path.parent.name == "unit" and not item.get_closest_marker("slow")) or path.name in QUICK_RUN_MODULES:
            item.add_marker(pytest.mark.quick)
        group = SHARED.get(path.name) or SHARED.get(path.parent.name) or f"{path.parent.name}/{path.stem}"
        item.add_marker(pytest.mark.xdist_group(group))
