"""What the measurement modes share: the run's spec shortened to a measurement, and the random
batches and optimizer that the memory measurements step."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import torch

from trainer.phases.build import Parts, device_of
from trainer.configuration.spec import RunSpec
from trainer.phases.plan import Plan


def measuring(spec: RunSpec, plan: Plan, steps: int) -> tuple[RunSpec, Plan]:
    """The run's spec and plan for a measurement of `steps` training steps: the real loop and
    callbacks, no validation, checkpoints, loggers or progress output."""
    spec = dataclasses.replace(
        spec, checkpointing=dataclasses.replace(spec.checkpointing, enabled=False), loggers={},
        top=dataclasses.replace(spec.top, progress="off"),
        trainer={**spec.trainer, "max_steps": steps, "max_epochs": -1, "limit_val_batches": 0,
                 "num_sanity_val_steps": 0, "limit_train_batches": None})
    return spec, dataclasses.replace(plan, progress="off")


class MemoryInputs(NamedTuple):
    device: torch.device
    make_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    optimizer_for: Callable[[str], Callable[[torch.nn.Module], Any]]


def memory_inputs(plan: Plan, parts: Parts) -> MemoryInputs:
    """What the memory measurements run: random batches of the data's shape on the run's device (in
    its memory format) and the run's optimizer (the plan's recipe, with the kernel asked for); the
    loss is the task's (`classification_loss`)."""
    device = device_of(plan)
    info = parts.info
    memory_format = torch.channels_last if plan.channels_last else torch.contiguous_format

    def make_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randn(size, info.in_channels, *info.image_size, device=device)
        labels = torch.randint(0, info.num_classes, (size,), device=device)
        return images.contiguous(memory_format=memory_format), labels

    def optimizer_for(implementation: str) -> Callable[[torch.nn.Module], Any]:
        return lambda net: plan.optimizer.build(net, implementation)

    return MemoryInputs(device, make_batch, optimizer_for)
