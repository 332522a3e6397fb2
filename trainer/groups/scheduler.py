"""The `scheduler` group: learning-rate schedules as Lightning scheduler configs."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from trainer.configuration.spec import (
    AdamWConfig,
    ConstantConfig,
    LambConfig,
    OneCycleConfig,
    OptimizerConfig,
    SchedulerConfig,
    StepConfig,
    WarmupCosineConfig,
)
from trainer.infra.errors import UserError

__all__ = ["SchedulerConfig", "build_scheduler", "describe_one_cycle", "planned_optimizer_steps"]


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
    if isinstance(cfg, OneCycleConfig):
        return {"scheduler": one_cycle(optimizer, cfg, total_steps), "interval": "step"}
    warmup = warmup_steps(cfg, total_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine_factor(step, warmup, total_steps, cfg.min_lr_ratio))
    return {"scheduler": schedule, "interval": "step"}


class OneCycle(torch.optim.lr_scheduler.OneCycleLR):
    """torch's OneCycleLR, whose length is always this run's: a checkpoint restores where the cycle
    is (its step, and the lrs and momenta in the optimizer's groups) but not how many steps it spans.
    A run resumed with more epochs than it was started with would otherwise step past the saved
    length and fail; this way it stretches the cycle to the new end, as warmup_cosine does."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        length = {"total_steps": self.total_steps, "_schedule_phases": self._schedule_phases}
        super().load_state_dict(state_dict)
        self.__dict__.update(length)


def one_cycle(optimizer: torch.optim.Optimizer, cfg: OneCycleConfig, total_steps: int) -> OneCycle:
    """The one-cycle schedule over `total_steps` optimizer steps, peaking at each parameter group's
    derived lr (groups under layer-wise lr decay peak at their own)."""
    if cfg.cycle_momentum and not {"momentum", "betas"} & set(optimizer.defaults):
        # The four optimizer choices all have one; this guards an optimizer added later.
        raise UserError("scheduler.cycle_momentum", f"{type(optimizer).__name__} has neither momentum nor betas to "
                        "cycle", "scheduler.cycle_momentum=false with this optimizer")
    peaks = [float(group["lr"]) for group in optimizer.param_groups]
    return OneCycle(optimizer, max_lr=peaks, total_steps=max(1, total_steps), pct_start=float(cfg.pct_start),
                    anneal_strategy=cfg.anneal_strategy, cycle_momentum=cfg.cycle_momentum,
                    base_momentum=cfg.base_momentum, max_momentum=cfg.max_momentum, div_factor=float(cfg.div_factor),
                    final_div_factor=float(cfg.final_div_factor), three_phase=cfg.three_phase)


def describe_one_cycle(cfg: OneCycleConfig, peak_lr: float, total_steps: int | None,
                       optimizer: OptimizerConfig) -> str:
    """The schedule in one line: ``lr 8e-05 -> peak 0.002 at 25% of 300 steps -> 8e-09 (cos)``, and
    the momentum (beta1 for AdamW and LAMB) moving the other way in place of the optimizer's own."""
    first = peak_lr / cfg.div_factor
    steps = f"{total_steps:,} steps" if total_steps is not None else "the run's steps"
    shape = f"lr {first:.3g} -> peak {peak_lr:.3g} at {cfg.pct_start * 100:.3g}% of {steps} -> "
    if cfg.three_phase:
        shape += f"{first:.3g} at {2 * cfg.pct_start * 100:.3g}% -> "
    shape += f"{first / cfg.final_div_factor:.3g} ({cfg.anneal_strategy})"
    name, configured = (("beta1", optimizer.betas[0]) if isinstance(optimizer, (AdamWConfig, LambConfig))
                        else ("momentum", optimizer.momentum))
    if not cfg.cycle_momentum:
        return f"{shape}; {name} {configured:g} as configured"
    return (f"{shape}; {name} {cfg.max_momentum:g} -> {cfg.base_momentum:g} -> {cfg.max_momentum:g} "
            f"(in place of {configured:g})")


def planned_optimizer_steps(trainer_cfg: Mapping[str, Any], train_size: int, processes: int,
                            batch_size: int) -> int | None:
    """The optimizer steps a run will take, counted as Lightning's `estimated_stepping_batches`
    counts them at fit: full batches per process (the training loaders drop the last partial one),
    `limit_train_batches`, accumulation, epochs and `max_steps`; None for a run without an end."""
    batches = train_size // max(1, processes) // max(1, batch_size)
    limit = trainer_cfg.get("limit_train_batches")
    if isinstance(limit, bool) or limit is None:
        pass
    elif isinstance(limit, int):
        batches = min(batches, limit)
    else:
        batches = int(batches * float(limit))
    max_steps = _given_or(trainer_cfg.get("max_steps"), -1)
    # Lightning's defaults: 1000 epochs without max_steps, no epoch limit with it.
    epochs = _given_or(trainer_cfg.get("max_epochs"), 1000 if max_steps == -1 else -1)
    if epochs == -1:
        return max_steps if max_steps != -1 else None
    steps = math.ceil(batches / int(trainer_cfg.get("accumulate_grad_batches") or 1)) * max(epochs, 1)
    return min(steps, max_steps) if max_steps != -1 else steps


def _given_or(value: Any, default: int) -> int:
    return default if value is None else int(value)
