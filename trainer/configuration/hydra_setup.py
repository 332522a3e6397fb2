"""What `train.py` installs in Hydra before it starts: the recipe config source, the resolvers
(``device_count`` for the SLURM launcher, ``config_help`` and ``usage`` for `--help`) and the reporter that turns
the person's mistakes into one line; and the answer to `--version`, the project's own rather than Hydra's.

Imported by every `python train.py`, so it imports neither torch nor Lightning at the top: a
composition error or `--help` answers without paying for them."""

from __future__ import annotations

import contextlib
import platform
import re
import sys
from typing import Any, Callable, cast

from hydra._internal import utils as hydra_utils
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.configuration import recipes
from trainer.configuration.usage import usage
from trainer.infra.errors import UserError, choices, exit_with, first_line, full_error_requested
from trainer.infra.extras import missing_modules
from trainer.infra.versions import DISTRIBUTION, import_name_clashes, installed_version, project_version

_installed = False

#: The libraries `--version` names beside the project.
VERSIONED_LIBRARIES = ("torch", "torchvision", "lightning", "hydra-core", "timm")


def version_line() -> str:
    """The project's version and those of the libraries a run's behaviour depends on, read from the
    installed packages' metadata (nothing is imported)."""
    libraries = ", ".join(f"{name} {installed_version(name)}" for name in VERSIONED_LIBRARIES)
    line = f"{DISTRIBUTION} {project_version()} ({libraries}, python {platform.python_version()})"
    clashes = import_name_clashes()
    if clashes:
        line += (f"\nwarning: the import name 'trainer' is also installed by {', '.join(clashes)}; their files share "
                 "one folder, so use a virtual environment without them (docs/install.md)")
    return line


def install() -> None:
    """Answer `--version` (the project's version, not the one Hydra's own flag would print), register
    the recipe config source and the resolvers, and route user mistakes to one-line errors (idempotent)."""
    global _installed
    if "--version" in sys.argv[1:]:
        print(version_line())
        sys.exit(0)
    if _installed:
        return
    recipes.register()
    for name, resolver in (("device_count", device_count), ("config_help", config_help), ("usage", usage)):
        OmegaConf.register_new_resolver(name, resolver, replace=True)
    _install_error_reporter()
    _installed = True


def _install_error_reporter() -> None:
    # Hydra reports every failure through `run_and_report` (composition mistakes as several lines with
    # exit code 1, task errors with a traceback). Replaced: the person's mistakes end as one line with exit
    # code 2; everything else (real bugs) goes to Hydra's reporter unchanged. HYDRA_FULL_ERROR=1 still works.
    original = hydra_utils.run_and_report

    def run_and_report(func: Callable[[], Any]) -> Any:
        try:
            return func()
        except Exception as ex:  # noqa: BLE001 - sorted into user mistakes and bugs below
            if full_error_requested():
                raise
            line = describe_user_error(ex)
            if line is None:
                def reraise(error: BaseException = ex) -> Any:
                    raise error
                return original(reraise)
            exit_with(line)

    hydra_utils.run_and_report = run_and_report


def config_help(*, _root_: DictConfig) -> str:
    """``${config_help:}`` (conf/hydra/help/trainer.yaml): the composed config with each key's doc,
    in place of Hydra's bare YAML (a ``$`` doubled: Hydra fills the template with `string.Template`).
    OmegaConf evaluates the template whenever Hydra merges a run's hydra configs, so the text (and
    Lightning's import) is made only when the command asks for help."""
    if not {"--help", "-h"} & set(sys.argv[1:]):
        return ""
    from trainer.configuration.help import annotated_config  # imports Lightning: only when --help asks

    config = cast(dict[str, Any], OmegaConf.to_container(_root_, resolve=False))  # a DictConfig's: a dict
    runtime = config.get("hydra", {}).get("runtime", {})
    choices_made = {k: v for k, v in (runtime.get("choices") or {}).items() if not k.startswith("hydra")}
    return annotated_config(config, choices_made).replace("$", "$$")


def device_count(devices: Any) -> int:
    """``${device_count:${trainer.devices}}`` (conf/hydra/launcher/slurm.yaml): SLURM's tasks and
    GPUs per node, counted as the run counts them (`trainer.infra.devices.parse_devices`), except that
    `auto` cannot be counted where the job is submitted."""
    from trainer.infra.devices import parse_devices  # imports torch: only for the SLURM launcher

    if isinstance(devices, ListConfig):
        devices = list(devices)
    count = 0
    if devices not in ("auto", -1, "-1"):
        with contextlib.suppress(UserError):  # what names no devices: the launcher's own line below
            count = parse_devices(devices, "cuda")[0]
    if count > 0:
        return count
    raise UserError("trainer.devices", f"'{devices}' is not a count of devices per node, which hydra/launcher=slurm "
                    "needs to size each job's tasks and GPUs", "a number such as trainer.devices=8, or a list of ids")


