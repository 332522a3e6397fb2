"""The `logger` group: Lightning loggers, writing into the run folder.

Several loggers at once: ``logger=[csv,tensorboard,wandb]`` (each choice adds its own key).
A Weights & Biases run gets an id chosen here and kept in the run folder's ``run.json``; a resumed
run passes the id of the run it resumes, so wandb continues that run instead of starting another.
"""

from __future__ import annotations

import logging
import secrets
import string
from pathlib import Path
from typing import Any, Mapping

from hydra.utils import instantiate
from lightning.pytorch.loggers import Logger

from trainer.errors import exception_line

log = logging.getLogger("trainer")


def _is_wandb(spec: Mapping[str, Any]) -> bool:
    return str(spec.get("_target_", "")).rsplit(".", 1)[-1] == "WandbLogger"


def logger_ids(specs: Mapping[str, Mapping[str, Any]], previous: Mapping[str, str] | None = None) -> dict[str, str]:
    """The run id of each logger that has one (wandb): as configured (`logger.wandb.id`), else that of
    the resumed run, else a new one (wandb's own form: 8 characters of a-z and 0-9)."""
    previous = previous or {}
    ids = {}
    for name, spec in specs.items():
        if _is_wandb(spec):
            alphabet = string.ascii_lowercase + string.digits
            ids[name] = str(spec.get("id") or spec.get("version") or previous.get(name)
                            or "".join(secrets.choice(alphabet) for _ in range(8)))
    return ids


def build_loggers(specs: Mapping[str, Mapping[str, Any]], run_dir: Path,
                  ids: Mapping[str, str] | None = None) -> list[Logger]:
    loggers = []
    for name, spec in specs.items():
        kwargs: dict[str, Any] = {"save_dir": str(run_dir)}
        if ids and name in ids:
            # resume="allow": wandb continues the run with this id if it exists, else starts it.
            kwargs.update(id=ids[name], resume="allow")
            spec = {k: v for k, v in spec.items() if k not in ("id", "version")}
        loggers.append(instantiate(spec, **kwargs))
    return loggers


def finish_loggers(loggers: list[Logger], failed: bool) -> None:
    """End each logger's run. Lightning's WandbLogger leaves the wandb run open at the end of
    training, and a later WandbLogger in the same process (the next job of a multirun) then logs
    into that run instead of its own; finishing it here gives every job its own run. A logger that
    fails to finish is a warning: its shutdown must not cost the run its summary."""
    for logger in loggers:
        experiment = getattr(logger, "_experiment", None)
        if experiment is not None and _is_wandb({"_target_": type(logger).__name__}):
            try:
                experiment.finish(exit_code=1 if failed else 0)
            except Exception as ex:  # noqa: BLE001 - see the docstring
                log.warning("could not finish a logger's run: %s", exception_line(ex))
