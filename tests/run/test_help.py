"""`python train.py --help` through Hydra: the config groups, then every key of the composed config
with its doc (the `config_help` resolver in conf/hydra/help/trainer.yaml), for the choices given."""

from tests.helpers import train_forked


def test_help_shows_each_key_with_its_doc_for_the_chosen_groups(tmp_path):
    proc = train_forked(["--help", "optimizer=sgd"], tmp_path / "run")  # the overrides after the flag, in one run
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("optimizer: adamw, lamb, lars, sgd") for line in lines)  # the groups and their choices
    group = next(line for line in lines if line.startswith("optimizer:") and "#" in line)
    assert "optimizer=sgd" in group and "trainer/groups/optimizer/" in group
    momentum = next(line for line in lines if line.startswith("  momentum: 0.9"))
    assert momentum.split("# ", 1)[1] == "momentum factor (default: 0)"  # torch.optim.SGD's own doc