def describe_user_error(ex: BaseException) -> str | None:
    """One line for a mistake in the person's input, None for anything else."""
    if isinstance(ex, UserError):
        return ex.line()
    link: BaseException | None = ex
    for _ in range(8):  # raised inside a resolver or a launcher: the UserError is down the chain
        link = (link.__cause__ or link.__context__) if link is not None else None
        if isinstance(link, UserError):
            return link.line()
    if isinstance(ex, MissingConfigException):
        return _missing_config(ex)
    if isinstance(ex, OverrideParseException):
        return f"{ex.override}: cannot parse this override ({first_line(ex.message)})"
    if isinstance(ex, ConfigCompositionException):
        if isinstance(ex.__cause__, OmegaConfBaseException):
            return _composition_key_error(ex, ex.__cause__)
        return _keyed(first_line(str(ex)))
    if isinstance(ex, ValueError) and "Config group override must be a string" in str(ex):
        return _group_value_error()
    return None


def _keyed(message: str) -> str:
    """Hydra's composition messages name the key in quotes; put it first, as every other line does."""
    match = re.search(r"'([^']+)'", message)
    if not match:
        return message
    key = match.group(1)
    if "already at" in message:
        return UserError(key, "is already in the config, so it cannot be added with '+'",
                         f"{key}=VALUE to change it, or ++{key}=VALUE to add or change").line()
    return f"{key}: {message}"


def _group_value_error() -> str:
    """`optimizer=0.1`: a number, boolean or null where a group expects the name of a choice."""
    groups = _config_groups()
    parser = OverridesParser.create()
    for arg in sys.argv[1:]:
        match = re.match(r"^[+~]*([A-Za-z_][\w/]*)=(.*)$", arg)
        if match and match.group(1) in groups:
            group, value = match.group(1), match.group(2)
            try:  # typed exactly as Hydra reads it (`off` stays a string, `0.1` is a float)
                parsed = parser.parse_override(arg).value()
            except Exception:  # noqa: BLE001 - an unparsable override is not this case
                continue
            if not isinstance(parsed, (str, list)):
                return UserError(group, f"'{value}' is not the name of a choice",
                                 choices(groups[group]) or f"a file of conf/{group}/").line()
    return "a config group was given a number, boolean or null instead of the name of a choice"


def _config_groups() -> dict[str, list[str]]:
    """Each group's choices: the shipped ones and the team folders' (trainer/configuration/recipes.py)."""
    groups: dict[str, set[str]] = {}
    for conf in [recipes.CONF_DIR, *(team / "conf" for team in recipes.team_folders())]:
        for folder in (d for d in conf.iterdir() if d.is_dir() and d.name != "hydra") if conf.is_dir() else ():
            groups.setdefault(folder.name, set()).update(f.stem for f in folder.glob("*.yaml"))
    groups["recipe"] = {f.stem for folder in recipes.recipe_dirs() for f in folder.glob("*.yaml")}
    return {group: sorted(names) for group, names in groups.items()}


def _missing_config(ex: Any) -> str:
    text = str(ex)
    match = re.search(r"Could not find '([^']+)'", text)
    missing = match.group(1) if match else ex.missing_cfg_file or ""
    options = list(ex.options or [])
    for plugin, extra, feature in (("hydra/sweeper/optuna", "sweeps", "hparams_search"),
                                   ("hydra/launcher/submitit", "slurm", "hydra/launcher")):
        if missing.startswith(plugin) and missing_modules(extra):
            return UserError(feature, f"needs the '{extra}' extra (Hydra's plugin is not installed)",
                             f"pip install '{DISTRIBUTION}[{extra}]'").line()
    if "/" in missing:
        group, name = missing.rsplit("/", 1)
        if options:
            return UserError(group, f"unknown choice '{name}'", choices(sorted(options))).line()
        return UserError(group, f"unknown choice '{name}' (no such config group or option)").line()
    if options:
        return UserError(missing or "config", "no such config", choices(sorted(options))).line()
    return first_line(text)


def _composition_key_error(ex: Exception, cause: Any) -> str:
    match = re.search(r"Could not (?:override|append to config\.) '([^']+)'", str(ex))
    key = getattr(cause, "full_key", None) or (match.group(1) if match else "config")
    parent = getattr(cause, "parent_node", None)
    known: list[str] = []
    with contextlib.suppress(Exception):  # the hint is optional
        if parent is not None and hasattr(parent, "keys"):
            known = sorted(str(k) for k in parent.keys() if str(k) != "hydra")
    if "not in struct" in str(cause) or type(cause).__name__ == "ConfigAttributeError" or "Key '" in str(cause):
        text = f"{key}: not in the composed config"
        if known:
            text += f"; present here: {choices(known)}"
        return text + f" (a key the schema accepts but the YAML omits is added with +{key}=VALUE)"
    return f"{key}: {first_line(str(getattr(cause, 'msg', None) or cause))}"
