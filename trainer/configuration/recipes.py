"""Recipes live in the `recipes/` folder (trainer/recipes, shown at the top of a checkout) and are
used as ``+recipe=NAME``.

Hydra finds a config group only as a folder of that name on its search path, and the group is
``recipe`` while the folder is ``recipes/`` (no second copy under ``conf/``): this config source
maps the one to the other. It also puts a team's own folders (the working directory when it holds
``recipes/`` or ``conf/``, and ``TRAINER_TEAM_DIRS``) on the search path after the shipped ones, and
on ``sys.path`` for their ``_target_``s, as docs/install.md ("A team's own folder") describes."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence, cast

from hydra import compose, initialize_config_dir
from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType
from hydra.core.plugins import Plugins
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import OmegaConf

from trainer.configuration.diff import config_changes
from trainer.infra.errors import first_line
from trainer.infra.schema import ConfigGroup

log = logging.getLogger("trainer")

RECIPE = "recipe"
# Inside the package, so that an installed wheel carries them; a checkout also shows them at its top
# level (conf/ and recipes/ there are links to these).
RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


class RecipeConfigSource(ConfigSource):
    """Serves ``recipe/NAME`` from ``<path>/NAME.yaml``; nothing else."""

    @staticmethod
    def scheme() -> str:
        return "recipes"

    def _file(self, config_path: str) -> Optional[str]:
        if not config_path.startswith(RECIPE + "/"):
            return None
        name = self._normalize_file_name(config_path[len(RECIPE) + 1:])
        return os.path.join(self.path, name)

    def load_config(self, config_path: str) -> ConfigResult:
        path = self._file(config_path)
        if path is None or not os.path.isfile(path):
            raise ConfigLoadError(f"Recipe not found: {config_path}")
        with open(path, encoding="utf-8") as f:
            header = ConfigSource._get_header_dict(f.read(512))
            f.seek(0)
            cfg = OmegaConf.load(f)
        return ConfigResult(config=cfg, path=f"{self.scheme()}://{self.path}", provider=self.provider, header=header)

    def available(self) -> bool:
        return os.path.isdir(self.path)

    def is_group(self, config_path: str) -> bool:
        return config_path in ("", RECIPE) and self.available()

    def is_config(self, config_path: str) -> bool:
        path = self._file(config_path)
        return path is not None and os.path.isfile(path)

    def list(self, config_path: str, results_filter: Optional[ObjectType]) -> List[str]:
        if not self.available():
            return []
        if config_path == "":
            return [RECIPE] if results_filter in (None, ObjectType.GROUP) else []
        if config_path != RECIPE or results_filter == ObjectType.GROUP:
            return []
        return sorted(f[: -len(".yaml")] for f in os.listdir(self.path) if f.endswith(".yaml"))


#: Folders of a team's own recipes and config groups, beside the working directory.
TEAM_DIRS_VARIABLE = "TRAINER_TEAM_DIRS"
#: The config folders a team folder may hold: (folder, its search-path scheme, the shipped one).
_CONFIG_DIRS = (("recipes", "recipes", RECIPES_DIR), ("conf", "file", CONF_DIR))


def team_folders(cwd: Optional[Path] = None, environ: Mapping[str, str] = os.environ) -> list[Path]:
    """The team folders: the working directory when it holds ``recipes/`` or ``conf/`` (other than
    the shipped ones, which a checkout shows at its top), then each folder of ``TRAINER_TEAM_DIRS``."""
    candidates = [Path(cwd or os.getcwd())]
    candidates += [Path(entry) for entry in environ.get(TEAM_DIRS_VARIABLE, "").split(os.pathsep) if entry]
    folders: list[Path] = []
    for folder in candidates:
        folder = folder.resolve()
        if _own_config_dirs(folder) and folder not in folders:
            folders.append(folder)
    return folders


def _own_config_dirs(folder: Path) -> list[str]:
    """Hydra search-path entries of `folder`'s ``recipes/`` and ``conf/`` (not the shipped ones)."""
    return [f"{scheme}://{folder / sub}" for sub, scheme, shipped in _CONFIG_DIRS
            if (folder / sub).is_dir() and (folder / sub).resolve() != shipped]


def team_search_path(folders: Sequence[Path]) -> list[str]:
    """Hydra search-path entries of the team folders' ``recipes/`` and ``conf/``."""
    return [entry for folder in folders for entry in _own_config_dirs(folder)]


def import_from(folders: Sequence[Path]) -> None:
    """Put `folders` on ``sys.path`` (after the installed packages), so that the packages a team
    folder holds import by the names its configs' ``_target_`` give."""
    for folder in folders:
        if str(folder) not in sys.path:
            sys.path.append(str(folder))


