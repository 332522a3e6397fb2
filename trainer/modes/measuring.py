"""What the memory measurements share: random batches of the data's shape on the device, and the
run's optimizer recipe with the kernel asked for."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import torch

from trainer.groups.optimizer.build import OptimizerRecipe
from trainer.tasks.protocol import TaskDefinition


class MemoryInputs(NamedTuple):
    device: torch.device
    make_batch: Callable[[int], tuple[Any, Any]]
    optimizer_for: Callable[[str], Callable[[torch.nn.Module], Any]]
    #: The task's training loss of (outputs, targets).
    loss: Callable[[Any, Any], torch.Tensor]


def memory_inputs(device: torch.device, channels_last: bool, recipe: OptimizerRecipe,
                  definition: TaskDefinition) -> MemoryInputs:
    """What the memory measurements run: the task's random batches of the data's shape on `device`
    (images in the run's memory format), the run's optimizer (its recipe, with the kernel asked
    for) and the task's training loss."""
    def make_batch(size: int) -> tuple[Any, Any]:
        inputs, targets = definition.example_batch(size, device)
        if channels_last and isinstance(inputs, torch.Tensor) and inputs.ndim == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return inputs, targets

    def optimizer_for(implementation: str) -> Callable[[torch.nn.Module], Any]:
        return lambda net: recipe.build(net, implementation)

    return MemoryInputs(device, make_batch, optimizer_for, partial(definition.loss, training=True))
