"""The `logger` group: Lightning loggers, writing into the run folder.

Several loggers at once: ``logger=[csv,tensorboard,wandb]``. A wandb run's id is chosen here and
kept in ``run.json``, so a resumed run continues that wandb run. What every logger receives
(`logger_callbacks`, `run_hyperparameters`) and how a wandb run is named, grouped and tagged
(`run_labels`, `wandb_settings`) is in docs/config.md ("Groups and choices")."""

from __future__ import annotations

import logging
import os
import secrets
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import lightning as L
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, LearningRateMonitor
from lightning.pytorch.loggers import Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from trainer.infra.errors import UserError, exception_line
from trainer.infra.extras import require
from trainer.infra.schema import ConfigGroup, check_target

log = logging.getLogger("trainer")


def _is_wandb(spec: Mapping[str, Any]) -> bool:
    return str(spec.get("_target_", "")).rsplit(".", 1)[-1] == "WandbLogger"


def logger_ids(specs: Mapping[str, Mapping[str, Any]], previous: Mapping[str, str] | None = None,
               environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The run id of each logger that has one (wandb): as configured (`logger.wandb.id`), else
    `WANDB_RUN_ID`, else that of the resumed run, else a new one (wandb's form: 8 of a-z and 0-9)."""
    previous = previous or {}
    ids = {}
    for name, spec in specs.items():
        if _is_wandb(spec):
            alphabet = string.ascii_lowercase + string.digits
            ids[name] = str(spec.get("id") or spec.get("version") or environ.get("WANDB_RUN_ID")
                            or previous.get(name) or "".join(secrets.choice(alphabet) for _ in range(8)))
    return ids


@dataclass(frozen=True)
class RunLabels:
    """How a logger that names its runs (wandb) shows this one: by the run's name, in the group of
    the multirun it is a job of (none for a single run), with tags to filter by."""

    name: str | None = None
    group: str | None = None
    tags: tuple[str, ...] = ()


#: The group choices that say what a run is, as tags (`data:digits`); the others (logger,
#: checkpointing, nonfinite, hparams_search) say how it is recorded or launched.
TAGGED_GROUPS = ("recipe", "ladder", "data", "model", "optimizer", "scheduler", "precision", "compile", "clipping",
                 "trainer")
#: wandb refuses longer tags.
MAX_TAG_LENGTH = 64


def run_labels(name: str | None, choices: Mapping[str, str], sweep_dir: Path | None = None,
               root: Path | str | None = None) -> RunLabels:
    """The run's name; as group, the multirun's folder (`sweep_dir`, relative to `run.root` where it
    lies under it), so the jobs of one sweep or ladder are one group; tags ``GROUP:CHOICE``."""
    group = None
    if sweep_dir is not None:
        group = str(sweep_dir)
        if root is not None:
            try:
                group = str(sweep_dir.resolve().relative_to(Path(root).resolve()))
            except ValueError:
                pass  # a sweep folder outside run.root keeps its full path
    tags = tuple(f"{g}:{choices[g]}"[:MAX_TAG_LENGTH] for g in TAGGED_GROUPS if choices.get(g))
    return RunLabels(name, group, tags)


def build_loggers(specs: Mapping[str, Mapping[str, Any]], run_dir: Path,
                  ids: Mapping[str, str] | None = None, labels: RunLabels | None = None) -> list[Logger]:
    """The loggers, each checked to have a folder it can write; what a constructor refuses is one
    line naming `logger.NAME` (no logger has started a run yet: see `start_loggers`)."""
    loggers = []
    for name, spec in specs.items():
        kwargs: dict[str, Any] = {"save_dir": str(run_dir)}
        if ids and name in ids:
            # resume="allow": wandb continues the run with this id if it exists, else starts it.
            kwargs.update(id=ids[name], resume="allow")
            spec = {k: v for k, v in spec.items() if k not in ("id", "version")}
        if _is_wandb(spec):
            kwargs.update(wandb_settings(spec, labels or RunLabels(), str(run_dir)))
        try:
            logger = instantiate(spec, **kwargs)
        except Exception as ex:  # noqa: BLE001 - any refusal of a logger's set-up is the person's to fix
            raise _setup_failure(name, spec, ex) from None
        _check_writable(name, spec, _logger_folder(logger))
        loggers.append(logger)
    return loggers


def start_loggers(loggers: list[Logger], specs: Mapping[str, Mapping[str, Any]]) -> None:
    """Start each wandb run now, on rank 0 (the other ranks get Lightning's stand-in experiment):
    Lightning calls `wandb.init` only at the first `logger.experiment`, inside fit, where a refusal
    (a key wandb rejects, no network) would be a traceback after the Trainer was made; here it is
    one line naming the logger."""
    for logger, (name, spec) in zip(loggers, specs.items()):  # build_loggers made one per spec, in order
        if isinstance(logger, WandbLogger):
            try:
                _ = logger.experiment  # wandb.init, by Lightning's own path
            except Exception as ex:  # noqa: BLE001 - see the docstring
                raise _setup_failure(name, spec, ex) from None


def _setup_failure(name: str, spec: Mapping[str, Any], ex: BaseException) -> UserError:
    """A logger's set-up refused, as one line with the library's own message and a remedy."""
    if isinstance(ex, UserError):
        return ex
    cause = ex.__cause__ if isinstance(ex, InstantiationException) and ex.__cause__ is not None else ex
    kind = str(spec.get("_target_", name)).rsplit(".", 1)[-1]
    remedy = (wandb_remedy(name) if _is_wandb(spec)
              else f"a folder the run can write, or logger.{name}=null to run without this logger")
    return UserError(f"logger.{name}", f"{kind} could not be set up: {exception_line(cause, 300)}", remedy)


def wandb_remedy(name: str) -> str:
    """What makes a wandb run (the logger `logger.NAME`) that cannot reach its server run anyway."""
    return ("a valid WANDB_API_KEY (or `wandb login`) and a reachable server (WANDB_BASE_URL), or "
            f"WANDB_MODE=offline (logger.{name}.offline=true) and `wandb sync` the run folder later")


def _logger_folder(logger: Logger) -> str | None:
    """Where a logger writes: wandb under its save_dir, the others in their log_dir."""
    if isinstance(logger, WandbLogger):
        return logger.save_dir
    return logger.log_dir or logger.save_dir


def _check_writable(name: str, spec: Mapping[str, Any], folder: str | None) -> None:
    """The folder a logger will write into is a folder, or can be made, and can be written. A
    logger finds out only at its first write, in the middle of training."""
    if not folder:
        return
    path = Path(folder).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        return
    what = "is not a folder" if not existing.is_dir() else "cannot be written"
    allowed = ("a writable WANDB_DIR (or unset it: the run folder)" if _is_wandb(spec)
               else f"a writable run folder, or logger.{name}=null")
    raise UserError(f"logger.{name}", f"cannot write its logs to {path}: {existing} {what}", allowed)


#: The wandb modes that send nothing to a server, and need no API key ("dryrun" is offline's old name).
WANDB_LOCAL_MODES = ("offline", "dryrun", "disabled")


def wandb_mode(spec: Mapping[str, Any], environ: Mapping[str, str] = os.environ,
               configured: Callable[[], str | None] | None = None) -> str:
    """The mode a wandb run will have: the config's (`offline: true`, a `mode` passed to wandb.init),
    else WANDB_MODE (WANDB_DISABLED=true: disabled), else `configured()` (default: wandb's settings
    files, e.g. after `wandb offline`, read, importing wandb, only when neither of the others says),
    else online."""
    if spec.get("offline"):
        return "offline"
    if spec.get("mode"):
        return str(spec["mode"])
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    if environ.get("WANDB_DISABLED", "").lower() in ("true", "1", "yes"):
        return "disabled"
    return (configured or _wandb_configured_mode)() or "online"


def wandb_key_problem(spec: Mapping[str, Any], environ: Mapping[str, str] = os.environ,
                      has_key: Callable[[], bool | None] | None = None,
                      configured_mode: Callable[[], str | None] | None = None) -> str | None:
    """Why a wandb run could not start for want of credentials, or None. A run that sends to a
    server needs an API key: WANDB_API_KEY (or WANDB_IDENTITY_TOKEN_FILE), a netrc entry for the
    server (`wandb login`), or one in wandb's settings. Where wandb cannot say (an API this version
    lacks), nothing is refused here; `start_loggers` still turns wandb's own refusal into one line."""
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    mode = wandb_mode(spec, environ, configured_mode)
    if mode in WANDB_LOCAL_MODES or (has_key or _wandb_has_key)() is not False:
        return None
    return "wandb has no API key (no WANDB_API_KEY, no `wandb login`) and its mode is " + mode


def _wandb_configured_mode() -> str | None:
    """The mode wandb's settings files give (`wandb offline` writes one), by wandb's own reading."""
    try:
        from wandb.sdk import wandb_setup

        return str(wandb_setup.singleton().settings.mode)
    except Exception:  # noqa: BLE001 - an API this wandb lacks: no answer
        return None


def _wandb_has_key() -> bool | None:
    """Whether wandb finds credentials for its server without asking the person or the network
    (environment, netrc, its settings): wandb's own search, `authenticate_session(prompt=False)`.
    None where this wandb has no such API."""
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth

        settings = wandb_setup.singleton().settings
        host = wbauth.HostUrl(settings.base_url, app_url=settings.app_url)
        found = wbauth.authenticate_session(host=host, source="trainer", prompt=False, update_session=False)
    except (ImportError, AttributeError, TypeError):
        return None
    except Exception:  # noqa: BLE001 - a key wandb finds but refuses (its format): wandb.init says so
        return True
    return found is not None


def check_loggers(specs: Mapping[str, Mapping[str, Any]], environ: Mapping[str, str] = os.environ) -> None:
    """What each logger needs before a run is built: a wandb run that sends to a server needs an API
    key. Refused here as one line, before anything is built, instead of at wandb.init inside fit."""
    for name, spec in specs.items():
        if _is_wandb(spec):
            problem = wandb_key_problem(spec, environ)
            if problem is not None:
                raise UserError(f"logger.{name}", problem,
                                f"set WANDB_API_KEY, or WANDB_MODE=offline (logger.{name}.offline=true)")


#: What the framework fills in for a wandb run, and the wandb setting that wins over it when set.
WANDB_ENVIRONMENT = {"name": "WANDB_NAME", "group": "WANDB_RUN_GROUP", "save_dir": "WANDB_DIR"}


def wandb_settings(spec: Mapping[str, Any], labels: RunLabels, run_dir: str,
                   environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The arguments the framework gives a WandbLogger: the run's name and group, the run folder to
    write into, and its tags; what the person set (the config, then `WANDB_*`) wins, and tags are
    added to the person's (docs/config.md)."""
    settings: dict[str, Any] = {}
    for key, value in (("name", labels.name), ("group", labels.group), ("save_dir", run_dir)):
        if environ.get(WANDB_ENVIRONMENT[key]):
            # Passed on, not left to wandb: it reads its environment once a process, so the later
            # jobs of an in-process multirun would miss a variable set after the first.
            settings[key] = environ[WANDB_ENVIRONMENT[key]]
        elif value and spec.get(key) in (None, "", []):
            settings[key] = value
    given = [str(tag) for tag in spec.get("tags") or []]
    given += [tag.strip() for tag in environ.get("WANDB_TAGS", "").split(",") if tag.strip()]
    tags = list(dict.fromkeys(given + list(labels.tags)))
    if tags:
        settings["tags"] = tags
    return settings


def run_hyperparameters(resolved: Mapping[str, Any], derived: Mapping[str, Any],
                        choices: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What the loggers record as the run's hyper-parameters: the whole resolved config; under
    ``choices`` the group choices, by which runs are filtered and compared; under ``derived`` each
    value the plan decided, by its key. Plain values only; each logger flattens the nesting its own way."""
    return {**_plain(resolved), "choices": {str(group): str(choice) for group, choice in (choices or {}).items()},
            "derived": {str(key): _plain(value) for key, value in derived.items()}}


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def logger_callbacks(hyperparameters: Mapping[str, Any], metrics: Sequence[str]) -> list[Callback]:
    """The callbacks a run with at least one logger gets: the lr of every parameter group at every
    logged step (``train/lr/pg1``, ...: the scheduler is named ``train/lr`` in trainer/task.py), and
    the hyper-parameters once as training starts, with `metrics` (the task's, as logged) beside them."""
    return [LearningRateMonitor(logging_interval="step"), HyperparameterRecord(hyperparameters, metrics)]


def hparams_metrics(task_metrics: Sequence[str]) -> tuple[str, ...]:
    """The scalars TensorBoard's HParams tab shows beside each run's hyper-parameters (their values are
    read from the run's own scalars): the task's metrics as logged, the training loss by its epoch
    mean (it is logged per step too)."""
    return tuple("train/loss_epoch" if name == "train/loss" else name for name in task_metrics)


class HyperparameterRecord(Callback):
    """Hands the run's hyper-parameters to every logger once, at the start of fitting: the process's
    rank is known by then, and every logger records them on rank 0 only."""

    def __init__(self, hyperparameters: Mapping[str, Any], metrics: Sequence[str] = ()) -> None:
        self.hyperparameters = dict(hyperparameters)
        self.metrics = hparams_metrics(metrics)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for logger in trainer.loggers:
            logger.log_hyperparams(self.hyperparameters)
            if isinstance(logger, TensorBoardLogger):
                _tensorboard_hparams(logger, self.hyperparameters, self.metrics)


@rank_zero_only
def _tensorboard_hparams(logger: TensorBoardLogger, hyperparameters: Mapping[str, Any], metrics: Sequence[str]) -> None:
    """The HParams tab. Lightning's TensorBoardLogger writes it only together with metric values
    (an ``hp_metric`` of -1 unless `default_hp_metric` is off, as in conf/logger/tensorboard.yaml);
    this names the metrics the run will log instead, so no made-up value enters their curves."""
    from torch.utils.tensorboard.summary import hparams

    flat = {key: value if isinstance(value, (bool, int, float, str)) else str(value)
            for key, value in _flatten(hyperparameters).items()}
    for summary in hparams(flat, dict.fromkeys(metrics, 0.0)):
        logger.experiment.file_writer.add_summary(summary)


def _flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def finish_loggers(loggers: list[Logger], failed: bool) -> None:
    """End each logger's run: Lightning leaves a wandb run open, and the next job of a multirun in
    the same process would log into it. A logger that fails to finish is a warning: its shutdown
    must not cost the run its summary."""
    for logger in loggers:
        experiment = getattr(logger, "_experiment", None)
        if experiment is not None and _is_wandb({"_target_": type(logger).__name__}):
            try:
                experiment.finish(exit_code=1 if failed else 0)
            except Exception as ex:  # noqa: BLE001 - see the docstring
                log.warning("could not finish a logger's run: %s", exception_line(ex))


#: Arguments the framework fills in: every logger writes into the run folder.
INJECTED_LOGGER_ARGS = ("save_dir",)


def validate(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    loggers = {}
    for name, spec in values.items():
        if spec is None:
            continue  # a logger switched off with logger.NAME=null
        if not isinstance(spec, dict):
            raise UserError(f"logger.{name}", "not a mapping", "a logger config with _target_")
        target = str(spec.get("_target_", ""))
        for suffix, extra in (("WandbLogger", "wandb"), ("TensorBoardLogger", "tensorboard")):
            if target.endswith(suffix):
                require(extra, f"logger.{name}")
        loggers[name] = check_target(f"logger.{name}", spec, skip=INJECTED_LOGGER_ARGS)
    return loggers


#: Docs the framework gives WandbLogger's arguments (it fills in what they leave unset).
WANDB_DOCS = {
    "project": "the wandb project (WANDB_PROJECT when set, else trainer)",
    "name": "the wandb run's name; null: WANDB_NAME, else the run's name (run.name or the one given it)",
    "group": "null: WANDB_RUN_GROUP, else the multirun's folder (the jobs of one sweep or ladder)",
    "tags": "yours (and WANDB_TAGS'), plus recipe:NAME, ladder:NAME and the group choices (data:digits, ...)",
}

GROUP = ConfigGroup("logger", __name__, "Lightning loggers writing into the run folder", validate,
                    argument_docs={WandbLogger: WANDB_DOCS})
