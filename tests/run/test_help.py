"""`python train.py --help` through Hydra: the config groups, then every key of the composed config
with its doc (the `config_help` resolver in conf/hydra/help/trainer.yaml), for the choices given.

Each command runs forked from this process (`train_forked`, `python_forked`): what is checked is the
text, which names the command from its argv[0] (trainer.infra.command), as runpy sets it."""

import pytest

from tests.helpers import REPO, python_forked, train_forked


def test_help_shows_each_key_with_its_doc_for_the_chosen_groups(tmp_path):
    proc = train_forked(["--help", "optimizer=sgd"], tmp_path / "run")  # the overrides after the flag, in one run
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("optimizer: adamw, lamb, lars, sgd") for line in lines)  # the groups and their choices
    group = next(line for line in lines if line.startswith("optimizer:") and "#" in line)
    assert "optimizer=sgd" in group and "trainer/groups/optimizer/" in group
    momentum = next(line for line in lines if line.startswith("  momentum: 0.9"))
    assert momentum.split("# ", 1)[1] == "momentum factor (default: 0)"  # torch.optim.SGD's own doc


@pytest.mark.parametrize("entry, typed", [
    (["-m", "trainer"], "python -m trainer"),
    ([str(REPO / "train.py")], "python train.py"),
])
def test_help_speaks_the_command_that_was_typed(tmp_path, entry, typed):
    # From an empty folder, as a wheel user runs it: no example names a train.py they do not have.
    proc = python_forked([*entry, "--help"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first, *rest = proc.stdout.splitlines()
    assert first.startswith(f"{typed}: ")
    others = {"python -m trainer", "python train.py", "gpu-practice-train"} - {typed}
    assert not [line for line in proc.stdout.splitlines() if any(other in line for other in others)]
    assert f"  {typed} scaffold " in proc.stdout and f"  {typed} deploy serve " in proc.stdout


def test_deploy_is_a_subcommand_of_the_entry_point(tmp_path):
    proc = python_forked(["-m", "trainer", "deploy", "--help"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m trainer deploy ")
    assert "export" in proc.stdout and "serve" in proc.stdout
