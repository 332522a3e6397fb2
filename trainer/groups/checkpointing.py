"""The `checkpointing` group: when checkpoints are written and which are kept (the last one, the best
ones by a metric, periodic ones inside epochs). How a checkpoint file is written and read (atomic,
weights-only, keyed like the plain model) is trainer/infra/checkpoint_files.py's."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from trainer.callbacks.steps import StepBoundary
from trainer.infra.schema import AT_LEAST_ONE, POSITIVE, ConfigGroup, Doc, Range, check_keys


@dataclass
class CheckpointingConfig:
    """Keep the last checkpoint and the best ones by a validation metric."""

    enabled: Annotated[bool, Doc("write checkpoints at all (false: none, and the test uses the final weights)")]
    monitor: Annotated[str, Doc("the metric that picks the best checkpoint, which the test uses: val/loss, train/loss, "
                                "or any val/ or train/ metric the task logs (checked at start)")]
    mode: Annotated[Literal["max", "min"], Doc("whether a larger or a smaller monitor value is better")]
    save_last: Annotated[bool, Doc("keep checkpoints/last.ckpt, which resume carries on from")]
    save_top_k: Annotated[int, Range(ge=-1), Doc("best checkpoints kept (-1: all, 0: none)")]
    every_n_epochs: Annotated[int, AT_LEAST_ONE, Doc("epochs between checkpoints")]
    every_n_steps: Annotated[Optional[Annotated[int, AT_LEAST_ONE]],
                             Doc("also write last.ckpt every N optimizer steps inside an epoch (null: no)")]
    every_minutes: Annotated[Optional[Annotated[float, POSITIVE]],
                             Doc("also write last.ckpt every N minutes of training (null: only at epoch ends)")]


class LatestAndBest(ModelCheckpoint):
    """Lightning's ModelCheckpoint, with ``last.ckpt`` written at every epoch end (and every
    validation inside an epoch), as Lightning did before 2.6.

    Deliberately replaced: Lightning 2.6 writes last.ckpt only beside a new top-k checkpoint, so a run
    whose metric stopped improving kept a last.ckpt from its best epoch (a 20-epoch run here ended
    with last.ckpt at epoch 18) and ``resume=auto`` would redo every epoch since; with
    ``save_top_k=0`` none was written. tests/unit/test_library_pins.py pins the methods used."""

    @property
    def state_key(self) -> str:
        """ModelCheckpoint's own key, so checkpoints written before (or by plain Lightning) resume alike."""
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Deliberately replaced: Lightning restores only `best_model_path` when the checkpoint was
        written in another folder. A run resumed with ``resume=auto`` lands in a new Hydra folder but
        is the same run: forgetting its best score would make the next validation "best" whatever its
        value, and the test would take worse weights than the uninterrupted run. The earlier folder's
        files stay: Lightning never removes a checkpoint outside this callback's own folder."""
        super().load_state_dict({**state_dict, "dirpath": self.dirpath})

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Deliberately shortened: saving inside an epoch is PeriodicCheckpoint's (this callback has
        # neither every_n_train_steps nor train_time_interval), where Lightning's hook asks the
        # trainer's state, sanity check and step at every batch to save nothing (tens of us a step).
        if self._every_n_train_steps < 1 and self._train_time_interval is None:
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._keep_latest(trainer)
        elif self.save_last and _training_ends(trainer) and not self._should_skip_saving_checkpoint_but_step(trainer):
            # Validating inside epochs (val_check_interval), last.ckpt was written at the last
            # validation, before the epoch's training metrics were logged; Lightning's "already saved
            # at this step" would skip this one. The run's final state is written again with them, so
            # a run killed in its test reports what training reached (trainer/callbacks/logged_metrics.py).
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @staticmethod
    def _should_skip_saving_checkpoint_but_step(trainer: L.Trainer) -> bool:
        """Lightning's other reasons not to write: a dry run, not fitting, a sanity check."""
        from lightning.pytorch.trainer.states import TrainerFn

        return bool(getattr(trainer, "fast_dev_run", False) or trainer.state.fn != TrainerFn.FITTING
                    or trainer.sanity_checking)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._keep_latest(trainer)

    def _keep_latest(self, trainer: L.Trainer) -> None:
        # Lightning's own test of when nothing is to be written (a sanity check, not fitting,
        # fast_dev_run), including "already saved at this step": a top-k save at this step wrote
        # last.ckpt beside it.
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def _training_ends(trainer: L.Trainer) -> bool:
    """This epoch end is training's last: max_steps reached, the last epoch, or a stop asked for."""
    steps_done = trainer.max_steps is not None and 0 < trainer.max_steps <= trainer.global_step
    epochs_done = trainer.max_epochs is not None and 0 < trainer.max_epochs <= trainer.current_epoch + 1
    return bool(steps_done or epochs_done or trainer.should_stop)