def import_team_folders(recorded: Sequence[str | Path] = (), cwd: Optional[Path] = None,
                        environ: Mapping[str, str] = os.environ) -> list[Path]:
    """Make a finished run's team classes importable outside Hydra (deploy): `team_folders` (the
    working directory's and ``TRAINER_TEAM_DIRS``'s, the person's choice now), then the folders the run
    recorded (summary.json's ``team_dirs``) that still exist, put on ``sys.path``; the folders, in
    that order (the first that holds a package wins)."""
    folders: list[Path] = []
    for folder in [*team_folders(cwd, environ), *(Path(entry) for entry in recorded)]:
        folder = folder.expanduser().resolve()
        if folder.is_dir() and folder not in folders:
            folders.append(folder)
    import_from(folders)
    return folders


class RecipeSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="trainer-recipes", path=f"recipes://{RECIPES_DIR}")
        folders = team_folders()
        for entry in team_search_path(folders):
            search_path.append(provider="trainer-team", path=entry)
        import_from(folders)  # the team's own packages, for the _target_ of its configs


def register() -> None:
    plugins = Plugins.instance()
    plugins.register(RecipeConfigSource)
    plugins.register(RecipeSearchPath)


def compose_here(config_name: str, overrides: Sequence[str] = ()) -> Any:
    """`config_name` composed through the running Hydra app's search path (a team's folders
    included), or from the package's conf/ when called outside a Hydra app (tests, notebooks)."""
    if GlobalHydra.instance().is_initialized():
        return compose(config_name=config_name, overrides=list(overrides))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


# --- lineage: which recipe a recipe builds on, and what it changes ---------------------------------
def recipe_dirs(search_path: Sequence[str] = ()) -> list[Path]:
    """The shipped recipes folder, the team folders' and any ``recipes://`` folder added to Hydra's
    search path, in Hydra's order."""
    dirs = [RECIPES_DIR]
    for entry in [*team_search_path(team_folders()), *search_path]:
        if entry.startswith("recipes://") and Path(entry[len("recipes://"):]) not in dirs:
            dirs.append(Path(entry[len("recipes://"):]))
    return dirs


def recipe_file(name: str, search_path: Sequence[str] = ()) -> Optional[Path]:
    # Hydra appends the extra folders after ours, and the first match wins there too.
    for folder in recipe_dirs(search_path):
        path = folder / f"{name}.yaml"
        if path.is_file():
            return path
    return None


def parent_of(name: str, search_path: Sequence[str] = ()) -> Optional[str]:
    """The recipe named first in this recipe's defaults list (a plain name, which Hydra reads as
    ``recipe/NAME``), or None for a recipe that builds on the plain defaults."""
    path = recipe_file(name, search_path)
    if path is None:
        return None
    recipe = cast(dict[str, Any], OmegaConf.to_container(OmegaConf.load(path)))  # a config file's: a mapping
    for entry in recipe.get("defaults") or []:
        if isinstance(entry, str) and entry != "_self_" and "/" not in entry and recipe_file(entry, search_path):
            return entry
    return None


def differences(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, list[Any]]:
    """``{dotted key: [before, after]}`` for every key whose value differs (None where absent)."""
    return {key: [old, new] for key, old, new in config_changes(dict(before), dict(after))}


def with_recipe(overrides: Sequence[str], name: str) -> list[str]:
    """The same command line with the recipe swapped for `name`."""
    out = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != RECIPE]
    return [*out, f"+{RECIPE}={name}"]


def lineage_record(name: Optional[str], overrides: Sequence[str], config: Mapping[str, Any],
                   search_path: Sequence[str] = ()) -> Optional[dict[str, Any]]:
    """What the run records about its recipe: the file, the parent, and every key of the composed
    config in which this run differs from the same command line with the parent recipe instead
    (composed with Hydra). The record is informative: a failure to compare becomes a warning and an
    ``error`` entry, never the run's end."""
    if not name:
        return None
    try:
        path, parent = recipe_file(name, search_path), parent_of(name, search_path)
        differs = differences(_composed(with_recipe(overrides, parent), search_path), config) if parent else {}
    except Exception as ex:  # noqa: BLE001 - the record is informative; the run must not die of it
        log.warning("could not compare recipe %s with its parent: %s", name, first_line(ex))
        return {"name": name, "error": first_line(ex) or type(ex).__name__}
    return {"name": name, "file": str(path) if path else None, "parent": parent, "differs_from_parent": differs}


def _composed(overrides: list[str], search_path: Sequence[str]) -> dict[str, Any]:
    """conf/train.yaml composed with `overrides`, as plain containers without Hydra's node."""
    if search_path:  # a team's recipes folder: the parent may live there
        overrides = [*overrides, f"hydra.searchpath=[{','.join(search_path)}]"]
    cfg = compose_here("train", overrides)
    plain = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))  # a dict
    plain.pop("hydra", None)
    return plain


GROUP = ConfigGroup(RECIPE, __name__, "a team-shared recipe from recipes/ (+recipe=NAME)", None)
