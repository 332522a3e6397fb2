"""``python -m trainer scaffold DIR [--package NAME]``: a starter team folder.

A recipe that builds on a shipped one, the team's own network and data module, and a test that
composes and checks every recipe of the folder; docs/install.md ("A team's own folder") says how it
is used. Compare torchtune's ``tune cp`` and the Lightning-Hydra template."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Optional

from trainer.infra.errors import UserError, exit_with

README = """\
# {package}: recipes and code for gpu-practice-trainer

    python -m trainer +recipe={package}_digits            # train the team's recipe (from this folder)
    python -m trainer +recipe={package}_digits --help     # every key, with its doc
    python -m pytest tests                                # compose and check every recipe

From this folder, the framework finds `recipes/` and `conf/` here beside its own (elsewhere: put this
folder in TRAINER_TEAM_DIRS), and imports `{package}/` for the `_target_` of the configs.
"""

RECIPE = """\
# @package _global_
# Builds on the shipped digits_quickstart recipe: the team's network and data, a few more epochs.
# `summary.json` records the parent and every key this recipe changes (recipe.differs_from_parent).
defaults:
  - digits_quickstart
  - override /model: {package}_net
  - override /data: {package}_digits
  - _self_

trainer:
  max_epochs: 3
"""

MODEL_CONF = """\
# The team's network (a config group choice: model={package}_net). Its constructor's signature is
# the schema: a key it does not take is refused in one line.
_target_: {package}.models.TeamNet
width: 32
activation_checkpointing: []
"""

DATA_CONF = """\
# The team's data (data={package}_digits): the shipped digits with pixel noise added.
defaults:
  - digits
  - _self_

_target_: {package}.data.NoisyDigits
noise: 0.5
"""

INIT = '"""{package}: the team\'s own networks and data for gpu-practice-trainer."""\n'

MODELS = '''\
"""The team's networks. `num_classes` and `in_channels` come from the data; the other arguments are
the keys of conf/model/{package}_net.yaml."""

from torch import nn


class TeamNet(nn.Module):
    """Two Conv-BN-ReLU blocks, global pooling and a linear head.

    Args:
        num_classes: classes to predict (from the data).
        in_channels: image channels (from the data).
        width: channels of the first block; the second has twice as many.
    """

    def __init__(self, num_classes: int, in_channels: int = 1, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        return self.head(self.features(x))
'''

DATA = '''\
"""The team's data modules: a subclass of one of the framework's, or of
trainer.data.base.ImageClassificationData for a data set of your own."""

from typing import Any

import numpy as np

from trainer.data.digits import DigitsDataModule


class NoisyDigits(DigitsDataModule):
    """The shipped digits with Gaussian pixel noise (`noise`, in the 0..16 pixel scale), drawn once
    from a fixed seed, so every run sees the same images."""

    def __init__(self, noise: float = 0.5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.noise = noise

    def _load(self):
        images, labels = super()._load()
        noise = np.random.default_rng(0).normal(0.0, self.noise, images.shape).astype(np.float32)
        return images + noise, labels
'''

TEST = '''\
"""Every recipe of this folder composes and passes the framework's checks (keys, types, targets)."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from trainer import validate
from trainer.configuration.hydra_setup import install
from trainer.configuration.recipes import CONF_DIR

FOLDER = Path(__file__).resolve().parents[1]
RECIPES = sorted(path.stem for path in (FOLDER / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_recipe_composes_and_validates(recipe, monkeypatch):
    monkeypatch.chdir(FOLDER)  # the team folder is found from the working directory
    install()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"+recipe={recipe}"])
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    validate(container)
'''


def scaffold(folder: Path, package: Optional[str] = None) -> list[Path]:
    """Write the starter team folder into `folder` (new or empty); the files written."""
    package = package or re.sub(r"\W+", "_", folder.resolve().name).strip("_").lower() or "team"
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", package):
        raise UserError("--package", f"'{package}' is not a Python package name", "lowercase letters, digits, _")
    if folder.exists() and any(folder.iterdir()):
        raise UserError(str(folder), "is not empty; scaffold writes a new team folder",
                        "a new or empty folder")
    files = {
        "README.md": README, f"recipes/{package}_digits.yaml": RECIPE,
        f"conf/model/{package}_net.yaml": MODEL_CONF, f"conf/data/{package}_digits.yaml": DATA_CONF,
        f"{package}/__init__.py": INIT, f"{package}/models.py": MODELS, f"{package}/data.py": DATA,
        "tests/test_recipes.py": TEST,
    }
    written = []
    for relative, template in files.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.format(package=package) if "{package}" in template else template)
        written.append(path)
    return written


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer scaffold", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the team folder to write (new or empty)")
    parser.add_argument("--package", help="the team's Python package (default: the folder's name)")
    args = parser.parse_args(argv)
    try:
        written = scaffold(args.folder, args.package)
    except UserError as ex:
        exit_with(ex.line())
    for path in written:
        print(path)
    print(f"then: cd {args.folder} && python -m trainer +recipe={written[1].stem}", file=sys.stderr)
