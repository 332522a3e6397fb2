"""The `checkpointing` group, and checkpoints that cannot be half-written or poisoned.

Atomic writes, ``torch.load(weights_only=True)`` reads and keys of the plain model (no
``_orig_mod.`` or ``module.``, on saving and loading) are described in docs/reliability.md
("Checkpoints"). Lightning's own writer streams into the target path, so a kill mid-write leaves a
truncated file under the real name. `export_safetensors` writes the weights alone, for sharing."""

from __future__ import annotations

import argparse
import json
import pickle
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Mapping, Optional

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import save_file

from trainer.callbacks.steps import StepBoundary
from trainer.infra.atomic import replace_atomic
from trainer.infra.errors import UserError, first_line, one_line_on_user_error
from trainer.infra.schema import AT_LEAST_ONE, POSITIVE, ConfigGroup, Doc, Range, check_keys

COMPILE_PREFIX = "_orig_mod."
WRAPPER_PREFIX = "module."


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
    return LatestAndBest(
        dirpath=run_dir / "checkpoints",
        # The metric's name has a "/" in it; keep it out of the file name.
        filename="epoch{epoch:03d}-step{step:06d}",
        auto_insert_metric_name=False,
        monitor=cfg.monitor,
        mode=cfg.mode,
        save_last=cfg.save_last,
        save_top_k=cfg.save_top_k,
        every_n_epochs=cfg.every_n_epochs,
        # last.ckpt is also written by PeriodicCheckpoint and GracefulStop: replace it, do not
        # version it to last-v1.ckpt (the best ones carry epoch and step in their names anyway).
        enable_version_counter=False,
    )


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


def clean_key(key: str) -> str:
    """The key as the plain model names it."""
    if key.startswith(WRAPPER_PREFIX):
        key = key[len(WRAPPER_PREFIX):]
    if key.startswith(COMPILE_PREFIX):
        key = key[len(COMPILE_PREFIX):]
    return key.replace("." + COMPILE_PREFIX, ".")


def clean_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    cleaned = {clean_key(k): v for k, v in state_dict.items()}
    if len(cleaned) != len(state_dict):
        raise ValueError("state dict has keys that differ only by _orig_mod./module. prefixes")
    return cleaned


def load_weights(module: torch.nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
    """Load a (clean or prefixed) state dict into `module`, which may itself be compiled or wrapped."""
    inner = module
    while True:
        if isinstance(inner, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel):
            inner = inner.module
        elif hasattr(inner, "_orig_mod") and isinstance(inner._orig_mod, torch.nn.Module):
            inner = inner._orig_mod  # torch.compile(module) wraps it in an OptimizedModule
        else:
            break
    return inner.load_state_dict(clean_state_dict(state_dict), strict=strict)


def load_checkpoint(path: str | Path, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint safely; a refused, truncated or missing file is a one-line `UserError`.
    `mmap` maps the tensors instead of reading them (for a look at the other fields)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(str(path), "checkpoint not found", "the path of a .ckpt file")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as ex:
        reason = first_line(ex) or type(ex).__name__
        raise UserError(str(path), f"refused: its pickle asks for more than tensors and plain data ({reason[:200]})",
                        "a checkpoint of tensors and plain containers, as this framework writes them") from None
    except (EOFError, zipfile.BadZipFile, RuntimeError) as ex:
        raise UserError(str(path), f"not a readable checkpoint (truncated or not written by torch.save): "
                        f"{first_line(ex, 200) or type(ex).__name__}",
                        "a complete .ckpt file") from None
    if not isinstance(checkpoint, dict):
        raise UserError(str(path), f"holds a {type(checkpoint).__name__}, not a checkpoint dictionary",
                        "a .ckpt file written by this framework")
    if isinstance(checkpoint.get("state_dict"), Mapping):
        checkpoint["state_dict"] = clean_state_dict(checkpoint["state_dict"])
    return checkpoint


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint reader and writer, made atomic, weights-only and prefix-free.
    Replaces `TorchCheckpointIO` deliberately (see the module docstring): every checkpoint the
    Trainer writes or reads, `last.ckpt`, the best ones and `ckpt_path=` loads, goes through here."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("SafeCheckpointIO takes no storage_options")
        if isinstance(checkpoint.get("state_dict"), Mapping):
            checkpoint = {**checkpoint, "state_dict": clean_state_dict(checkpoint["state_dict"])}
        replace_atomic(Path(path), lambda tmp: torch.save(checkpoint, tmp))

    def load_checkpoint(self, path: Any, map_location: Optional[Callable[..., Any]] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if weights_only is False:
            raise UserError(str(path), "asked to load with weights_only=False", "weights-only loading")
        return load_checkpoint(path, map_location if map_location is not None else "cpu")


def write_safetensors(weights: Mapping[str, torch.Tensor], out: Path, metadata: dict[str, str]) -> None:
    """`weights` as a safetensors file, atomically. Tensors that share memory (a language model's
    tied embedding and output head) are stored once, under the first name; the metadata's "tied"
    maps each other name to it (safetensors refuses shared tensors; loading with
    `load_state_dict(strict=False)` and re-tying is what transformers' `tie_weights` does too)."""
    kept: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    first_of: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name, tensor in weights.items():
        tensor = tensor.detach().contiguous().cpu()
        key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tuple(tensor.shape))
        if key in first_of:
            tied[name] = first_of[key]
            continue
        first_of[key] = name
        kept[name] = tensor
    if tied:
        metadata = {**metadata, "tied": json.dumps(tied)}
    replace_atomic(out, lambda tmp: save_file(kept, str(tmp), metadata=metadata))


def export_safetensors(checkpoint_path: str | Path, out: str | Path, prefix: str = "net.") -> Path:
    """The model's weights from a training checkpoint as a safetensors file (`prefix` stripped, so
    the keys are the network's own); returns the written path."""
    checkpoint = load_checkpoint(checkpoint_path)
    state = checkpoint.get("state_dict")
    if not isinstance(state, Mapping) or not state:
        raise UserError(str(checkpoint_path), "has no state_dict", "a training checkpoint (.ckpt)")
    weights = {k[len(prefix):] if k.startswith(prefix) else k: v
               for k, v in state.items() if isinstance(v, torch.Tensor)}
    out = Path(out)
    write_safetensors(weights, out, {"source": str(checkpoint_path), "global_step": str(checkpoint.get("global_step", ""))})
    return out


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m trainer.groups.checkpointing export CKPT OUT.safetensors``"""
    parser = argparse.ArgumentParser(prog="python -m trainer.groups.checkpointing")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="write a checkpoint's model weights as safetensors")
    export.add_argument("checkpoint", type=Path)
    export.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    with one_line_on_user_error():
        written = export_safetensors(args.checkpoint, args.out)
    print(f"wrote {written}")


if __name__ == "__main__":
    main()


GROUP = ConfigGroup("checkpointing", __name__, "last and best checkpoints, periodic ones inside epochs",
                    lambda values: check_keys("checkpointing", values, CheckpointingConfig),
                    keys=CheckpointingConfig)