def build_checkpointing(cfg: CheckpointingConfig, run_dir: Path) -> ModelCheckpoint | None:
    if not cfg.enabled:
        return None
    # The metric's name has a "/" in it: kept out of the file name. last.ckpt is also written by
    # PeriodicCheckpoint and GracefulStop: replaced, not versioned to last-v1.ckpt (the best ones
    # carry epoch and step in their names anyway).
    return LatestAndBest(dirpath=run_dir / "checkpoints", filename="epoch{epoch:03d}-step{step:06d}",
                         auto_insert_metric_name=False, monitor=cfg.monitor, mode=cfg.mode, save_last=cfg.save_last,
                         save_top_k=cfg.save_top_k, every_n_epochs=cfg.every_n_epochs, enable_version_counter=False)


def build_periodic(cfg: CheckpointingConfig, run_dir: Path) -> PeriodicCheckpoint | None:
    if not cfg.enabled or not (cfg.every_n_steps or cfg.every_minutes):
        return None
    return PeriodicCheckpoint(run_dir / "checkpoints", cfg.every_n_steps, cfg.every_minutes)


class PeriodicCheckpoint(StepBoundary):
    """Writes ``checkpoints/last.ckpt`` inside epochs: every `every_n_steps` optimizer steps and/or
    once `every_minutes` of training have passed since the last one. The checkpoint holds the
    loader's place in the epoch, so `resume` carries on from the next batch.

    Deliberately not a second ModelCheckpoint(every_n_train_steps=..., train_time_interval=...): it
    refuses the two together, saves at an epoch's last batch (an epoch cut short by
    limit_train_batches would resume as mid-epoch and be trained again), and would write
    last-v1.ckpt beside the epoch-end one; tests/unit/test_library_pins.py pins the first two."""

    def __init__(self, dirpath: Path, every_n_steps: int | None, every_minutes: float | None) -> None:
        self.path = Path(dirpath) / "last.ckpt"
        self.every_n_steps = every_n_steps
        self.every_s = every_minutes * 60 if every_minutes else None
        self._last_save = time.monotonic()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_save = time.monotonic()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = int(trainer.global_step)
        due = bool(self.every_n_steps and step % self.every_n_steps == 0)
        due = due or bool(self.every_s and time.monotonic() - self._last_save >= self.every_s)
        if not due and trainer.world_size == 1:
            return  # (the usual step: nothing due, and no other process to agree with)
        if not self.ended_on_optimizer_step(trainer):
            return  # no optimizer step in this batch (gradient accumulation): its gradients are in no checkpoint
        if self.ends_epoch(trainer, batch_idx):
            return  # the epoch's end writes last.ckpt (StepBoundary.ends_epoch says why not here)
        # Every process must take the same decision: saving is a collective operation.
        if trainer.strategy.broadcast(due):
            trainer.save_checkpoint(str(self.path), weights_only=False)  # full: resumable (Lightning logs the default)
            self._last_save = time.monotonic()


GROUP = ConfigGroup("checkpointing", __name__, "last and best checkpoints, periodic ones inside epochs",
                    lambda values: check_keys("checkpointing", values, CheckpointingConfig),
                    keys=CheckpointingConfig)
