"""The SLURM launcher choice maps the run's devices and nodes onto SLURM's tasks and GPUs."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.helpers import CONF
from trainer.cli import prepare


def launcher(overrides: list[str]) -> dict:
    prepare()
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


def test_local_launcher_is_the_same_path_on_this_machine():
    chosen = launcher(["hydra/launcher=local"])
    assert chosen["_target_"].endswith("LocalLauncher")
    assert (chosen["nodes"], chosen["tasks_per_node"], chosen["gpus_per_node"]) == (1, 1, 0)
