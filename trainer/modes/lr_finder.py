"""optimizer.lr=find: Lightning's lr range test (`Tuner.lr_find`), run between the build and the
resolve phase on rank 0 alone, on a Trainer of its own. It leaves the run's network, data module, TF32
setting, random generators and data order as they were: a run whose test suggests X trains exactly as
a run given X does. How it runs and what it writes are in docs/practices.md ("The lr range test")."""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import json
import logging
import math
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities.seed import isolate_rng
from torchmetrics import Metric

from trainer.configuration.spec import RunSpec, choice_values
from trainer.data.base import DataModule
from trainer.groups.optimizer.scaling import FoundLr
from trainer.groups.optimizer.schema import LR_FIND
from trainer.groups.precision import lightning_precision, tf32_during
from trainer.groups.scheduler import SchedulerConfig
from trainer.groups.trainer import make_trainer
from trainer.infra.atomic import write_json_atomic
from trainer.infra.distributed import rank_zero_record
from trainer.infra.errors import UserError
from trainer.infra.figures import new_figure, save_png
from trainer.infra.library_logs import quiet_library_warnings
from trainer.phases.plan import Derived, Probe, per_device_batch
from trainer.phases.state import Run
from trainer.task import TrainingTask

log = logging.getLogger("trainer")

LR_FIND_FILE = "lr_find.json"
LR_FIND_PLOT = "lr_find.png"
#: Lightning's suggestion leaves out the first losses (too early to say) and the last one.
SKIPPED_AT_START = 10
#: What a record must hold to be used (on another rank, or on resume).
RECORD_KEYS = ("lr", "batch_size", "min_lr", "max_lr", "steps", "suggestion_index", "loss_at_suggestion")
WHAT_TO_DO = ("a fixed optimizer.lr, or a wider range (a lower optimizer.find_min_lr, a higher "
              "optimizer.find_max_lr) or more optimizer.find_steps")


def find_lr(run: Run, probe: Probe, batch: Derived | None = None) -> FoundLr:
    """The lr the range test suggests at this run's per-device batch (`batch`, what
    data.batch_size=auto found, else data.batch_size), with how it was found. Rank 0 runs the test
    (or, resuming, reads the answer the run already has); the other ranks read rank 0's."""
    spec, run_dir = run.spec, run.job.run_dir
    resumed_from = run.identity.resume_from.path if run.identity.resume_from is not None else None
    record = run_dir / LR_FIND_FILE
    shipped = shipped_lr(spec)
    if not run.rank_zero:
        found = rank_zero_record(record, RECORD_KEYS, "optimizer.lr", LR_FIND,
                                 "a fixed optimizer.lr, or check rank 0's log")
        return found_lr(found, shipped, "rank 0's")
    earlier = earlier_record(run_dir, resumed_from)
    if earlier is not None:
        found = json.loads(earlier.read_text())
        if earlier != record:  # resumed in a new folder: the record travels with the run
            write_json_atomic(record, found)
            if (earlier.parent / LR_FIND_PLOT).is_file():
                shutil.copyfile(earlier.parent / LR_FIND_PLOT, run_dir / LR_FIND_PLOT)
        log.info("optimizer.lr=find: the range test's answer of the run resumed, from %s", earlier)
        return found_lr(found, shipped, f"from {earlier.parent.name}/{LR_FIND_FILE}, resumed")
    found = range_test(run, probe, per_device_batch(spec, batch))
    return found_lr(found, shipped)


def earlier_record(run_dir: Path, resumed_from: Path | None) -> Path | None:
    """lr_find.json of a run that carries on from a checkpoint (`resumed_from`): in its own folder
    (a requeued job), or in the folder the checkpoint was written in (the same command run again).
    None for a fresh run, and for a run that has none (then the test runs)."""
    if resumed_from is None:
        return None
    for folder in (run_dir, Path(resumed_from).parent.parent):  # RUN/checkpoints/last.ckpt
        path = folder / LR_FIND_FILE
        try:
            found = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(found, dict) and all(key in found for key in RECORD_KEYS):
            return path
    return None


def found_lr(found: dict[str, Any], shipped: tuple[float, str] | None, note: str = "") -> FoundLr:
    """The record as the plan takes it, saying how the lr was found."""
    how = (f"found by Lightning's lr range test (steepest descent of the smoothed loss at {found['lr']:.3g}, "
           f"{found['steps']} steps {found['min_lr']:g}..{found['max_lr']:g}; {LR_FIND_PLOT}"
           + (f"; {note})" if note else ")"))
    lr, origin = shipped if shipped is not None else (None, "")
    return FoundLr(float(found["lr"]), int(found["batch_size"]), how, lr, origin)


