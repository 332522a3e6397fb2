"""What Hydra's sweepers need from the framework besides the run itself: the objective a job returns,
and how a failed job reports without ending the sweep (it returns NaN to Hydra's basic sweeper, or
raises `TrialFailed` for the Optuna sweeper).

`PrepareStorage` (a Hydra callback, registered by the ``hparams_search`` configs) creates the
folder of a SQLite study storage before the sweeper opens it: SQLite creates the file but not its
folder, and a fresh checkout has no ``outputs/``."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from trainer.infra.errors import UserError
from trainer.infra.schema import ConfigGroup

log = logging.getLogger("trainer")


def sqlite_path(url: str) -> Path | None:
    """The file of a ``sqlite:///relative`` or ``sqlite:////absolute`` URL; None for other storages."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or url == prefix or ":memory:" in url:
        return None
    return Path(url[len(prefix):])


class PrepareStorage(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        storage = config.hydra.sweeper.get("storage")
        path = sqlite_path(str(storage)) if storage else None
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as ex:
            raise UserError("hydra.sweeper.storage", f"cannot create the folder of '{path}': {ex.strerror or ex}",
                            "a sqlite:///path/to/study.db in a writable folder") from None


class TrialFailed(Exception):
    """An Optuna trial whose run failed or has no finite objective (see `job_failed`)."""


def in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def optuna_sweep() -> bool:
    return "optuna" in str(HydraConfig.get().sweeper.get("_target_", "")).lower()


def job_failed(line: str, ex: BaseException | None) -> float:
    """One job of a sweep failed: say so (with the traceback of an unexpected error in the job's
    log) and go on with the sweep. The job's summary.json, where it got that far, says failed.

    Hydra's basic sweeper ends the whole sweep, without the comparison table, after a job raised, so
    there the job returns NaN. Hydra's Optuna sweeper (1.3 with optuna 2.10) crashes on NaN (it tells
    the study twice) but goes on after a raising job while failures stay within ``max_failure_rate``,
    so there it raises `TrialFailed`."""
    if ex is not None:
        log.error("job failed", exc_info=ex)
    log.error("error: %s", line)
    if optuna_sweep():
        raise TrialFailed(line)
    return float("nan")


def objective_value(metrics: dict[str, dict[str, float]], name: str) -> float:
    """The metric `name` (``split/metric``) of the finished run; NaN when the run has none."""
    split, _, metric = name.partition("/")
    value = metrics.get(split, {}).get(metric)
    if value is None:
        log.warning("objective %s: the run logged no such metric (it has %s); returning NaN", name,
                    ", ".join(f"{s}/{m}" for s, values in metrics.items() for m in values) or "none")
        return float("nan")
    return float(value)


def check_trial(objective: float | None) -> None:
    """An Optuna trial without a finite objective counts as failed (the sweeper would crash on NaN)."""
    if objective is not None and not math.isfinite(objective) and in_multirun() and optuna_sweep():
        raise TrialFailed(f"objective is {objective}: the trial counts as failed")


GROUP = ConfigGroup("hparams_search", __name__, "an Optuna study (Hydra's Optuna sweeper, its SQLite storage)", None)
