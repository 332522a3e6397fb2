"""The SLURM launcher choice maps the run's devices and nodes onto SLURM's tasks and GPUs."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.helpers import CONF
from trainer.configuration.hydra_setup import install as install_hydra_setup


def launcher(overrides: list[str]) -> dict:
    install_hydra_setup()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
        return OmegaConf.to_container(cfg.hydra.launcher, resolve=False) | {
            key: cfg.hydra.launcher[key] for key in ("nodes", "tasks_per_node", "gpus_per_node")}


def test_slurm_runs_one_task_per_device_on_each_node():
    chosen = launcher(["hydra/launcher=slurm", "trainer.devices=4", "trainer.num_nodes=2",
                       "hydra.launcher.partition=gpu"])
    assert chosen["_target_"].endswith("SlurmLauncher")
    assert (chosen["nodes"], chosen["tasks_per_node"], chosen["gpus_per_node"]) == (2, 4, 4)
    assert chosen["partition"] == "gpu" and chosen["timeout_min"] == 240


def test_slurm_needs_a_count_of_devices_and_says_so_in_one_line():
    import pytest
    from omegaconf.errors import InterpolationResolutionError

    from trainer.configuration.hydra_setup import describe_user_error

    assert launcher(["hydra/launcher=slurm", "trainer=ddp", "trainer.devices=[0,1,2]"])["tasks_per_node"] == 3
    with pytest.raises(InterpolationResolutionError) as caught:
        launcher(["hydra/launcher=slurm", "trainer=ddp"])  # trainer=ddp's devices: auto
    assert describe_user_error(caught.value) == (
        "trainer.devices: 'auto' is not a count of devices per node, which hydra/launcher=slurm needs to size "
        "each job's tasks and GPUs; allowed: a number such as trainer.devices=8, or a list of ids")


def test_local_launcher_is_the_same_path_on_this_machine():
    chosen = launcher(["hydra/launcher=local"])
    assert chosen["_target_"].endswith("LocalLauncher")
    assert (chosen["nodes"], chosen["tasks_per_node"], chosen["gpus_per_node"]) == (1, 1, 0)
