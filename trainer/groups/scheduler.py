"""The `scheduler` group: the lr schedule a choice names (`_target_`: a function or class taking the
optimizer, and `total_steps` where it needs the run's length), stepped every optimizer step or
every epoch (`interval`). torch's schedulers are choices as they are (conf/scheduler/step.yaml is
torch's StepLR); warmup-cosine, constant and one-cycle are here. The run's length is Lightning's
`estimated_stepping_batches`, counted once fit has set up the loaders.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Annotated, Any, Literal, Mapping, Optional, Union

import torch

from trainer.groups.optimizer.schema import OptimizerConfig
from trainer.infra.errors import UserError
from trainer.infra.schema import (FRACTION, NON_NEGATIVE, ConfigGroup, Doc, Range, UnitInterval, check_keys,
                                  check_target, locate_target, schema_of_dataclass)

#: What the framework passes every schedule: the optimizer, and the run's optimizer steps where asked.
INJECTED = ("optimizer", "total_steps")


@dataclass
class SchedulerKeys:
    name: Annotated[str, Doc("the schedule's name in records")]
    interval: Annotated[Literal["step", "epoch"], Doc("step: the schedule advances every optimizer step; epoch: "
                                                      "every epoch")]


@dataclass
class SchedulerConfig(SchedulerKeys):
    target: str = ""
    arguments: Mapping[str, Any] = field(default_factory=dict)


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int,
                  warmup: Annotated[Union[Annotated[int, NON_NEGATIVE], UnitInterval],
                                    Doc("warmup steps (an integer) or fraction of all steps (a float < 1)")],
                  min_lr_ratio: Annotated[float, FRACTION, Doc("the lr the cosine ends at, as a fraction of the "
                                                               "peak lr")]) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup from 0, then cosine decay to ``min_lr_ratio * lr``."""
    steps = warmup_steps(warmup, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine_factor(step, steps, total_steps, min_lr_ratio))


def warmup_steps(warmup: Union[int, float], total_steps: int) -> int:
    if isinstance(warmup, float):
        return int(round(warmup * total_steps))
    return min(warmup, max(total_steps - 1, 0))


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


