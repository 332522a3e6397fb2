"""Train an image classifier from a composed Hydra config: `python train.py [group=choice ...] [key=value ...]`."""

import hydra
from omegaconf import DictConfig

from trainer.hydra_setup import prepare

prepare()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    # Imported here, once Hydra has composed: `--help` and a mistake in the command line answer
    # without importing torch and Lightning (several seconds).
    from trainer.run import run

    return run(cfg)


if __name__ == "__main__":
    main()
