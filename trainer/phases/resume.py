"""A run's identity (`run.name`, in every run folder's ``run.json``) and where it resumes from
(`resume=auto|if_any|PATH`), or whether it already completed: the rules are in docs/reliability.md
("Resuming"). The run's name, not its folder, is the identity: the same command run again lands in
a new Hydra folder."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, cast

from trainer.configuration.diff import result_overrides
from trainer.infra.atomic import write_text_atomic
from trainer.infra.attempts import utc_now
from trainer.infra.checkpoint_files import clean_state_dict, load_checkpoint
from trainer.infra.errors import UserError

log = logging.getLogger("trainer")

IDENTITY_FILE = "run.json"
def default_name(choices: Mapping[str, str], overrides: Sequence[str]) -> str:
    """The recipe (or ``data-model``), then the overrides that change the result, sorted:
    ``digits-small_cnn`` or ``cifar10_resnet18,optimizer.lr=0.1``. The same command gives the same
    name, which is what a requeue needs; different sweep jobs get different names."""
    base = choices.get("recipe") or f"{choices.get('data', 'data')}-{choices.get('model', 'model')}"
    kept = [o.lstrip("+") for o in result_overrides(overrides) if o.split("=", 1)[0].lstrip("+~") != "recipe"]
    return ",".join([base, *sorted(kept)])


def write_identity(run_dir: Path, name: str, resumed_from: str | None,
                   logger_ids: Mapping[str, str] | None = None) -> None:
    record = {"name": name, "started": utc_now(),
              "resumed_from": resumed_from, "logger_ids": dict(logger_ids or {})}
    write_text_atomic(run_dir / IDENTITY_FILE, json.dumps(record, indent=2) + "\n")


def _identity_in(folder: Path) -> dict[str, Any] | None:
    """run.json in `folder`; None where there is none, or none that reads as a record."""
    try:
        record = json.loads((folder / IDENTITY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def identity_of(checkpoint_path: Path) -> dict[str, Any]:
    """run.json of the run folder a checkpoint lies in (``RUN/checkpoints/x.ckpt``); {} if none."""
    for folder in (Path(checkpoint_path).parent.parent, Path(checkpoint_path).parent):
        record = _identity_in(folder)
        if record is not None:
            return record
    return {}


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    global_step: int
    epoch: int
    mid_epoch: bool
    #: The model's weights as saved: name -> shape (read once here, for `check_fits`).
    shapes: dict[str, tuple[int, ...]]


def read_resumable(path: Path) -> Checkpoint:
    """Read the checkpoint's header fields (memory-mapped: the tensors are not read); a file that is
    not a whole training checkpoint raises `UserError`."""
    checkpoint = load_checkpoint(path, map_location="cpu", mmap=True)
    missing = [key for key in ("state_dict", "loops", "optimizer_states", "global_step", "epoch")
               if key not in checkpoint]
    if missing:
        raise UserError(str(path), f"not a training checkpoint to resume from (no {', '.join(missing)})",
                        "a .ckpt written by a training run (last.ckpt or a best checkpoint)")
    fit_loop = checkpoint["loops"].get("fit_loop", {}) if isinstance(checkpoint["loops"], Mapping) else {}
    batches = fit_loop.get("epoch_loop.batch_progress", {})
    mid_epoch = bool(batches) and not batches.get("is_last_batch") and batches.get("current", {}).get("processed", 0) > 0
    shapes = {k: tuple(v.shape) for k, v in checkpoint["state_dict"].items() if hasattr(v, "shape")}
    return Checkpoint(Path(path), int(checkpoint["global_step"]), int(checkpoint["epoch"]), mid_epoch, shapes)


def checkpoint_files(folder: Path) -> list[Path]:
    """The .ckpt files in `folder`; hidden ones are temporaries of writes in progress (trainer/infra/atomic.py)."""
    return [p for p in folder.glob("*.ckpt") if not p.name.startswith(".") and p.is_file()]


def newest_first(paths: list[Path]) -> list[Path]:
    """By modification time, newest first; last.ckpt first on a tie."""
    return sorted(paths, key=lambda p: (p.stat().st_mtime_ns, p.name == "last.ckpt"), reverse=True)


def run_folders(name: str, root: Path, own_folder: Path | None = None) -> list[Path]:
    """The folders under `root` whose run.json carries `name`, and this run's own folder (wherever
    it lies, unless it names another run)."""
    found: list[Path] = []
    for current, folders, files in os.walk(root):  # nothing for a `root` that is not a folder
        # A run folder's own subfolders (checkpoints, logs) hold no run folders: do not descend.
        if IDENTITY_FILE in files:
            folders[:] = []
            folder = Path(current)
            own = own_folder is not None and folder.resolve() == own_folder.resolve()
            if not own and (_identity_in(folder) or {}).get("name") == name:
                found.append(folder)
        else:
            folders[:] = [f for f in folders if not f.startswith(".")]
    if own_folder is not None and (_identity_in(own_folder) or {}).get("name") in (name, None):
        found.append(own_folder)
    return found


def find_latest(name: str, root: Path, own_folder: Path | None = None) -> Checkpoint | None:
    """The newest checkpoint (by modification time; last.ckpt first on a tie) of the runs named
    `name` that reads back whole. `own_folder`, this run's folder, is searched too, wherever it
    lies: a requeued SLURM job starts again in the folder of its first attempt."""
    folders = run_folders(name, root, own_folder)
    candidates = [path for folder in folders for path in checkpoint_files(folder / "checkpoints")]
    for path in newest_first(candidates):
        try:
            return read_resumable(path)
        except UserError as ex:
            log.warning("resume: passing over %s", ex.line())
    return None


def requested(request: str | None) -> str | None:
    """`resume` as the run takes it: as configured, or ``if_any`` for a job that SLURM started again."""
    if request is None and int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0:
        # A job SLURM started again (requeued after a preemption) runs the same command in the same
        # folder: starting fresh would throw away its own checkpoint.
        log.info("resume: this SLURM job was requeued (SLURM_RESTART_COUNT=%s): carrying on as resume=if_any",
                 os.environ["SLURM_RESTART_COUNT"])
        return "if_any"
    return request


@dataclass(frozen=True)
class Completed:
    """A run that completed: its folder and its summary."""

    folder: Path
    summary: dict[str, Any]


#: The keys that say where training stops: a completed run asked to resume with other values carries on.
STOP_KEYS = ("max_epochs", "max_steps")
RESOLVED_CONFIG = "config_resolved.yaml"


def completed_run(request: str | None, name: str, root: Path, run_dir: Path,
                  stop: Mapping[str, Any]) -> Completed | None:
    """The run, if `resume` asks to carry on (auto or if_any) and its newest summary says it
    completed with the same stopping point (`stop`: the trainer's max_epochs and max_steps)."""
    if request not in ("auto", "if_any"):
        return None  # fresh, or resume=PATH: a checkpoint named on purpose is resumed (and tested) again
    newest: tuple[int, Path, dict[str, Any]] | None = None
    for folder in run_folders(name, root, run_dir):
        try:
            written = (folder / "summary.json").stat().st_mtime_ns
            summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(summary, dict) and (newest is None or written > newest[0]):
            newest = (written, folder, summary)
    if newest is None or newest[2].get("status") != "completed":
        return None
    _, folder, summary = newest
    stopped = _stop_of(folder)
    differs = {k: (stopped[k], stop.get(k)) for k in STOP_KEYS if k in stopped and stopped[k] != stop.get(k)}
    if differs:
        log.info("resume: run '%s' completed in %s with %s; carrying on to %s", name, folder,
                 ", ".join(f"trainer.{k}={old}" for k, (old, _) in differs.items()),
                 ", ".join(f"trainer.{k}={new}" for k, (_, new) in differs.items()))
        return None
    return Completed(folder, summary)


def _stop_of(folder: Path) -> dict[str, Any]:
    """Where the run in `folder` was configured to stop, from its resolved config ({} if unreadable)."""
    from omegaconf import OmegaConf  # the config library: imported where a resume asks

    try:
        config = cast(dict[str, Any], OmegaConf.to_container(OmegaConf.load(folder / RESOLVED_CONFIG)))  # a mapping
        trainer = config.get("trainer") or {}
    except Exception:  # noqa: BLE001 - a missing or torn file: nothing to compare against
        return {}
    return {k: trainer[k] for k in STOP_KEYS if k in trainer}


def resolve_resume(request: str | None, name: str, root: Path, run_dir: Path) -> Checkpoint | None:
    """What `resume` asks for (see `requested`), as a checkpoint; None when the run starts fresh."""
    request = requested(request)
    if request is None:
        return None
    if request in ("if_any", "auto"):
        found = find_latest(name, root, run_dir)
        if found is None and request == "if_any":  # a job that may be a requeue: fresh when there is nothing
            log.info("resume=if_any: no checkpoint of run '%s' under '%s' yet: starting fresh", name, root)
        elif found is None:
            raise UserError("resume", f"auto found no readable checkpoint of run '{name}' under '{root}'",
                            "run.name of an earlier run (see run.json in its folder), run.root=FOLDER where it is kept, "
                            "resume=PATH/TO/last.ckpt, resume=if_any (fresh when nothing is found), "
                            "or no resume to start fresh")
        return found
    path = Path(request).expanduser()
    if path.is_dir():  # a run folder: its newest checkpoint
        checkpoints = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        files = newest_first(checkpoint_files(checkpoints))
        if not files:
            raise UserError("resume", f"no .ckpt file in '{checkpoints}'", "resume=auto, or the path of a .ckpt file")
        path = files[0]
    elif not path.is_file():
        raise UserError("resume", f"'{path}' does not exist", "resume=auto, or the path of a .ckpt file or run folder")
    return read_resumable(path)


def check_fits(checkpoint: Checkpoint, model_state: Mapping[str, Any]) -> None:
    """The checkpoint's weights fit this run's model: same names, same shapes (one line otherwise,
    instead of Lightning's traceback from load_state_dict)."""
    saved = checkpoint.shapes
    ours = clean_state_dict(model_state)
    missing = sorted(set(ours) - set(saved))
    unexpected = sorted(set(saved) - set(ours))
    shapes = sorted(k for k in set(ours) & set(saved) if saved[k] != tuple(ours[k].shape))
    problems = []
    if missing:
        problems.append(f"{len(missing)} weights missing (e.g. {missing[0]})")
    if unexpected:
        problems.append(f"{len(unexpected)} unknown weights (e.g. {unexpected[0]})")
    if shapes:
        key = shapes[0]
        problems.append(f"{len(shapes)} of other shapes (e.g. {key}: {saved[key]} in the checkpoint, "
                        f"{tuple(ours[key].shape)} here)")
    if problems:
        raise UserError("resume", f"{checkpoint.path} was written by another model: {'; '.join(problems)}",
                        "the model and data settings of the run that wrote it, or resume=null to start fresh")
