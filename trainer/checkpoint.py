"""The `checkpointing` group: the last checkpoint and the best by a validation metric."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint

from trainer.config import CheckpointingConfig


def build_checkpointing(cfg: CheckpointingConfig, run_dir: Path) -> ModelCheckpoint | None:
    if not cfg.enabled:
        return None
    return ModelCheckpoint(
        dirpath=run_dir / "checkpoints",
        # The metric's name has a "/" in it; keep it out of the file name.
        filename="epoch{epoch:03d}-step{step:06d}",
        auto_insert_metric_name=False,
        monitor=cfg.monitor,
        mode=cfg.mode,
        save_last=cfg.save_last,
        save_top_k=cfg.save_top_k,
        every_n_epochs=cfg.every_n_epochs,
    )
