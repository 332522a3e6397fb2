"""The compose phase: what Hydra composed for this job, and where it runs (its validation against
every group's schema is `trainer.configuration.spec.validate`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig


@dataclass(frozen=True)
class Job:
    """What Hydra composed for this job, and where it runs."""

    cfg: DictConfig
    run_dir: Path
    choices: dict[str, str]
    overrides: list[str]
    multirun: bool = False
    launcher: str = ""
    search_path: tuple[str, ...] = ()

    @classmethod
    def from_hydra(cls, cfg: DictConfig, run_dir: Path | None = None, choices: dict[str, str] | None = None,
                   overrides: list[str] | None = None) -> Job:
        """The current Hydra job; `run_dir`, `choices` and `overrides` given outside a Hydra app."""
        if run_dir is not None and choices is not None:
            return cls(cfg, run_dir, dict(choices), list(overrides or []))
        hydra = HydraConfig.get()
        made = {k: str(v) for k, v in hydra.runtime.choices.items() if not k.startswith("hydra") and v is not None}
        return cls(cfg, run_dir or Path(hydra.runtime.output_dir), dict(choices) if choices is not None else made,
                   list(overrides) if overrides is not None else list(hydra.overrides.task),
                   hydra.mode == RunMode.MULTIRUN, str(hydra.launcher.get("_target_", "")),
                   tuple(str(entry) for entry in hydra.searchpath or []))