def shipped_lr(spec: RunSpec) -> tuple[float, str] | None:
    """The lr the optimizer choice ships (its YAML, composed by Hydra as the run's own config was,
    a team's search path included), with the choice's name: what the batch rule would have started
    from."""
    for choice in (spec.choices.get("optimizer"), spec.optimizer.name):  # a choice, else the optimizer's name
        try:
            lr = choice_values("optimizer", choice).get("lr") if choice else None
        except Exception:  # noqa: BLE001 - a choice that cannot be composed alone has nothing to compare with
            continue
        if isinstance(lr, (int, float)) and not isinstance(lr, bool):
            return float(lr), f"optimizer={choice}"
    return None


def range_test(run: Run, probe: Probe, batch: int) -> dict[str, Any]:
    """Run Lightning's range test on a copy of the network at the per-device `batch`; write
    lr_find.json and lr_find.png. The data module, TF32 and the global random generators are as
    they were afterwards (Lightning's `isolate_rng` for the generators, CUDA's included)."""
    opt, datamodule, run_dir = run.spec.optimizer, run.parts.datamodule, run.job.run_dir
    log.info("optimizer.lr=find: Lightning's lr range test, %d steps from %g to %g at batch %d", opt.find_steps,
             opt.find_min_lr, opt.find_max_lr, batch)
    with isolate_rng(include_cuda=probe.accelerator == "cuda"), tf32_during(probe.tf32, probe.accelerator), \
            _batch_during(datamodule, batch), tempfile.TemporaryDirectory(prefix="lr_find.") as scratch:
        finder = _run_finder(run, probe, batch, Path(scratch))
    lrs, losses = [float(v) for v in finder.results["lr"]], [float(v) for v in finder.results["loss"]]
    suggested = _check_suggestion(steepest_descent(finder, SKIPPED_AT_START), lrs, losses, opt.find_steps)
    index = lrs.index(suggested)
    found = {"lr": float(suggested), "batch_size": batch, "min_lr": opt.find_min_lr,
             "max_lr": opt.find_max_lr, "steps": opt.find_steps, "steps_run": len(lrs), "suggestion_index": index,
             "loss_at_suggestion": losses[index], "lrs": lrs, "losses": losses}
    figure = new_figure(figsize=(6, 4), layout="constrained")
    finder.plot(suggest=True, ax=figure.add_subplot())
    figure.axes[0].set(title=f"lr range test: suggested {suggested:.3g} (steepest descent), batch {batch}",
                       ylabel="training loss (smoothed)")
    save_png(figure, run_dir / LR_FIND_PLOT)
    write_json_atomic(run_dir / LR_FIND_FILE, found)
    log.info("optimizer.lr=find: %.4g after %d steps (%s)", suggested, len(lrs), run_dir / LR_FIND_PLOT)
    return found


@contextlib.contextmanager
def _batch_during(datamodule: DataModule, batch: int) -> Iterator[None]:
    """The data module's loaders at `batch` while the test runs; as they were afterwards (the run's
    batch is the plan's, applied by the build phase)."""
    before = datamodule.batch_size, datamodule.eval_batch_size
    datamodule.set_batch_size(batch)
    try:
        yield
    finally:
        datamodule.batch_size, datamodule.eval_batch_size = before


def _run_finder(run: Run, probe: Probe, batch: int, scratch: Path) -> Any:
    """Lightning's tuner on a Trainer of its own, with a deep copy of the network."""
    spec, parts = run.spec, run.parts
    opt = spec.optimizer
    # A constant schedule: the test replaces the schedule with its own, and the one-cycle schedule
    # would set the momentum first (the test runs at the optimizer's own momentum, as fastai's).
    constant = SchedulerConfig(name="constant", interval="step", target="trainer.groups.scheduler.constant")
    task = TrainingTask(copy.deepcopy(parts.net), parts.definition, probe.optimizer(spec, parts.net, batch), constant,
                        channels_last=probe.channels_last)
    task.announces_schedule = False
    # Under torchrun the process group exists already and rank 0 tests alone: a metric synchronized
    # over the processes as an epoch of the test ends would wait for the other ranks forever.
    for metric in task.modules():
        if isinstance(metric, Metric):
            metric.sync_on_compute = False
            # torchmetrics reads `_to_sync`, copied from sync_on_compute when the metric is made and
            # again only after a forward call: a metric a task updates with `update()` would still sync.
            metric._to_sync = False
    with quiet_library_warnings(), warnings.catch_warnings(), _lightning_quiet(logging.WARNING), \
            _bar_kept_off(probe.progress != "rich"):
        # Lightning's hint to use srun, which the run's own Trainer gives once already.
        warnings.filterwarnings("ignore", message=".*The `srun` command is available.*")
        trainer = make_trainer((), **_finder_trainer_arguments(spec, probe, scratch))
        finder = Tuner(trainer).lr_find(task, datamodule=parts.datamodule, min_lr=opt.find_min_lr,
                                        max_lr=opt.find_max_lr, num_training=opt.find_steps, update_attr=False)
    del trainer, task  # the copy's memory back before the run builds its own
    gc.collect()
    if probe.accelerator == "cuda":
        torch.cuda.empty_cache()
    assert finder is not None  # None only under fast_dev_run, which this Trainer does not have
    return finder


