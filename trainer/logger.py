"""The `logger` group: Lightning loggers, writing into the run folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from lightning.pytorch.loggers import Logger


def build_loggers(specs: dict[str, dict[str, Any]], run_dir: Path) -> list[Logger]:
    loggers = []
    for name, spec in specs.items():
        loggers.append(instantiate(spec, save_dir=str(run_dir)))
    return loggers
