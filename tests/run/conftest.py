import pytest

from tests.helpers import run_in_process


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """A short default digits run (3 epochs), shared by the deployment tests: (run folder, summary)."""
    run_dir = tmp_path_factory.mktemp("digits_run")
    summary = run_in_process(["trainer.max_epochs=3", "trainer.accelerator=cpu", "progress=plain"], run_dir)
    return run_dir, summary
