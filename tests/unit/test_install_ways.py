"""docs/install.md's CPU-only ways: `make install TORCH_INDEX=...` adds PyTorch's index to the one pip
command, and the page's sizes are the ones benchmarks/install_size.sh wrote."""

import re
import shutil
import subprocess

import pytest

from tests.helpers import REPO

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _install_line(*make_args):
    proc = subprocess.run(["make", "-n", "-B", ".venv/.installed", *make_args], cwd=REPO, capture_output=True,
                          text=True, check=True)
    return next(line for line in proc.stdout.splitlines() if "pip install" in line)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_torch_index_joins_make_installs_one_pip_command():
    assert _install_line(f"TORCH_INDEX={CPU_INDEX}").endswith(f'-e ".[all,test]" --extra-index-url {CPU_INDEX}')
    assert "--extra-index-url" not in _install_line()  # make install as it always was


def test_the_pages_sizes_are_the_measured_ones():
    measured = {}
    for line in (REPO / "benchmarks/results/install_size.txt").read_text().splitlines():
        fields = dict(re.findall(r"(\w+)=(\S+)", line))
        measured[fields["way"]] = fields
    page = (REPO / "docs/install.md").read_text()
    for way, row_start in (("default", "| `pip install gpu-practice-trainer`"), ("checkout", "| `make install`"),
                           ("cpu_disk", "| CPU build of torch")):
        row = next(line for line in page.splitlines() if line.startswith(row_start))
        assert f"{int(measured[way]['venv_mb']):,} MB" in row, (way, row)
        assert f"{measured[way]['seconds']} s" in row, (way, row)
