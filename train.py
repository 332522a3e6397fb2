"""Train an image classifier from a composed Hydra config: `python train.py [group=choice ...] [key=value ...]`."""

import gc

import hydra
from omegaconf import DictConfig

from trainer.configuration.hydra_setup import install as install_hydra_setup

install_hydra_setup()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    # Imported here, once Hydra has composed: `--help` and a mistake in the command line answer
    # without importing torch and Lightning (several seconds).
    from trainer.run import run

    # The several hundred thousand objects the imports made live as long as the process: moved out
    # of the collector's reach, they cost no garbage-collection pass, and the interpreter's exit
    # stops spending about a second traversing them (measured: docs/measured.md).
    gc.freeze()
    return run(cfg)


if __name__ == "__main__":
    main()