def constant(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """Every lr stays as derived. A schedule all the same: without one, Lightning's LearningRateMonitor
    names the lr curves after the optimizer (``lr-AdamW/pg1``), so runs with another schedule could
    not be compared."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, unchanged)


class OneCycle(torch.optim.lr_scheduler.OneCycleLR):
    """torch's OneCycleLR, whose length is always this run's: a checkpoint restores where the cycle
    is (its step, and the lrs and momenta in the optimizer's groups) but not how many steps it spans.
    A run resumed with more epochs than it was started with would otherwise step past the saved
    length and fail; this way it stretches the cycle to the new end, as warmup_cosine does."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        length = {"total_steps": self.total_steps, "_schedule_phases": self._schedule_phases}
        super().load_state_dict(state_dict)
        self.__dict__.update(length)


def one_cycle(optimizer: torch.optim.Optimizer, total_steps: int,
              pct_start: Annotated[float, Range(gt=0, lt=1), Doc("share of the steps over which the lr rises to its "
                                                                  "peak")],
              div_factor: Annotated[float, Range(ge=1), Doc("the first lr is the peak lr / div_factor")],
              final_div_factor: Annotated[float, Range(ge=1), Doc("the last lr is the first lr / final_div_factor")],
              anneal_strategy: Annotated[Literal["cos", "linear"], Doc("the shape of each rise and fall")],
              three_phase: Annotated[bool, Doc("false: rise, then anneal to the last lr; true: rise, fall back to "
                                               "the first lr as long, then anneal (fastai's is false)")],
              cycle_momentum: Annotated[bool, Doc("move momentum (beta1 for AdamW and LAMB) inversely to the lr, "
                                                  "replacing the optimizer's own")],
              base_momentum: Annotated[UnitInterval, Doc("cycle_momentum: the momentum at the peak lr")],
              max_momentum: Annotated[UnitInterval, Doc("cycle_momentum: the momentum at the first and last lr")]
              ) -> OneCycle:
    """The one-cycle policy (Smith 2018; fastai's fit_one_cycle), torch's OneCycleLR over the run's
    optimizer steps: from lr/div_factor up to each parameter group's derived lr (groups under
    layer-wise lr decay peak at their own), then annealed far below it, with momentum (beta1 for
    Adam-family optimizers) moving the other way."""
    if cycle_momentum and not {"momentum", "betas"} & set(optimizer.defaults):
        raise UserError("scheduler.cycle_momentum", f"{type(optimizer).__name__} has neither momentum nor betas to "
                        "cycle", "scheduler.cycle_momentum=false with this optimizer")
    peaks = [float(group["lr"]) for group in optimizer.param_groups]
    return OneCycle(optimizer, max_lr=peaks, total_steps=max(1, total_steps), pct_start=float(pct_start),
                    anneal_strategy=anneal_strategy, cycle_momentum=cycle_momentum, base_momentum=base_momentum,
                    max_momentum=max_momentum, div_factor=float(div_factor), final_div_factor=float(final_div_factor),
                    three_phase=three_phase)


def _check_one_cycle(arguments: Mapping[str, Any]) -> None:
    if arguments.get("three_phase") and arguments.get("pct_start", 0) >= 0.5:
        raise UserError("scheduler.pct_start", f"{arguments['pct_start']:g} leaves no steps for the third phase "
                        "(three_phase rises and falls back over 2 x pct_start of the steps)",
                        "a pct_start below 0.5 with three_phase=true")
    if arguments.get("cycle_momentum") and arguments.get("base_momentum", 0) > arguments.get("max_momentum", 1):
        raise UserError("scheduler.base_momentum", f"{arguments['base_momentum']:g} is above max_momentum "
                        f"{arguments['max_momentum']:g}", "base_momentum <= max_momentum (e.g. 0.85 and 0.95)")


def describe_one_cycle(cfg: SchedulerConfig, peak_lr: float, total_steps: Optional[int],
                       optimizer: OptimizerConfig) -> str:
    """The schedule in one line: ``lr 8e-05 -> peak 0.002 at 25% of 300 steps -> 8e-09 (cos)``, and
    the momentum (beta1 for AdamW and LAMB) moving the other way in place of the optimizer's own."""
    a = cfg.arguments
    first = peak_lr / a["div_factor"]
    steps = f"{total_steps:,} steps" if total_steps is not None else "the run's steps"
    shape = f"lr {first:.3g} -> peak {peak_lr:.3g} at {a['pct_start'] * 100:.3g}% of {steps} -> "
    if a["three_phase"]:
        shape += f"{first:.3g} at {2 * a['pct_start'] * 100:.3g}% -> "
    shape += f"{first / a['final_div_factor']:.3g} ({a['anneal_strategy']})"
    betas, momentum = optimizer.argument("betas"), optimizer.argument("momentum")
    name, configured = ("beta1", betas[0]) if betas is not None else ("momentum", momentum)
    if configured is None:
        return f"{shape}; {optimizer.name} has no momentum"
    if not a["cycle_momentum"]:
        return f"{shape}; {name} {configured:g} as configured"
    return (f"{shape}; {name} {a['max_momentum']:g} -> {a['base_momentum']:g} -> {a['max_momentum']:g} "
            f"(in place of {configured:g})")


#: The schedules with rules beyond their signature (key: the `_target_`'s import path), and how
#: the start-up lines and the fit's first line describe them; others are described by their config.
CHECKS = MappingProxyType({f"{__name__}.one_cycle": _check_one_cycle})
DESCRIBED = MappingProxyType({f"{__name__}.one_cycle": describe_one_cycle})


def describe(cfg: SchedulerConfig, peak_lr: float, total_steps: Optional[int], optimizer: OptimizerConfig) -> str:
    describe_target = DESCRIBED.get(cfg.target)
    if describe_target is not None:
        return describe_target(cfg, peak_lr, total_steps, optimizer)
    arguments = ", ".join(f"{key}={value}" for key, value in cfg.arguments.items())
    steps = f" over {total_steps:,} optimizer steps" if total_steps is not None else ""
    return f"{cfg.target.rsplit('.', 1)[-1]}({arguments}), per {cfg.interval}{steps}"


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, total_steps: int) -> dict[str, Any]:
    """A Lightning ``lr_scheduler`` dict: the choice's schedule over `optimizer`, stepped per `interval`."""
    factory = locate_target("scheduler", cfg.target)
    injected = {"total_steps": total_steps} if "total_steps" in inspect.signature(factory).parameters else {}
    return {"scheduler": factory(optimizer, **injected, **cfg.arguments), "interval": cfg.interval}


def validate(values: dict[str, Any]) -> SchedulerConfig:
    keys = schema_of_dataclass(SchedulerKeys)
    own = check_keys("scheduler", {k: v for k, v in values.items() if k in keys.fields}, SchedulerKeys)
    checked = check_target("scheduler", values, skip=INJECTED, also=keys)
    arguments = {k: v for k, v in checked.items() if k not in keys.fields and not (k.startswith("_") and k.endswith("_"))}
    target = locate_target("scheduler", checked["_target_"])
    path = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '')}"
    if path in CHECKS:
        CHECKS[path](arguments)
    return SchedulerConfig(**vars(own), target=path, arguments=arguments)


GROUP = ConfigGroup("scheduler", __name__, "the learning-rate schedule", validate, keys=SchedulerKeys, target=True)
