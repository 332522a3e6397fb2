"""The compose phase: what Hydra composed for this job, and where it runs (its validation against
every group's schema is `trainer.configuration.spec.validate`), and whether that folder is this
job's own: a run refused before it trains removes its own (`remove_refused_run`), whether the
command line refused it before importing the run (trainer/cli.py) or the run did (trainer/run.py)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from trainer.infra.atomic import remove_empty_folders


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
    #: The run folder held nothing from before this job when it started (`made_by_this_job`).
    own_folder: bool = False

    @classmethod
    def from_hydra(cls, cfg: DictConfig, run_dir: Path | None = None, choices: dict[str, str] | None = None,
                   overrides: list[str] | None = None, own_folder: bool | None = None) -> Job:
        """The current Hydra job; `run_dir`, `choices` and `overrides` given outside a Hydra app;
        `own_folder` as found when the job started (else asked now: outside a Hydra app, a folder
        the caller has not made yet)."""
        if run_dir is not None and choices is not None:
            own = not run_dir.exists() if own_folder is None else own_folder
            return cls(cfg, run_dir, dict(choices), list(overrides or []), own_folder=own)
        hydra = HydraConfig.get()
        made = {k: str(v) for k, v in hydra.runtime.choices.items() if not k.startswith("hydra") and v is not None}
        folder = run_dir or Path(hydra.runtime.output_dir)
        return cls(cfg, folder, dict(choices) if choices is not None else made,
                   list(overrides) if overrides is not None else list(hydra.overrides.task),
                   hydra.mode == RunMode.MULTIRUN, str(hydra.launcher.get("_target_", "")),
                   tuple(str(entry) for entry in hydra.searchpath or []),
                   made_by_this_job(folder) if own_folder is None else own_folder)


#: What Hydra writes into a run folder before the task runs: its record of the job and the log file.
HYDRA_START = frozenset({".hydra", "train.log"})
#: Hydra's record of the job in .hydra/, rewritten by every job that runs in the folder.
HYDRA_RECORD = frozenset({"config.yaml", "hydra.yaml", "overrides.yaml"})


def made_by_this_job(run_dir: Path) -> bool:
    """Whether the run folder holds nothing from before this job: only what Hydra writes as a job
    starts (its record, which every job rewrites, and an empty log file). Asked as the job starts,
    before anything logs (trainer/cli.py asks before importing the run). False for a folder a run
    has used before: a resume or a re-run into it, an earlier attempt's."""
    if not run_dir.exists():
        return True
    if not {entry.name for entry in run_dir.iterdir()} <= HYDRA_START:
        return False
    log_file, record = run_dir / "train.log", run_dir / ".hydra"
    if log_file.exists() and (not log_file.is_file() or log_file.stat().st_size):
        return False
    return not record.exists() or (record.is_dir() and {e.name for e in record.iterdir()} <= HYDRA_RECORD)


#: What a run writes into its folder before it trains, after Hydra's own (identify: run.json;
#: prepare: env.json and config_resolved.yaml). Anything else (checkpoints, summary.json, a logger's
#: or a data set's files, bad_files.tsv) means the folder holds more than a refused start and is kept.
RUN_START = HYDRA_START | {"run.json", "env.json", "config_resolved.yaml"}


def remove_refused_folder(run_dir: Path) -> bool:
    """Remove the folder of a run refused before it trained (the caller asks `made_by_this_job` first),
    where it still holds only what the start wrote (`RUN_START`): a mistake leaves no folder to mistake
    for a run. True when removed."""
    try:
        entries = {entry.name for entry in run_dir.iterdir()}
    except OSError:
        return False
    if not entries <= RUN_START or any((run_dir / name).is_symlink() for name in entries):
        return False
    record = run_dir / ".hydra"
    if record.exists() and (not record.is_dir() or not {e.name for e in record.iterdir()} <= HYDRA_RECORD):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return not run_dir.exists()


def remove_refused_run(run_dir: Path, cfg: DictConfig) -> None:
    """A single run refused before it trained, in a folder this job made (`made_by_this_job`): the
    folder goes where it holds only what the start wrote, then the folders above it up to `run.root`
    that are now empty."""
    if remove_refused_folder(run_dir):
        root = OmegaConf.select(cfg, "run.root", throw_on_resolution_failure=False)
        if isinstance(root, str):  # the day's folder of runs/DATE/TIME, after the day's first run was refused
            remove_empty_folders(run_dir.parent, below=Path(root))
