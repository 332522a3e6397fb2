"""`python train.py --help` through Hydra: the config groups, then every key of the composed config
with its doc (the `config_help` resolver in conf/hydra/help/trainer.yaml), for the choices given."""

import subprocess
import sys

from tests.helpers import REPO


def test_help_shows_each_key_with_its_doc_for_the_chosen_groups():
    proc = subprocess.run([sys.executable, "train.py", "optimizer=sgd", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("optimizer: adamw, sgd") for line in lines)  # the groups and their choices
    group = next(line for line in lines if line.startswith("optimizer:") and "#" in line)
    assert "optimizer=sgd" in group and "trainer/optimizer.py" in group
    momentum = next(line for line in lines if line.startswith("  momentum: 0.9"))
    assert momentum.split("# ", 1)[1] == "momentum factor"