def _finder_trainer_arguments(spec: RunSpec, probe: Probe, scratch: Path) -> dict[str, Any]:
    """One device with the run's accelerator, precision, determinism and cuDNN autotuning, and
    nothing else of the run's Trainer."""
    steps = spec.optimizer.find_steps
    return dict(
        accelerator=probe.accelerator, devices=1, **lightning_precision(probe.precision, probe.accelerator,
                                                                        spec.precision),
        deterministic=spec.trainer.get("deterministic"), benchmark=probe.cudnn_benchmark,
        # No callbacks: Lightning's test replaces the Trainer's callbacks with its own recorder for the
        # sweep anyway; the clipping percentile would calibrate on gradients that grow with the lr,
        # and the test stops itself where the loss diverges (4x its best) instead of a guard.
        callbacks=[], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, max_epochs=-1, max_steps=steps, num_sanity_val_steps=0,
        # The test sets limit_val_batches itself; with more epochs than steps between validations
        # there is none (an epoch shorter than the test is cycled: the loader starts its next epoch).
        check_val_every_n_epoch=steps + 1,
        # Its checkpoint of the initial state goes here, not into the run folder.
        default_root_dir=str(scratch))


def steepest_descent(finder: Any, skip_begin: int) -> float | None:
    """The lr where the smoothed loss falls fastest per unit of log(lr), marked on the finder for its
    plot (the first `skip_begin` losses and the last left out); None with fewer than 2 finite losses.

    Deliberately not Lightning's `suggestion()`: it takes the gradient against the lr itself, so on
    its exponential sweep a step between two small lrs is a tiny distance, and any wobble of the
    plateau there outweighs the real descent. On the 32 px digits it picked 0.00033, 150x below
    where the loss falls (0.02-2); fastai's `steep` suggestion, as here, uses log(lr)."""
    lrs = finder.results["lr"][skip_begin:-1]
    losses = finder.results["loss"][skip_begin:-1]
    finite = [i for i, loss in enumerate(losses) if math.isfinite(loss) and lrs[i] > 0]
    if len(finite) < 2:
        finder._optimal_idx = None
        return None
    log_lrs = torch.tensor([math.log(lrs[i]) for i in finite], dtype=torch.float64)
    gradients = torch.gradient(torch.tensor([losses[i] for i in finite], dtype=torch.float64), spacing=[log_lrs])[0]
    index = skip_begin + finite[int(torch.argmin(gradients))]
    finder._optimal_idx = index  # what `plot(suggest=True)` marks
    return float(finder.results["lr"][index])


def _check_suggestion(suggested: float | None, lrs: list[float], losses: list[float], steps: int) -> float:
    """A suggestion to train with, or one line saying why there is none."""
    what = f"{len(lrs)} of {steps} steps from {lrs[0]:g} to {lrs[-1]:g}" if lrs else f"none of {steps} steps"
    if suggested is None:
        raise UserError("optimizer.lr", f"find: the lr range test has no suggestion ({what}: the smoothed loss "
                        "diverged or was not finite before enough losses were recorded)", WHAT_TO_DO)
    # Compared from where the suggestion starts looking, not with the first loss: Lightning's smoothing
    # corrects its running mean for one step more than it has, so its first values are too low.
    window = [loss for loss in losses[SKIPPED_AT_START:] if math.isfinite(loss)]
    if window and min(window[1:], default=math.inf) >= window[0]:
        raise UserError("optimizer.lr", f"find: the smoothed loss never fell below {window[0]:.4g}, its value at "
                        f"{lrs[SKIPPED_AT_START]:.3g} ({what})", WHAT_TO_DO)
    return suggested


@contextlib.contextmanager
def _lightning_quiet(level: int) -> Iterator[None]:
    """Lightning's messages below `level` left out: the test's Trainer does not print Lightning's
    device report (one device, which a multi-process run's report would contradict)."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    before = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, earlier in zip(loggers, before):
            logger.setLevel(earlier)


#: How Lightning's range test labels the tqdm bar it always draws on stderr.
_BAR = "Finding best initial lr"


@contextlib.contextmanager
def _bar_kept_off(off: bool) -> Iterator[None]:
    """Without the Rich progress output (in logs and pipes), Lightning's bar would be a line of
    carriage returns there: stderr is caught while the test runs, and what else was written to it
    goes on afterwards."""
    if not off:
        yield
        return
    caught = io.StringIO()
    try:
        with contextlib.redirect_stderr(caught):
            yield
    finally:
        rest = [line for line in caught.getvalue().replace("\r", "\n").splitlines()
                if line.strip() and not line.startswith(_BAR)]
        if rest:
            sys.stderr.write("\n".join(rest) + "\n")
