"""Helpers for a team's own tests: the public way to check a team folder's recipes against the
framework (docs/install.md, "A team's own folder"; `python -m trainer scaffold` writes tests that use
them and nothing else of the framework).

The names in ``__all__`` are a stable API: their signatures and meaning are kept across the minor
versions a team folder's pyproject.toml admits, while the framework's internals they call (Hydra's
set-up, the config checks, where the configs live) may change. ::

    from pathlib import Path

    import pytest
    from trainer.testing import check_recipe, team_recipes

    FOLDER = Path(__file__).resolve().parents[1]

    @pytest.mark.parametrize("recipe", team_recipes(FOLDER))
    def test_the_recipe_composes_and_validates(recipe):
        check_recipe(recipe, team_dir=FOLDER)

A recipe that does not compose or validate raises `ConfigError`, an AssertionError whose message is
the one line the command line prints (``HYDRA_FULL_ERROR=1`` keeps the framework's own exception)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

from omegaconf import DictConfig

from trainer.configuration import recipes
from trainer.configuration import spec as config_spec
from trainer.configuration.hydra_setup import describe_user_error, install
from trainer.infra.errors import full_error_requested

__all__ = ["ConfigError", "TrainingFailed", "check_recipe", "compose_recipe", "team_recipes", "train_recipe",
           "validate"]

PathLike = Union[str, "os.PathLike[str]"]


class ConfigError(AssertionError):
    """A config that does not compose or validate; the message is the command line's one line."""


class TrainingFailed(AssertionError):
    """`train_recipe`'s run ended with a non-zero exit code; the message holds its last lines."""


def team_recipes(team_dir: PathLike) -> list[str]:
    """The names of the recipes in ``TEAM_DIR/recipes/`` (each used as ``+recipe=NAME``), sorted."""
    folder = Path(team_dir) / "recipes"
    return sorted(path.stem for path in folder.glob("*.yaml")) if folder.is_dir() else []


def compose_recipe(name: Optional[str], overrides: Sequence[str] = (),
                   team_dir: Optional[PathLike] = None) -> DictConfig:
    """The config ``python -m trainer +recipe=NAME OVERRIDES...`` composes (without Hydra's own node),
    not yet validated. `team_dir`: a team folder searched as if it were in ``TRAINER_TEAM_DIRS`` (its
    ``recipes/``, ``conf/`` and packages); without it, the working directory and ``TRAINER_TEAM_DIRS``
    are, as on the command line. `name` None: the plain defaults with `overrides`."""
    from hydra import compose, initialize_config_dir

    install()
    arguments = [*([f"+{recipes.RECIPE}={name}"] if name else []), *overrides]
    with _team_folder(team_dir), _as_config_error():
        with initialize_config_dir(config_dir=str(recipes.CONF_DIR), version_base="1.3"):
            return compose(config_name="train", overrides=arguments)


def validate(cfg: Any) -> config_spec.RunSpec:
    """Run the framework's checks of a composed config (every group's keys, types, ranges and
    ``_target_`` imports) as a run does before it starts; the checked spec, or `ConfigError`."""
    with _as_config_error():
        return config_spec.validate(cfg)


def check_recipe(name: str, overrides: Sequence[str] = (), team_dir: Optional[PathLike] = None) -> config_spec.RunSpec:
    """`compose_recipe` then `validate`, with the team folder's packages importable for the
    ``_target_`` checks; the checked spec, or `ConfigError`."""
    cfg = compose_recipe(name, overrides, team_dir)
    with _team_folder(team_dir):
        return validate(cfg)


def train_recipe(name: str, run_dir: PathLike, overrides: Sequence[str] = (), team_dir: Optional[PathLike] = None,
                 timeout_s: float = 600) -> dict[str, Any]:
    """Train ``+recipe=NAME OVERRIDES...`` as a person does (``python -m trainer`` in a new process,
    from `team_dir` when given) into `run_dir`; the run's summary.json as a dict, or `TrainingFailed`
    with the run's last lines."""
    command = [sys.executable, "-m", "trainer", f"+{recipes.RECIPE}={name}", *overrides, f"hydra.run.dir={run_dir}"]
    env = dict(os.environ)
    if team_dir is not None:
        env[recipes.TEAM_DIRS_VARIABLE] = _with_team_dir(team_dir, env)
    done = subprocess.run(command, cwd=team_dir, env=env, capture_output=True, text=True, timeout=timeout_s,
                          check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        raise TrainingFailed(f"{' '.join(command[1:])} ended with exit code {done.returncode}:\n{tail}")
    return json.loads((Path(run_dir) / "summary.json").read_text())


def _with_team_dir(team_dir: PathLike, environ: Any) -> str:
    first = str(Path(team_dir).resolve())
    rest = [entry for entry in environ.get(recipes.TEAM_DIRS_VARIABLE, "").split(os.pathsep) if entry]
    return os.pathsep.join([first, *(entry for entry in rest if entry != first)])


@contextmanager
def _as_config_error() -> Iterator[None]:
    """The person's mistakes (those the command line reports in one line) as `ConfigError` with that
    line; anything else, a bug, as it is (and everything with HYDRA_FULL_ERROR=1)."""
    try:
        yield
    except Exception as ex:  # noqa: BLE001 - sorted by describe_user_error
        line = None if full_error_requested() else describe_user_error(ex)
        if line is None:
            raise
        raise ConfigError(line) from None


@contextmanager
def _team_folder(team_dir: Optional[PathLike]) -> Iterator[None]:
    """`team_dir` first in TRAINER_TEAM_DIRS while Hydra composes (its search-path plugin reads the
    variable, as for a command line that sets it) and on sys.path; the variable restored after."""
    if team_dir is None:
        yield
        return
    if not Path(team_dir).is_dir():
        raise ConfigError(f"team_dir: {team_dir} is not a folder; allowed: a team folder (recipes/, conf/)")
    before = os.environ.get(recipes.TEAM_DIRS_VARIABLE)
    os.environ[recipes.TEAM_DIRS_VARIABLE] = _with_team_dir(team_dir, os.environ)
    recipes.import_from([Path(team_dir).resolve()])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(recipes.TEAM_DIRS_VARIABLE, None)
        else:
            os.environ[recipes.TEAM_DIRS_VARIABLE] = before
