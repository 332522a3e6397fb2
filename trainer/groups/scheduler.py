"""The `scheduler` group: learning-rate schedules as Lightning scheduler configs."""

from __future__ import annotations

import math
from typing import Any, Union

import torch

from trainer.configuration.spec import ConstantConfig, StepConfig, WarmupCosineConfig

SchedulerConfig = Union[WarmupCosineConfig, ConstantConfig, StepConfig]


def warmup_steps(cfg: WarmupCosineConfig, total_steps: int) -> int:
    if isinstance(cfg.warmup, float):
        return int(round(cfg.warmup * total_steps))
    return min(cfg.warmup, max(total_steps - 1, 0))


def warmup_cosine_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    decay_steps = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def unchanged(step: int) -> float:
    """The constant schedule's factor (a module-level function: a checkpoint stores no lambda)."""
    return 1.0


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, total_steps: int) -> dict[str, Any]:
    """A Lightning ``lr_scheduler`` dict. The constant lr gets one too, a schedule that keeps every
    lr as derived: without a scheduler, Lightning's LearningRateMonitor names the lr curves after
    the optimizer (``lr-AdamW/pg1``), so runs with another scheduler could not be compared."""
    if isinstance(cfg, ConstantConfig):
        return {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, unchanged), "interval": "step"}
    if isinstance(cfg, StepConfig):
        return {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, cfg.step_size, cfg.gamma), "interval": "epoch"}
    warmup = warmup_steps(cfg, total_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine_factor(step, warmup, total_steps, cfg.min_lr_ratio))
    return {"scheduler": schedule, "interval": "step"}
