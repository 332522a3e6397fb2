"""What the memory measurements share: random batches of the data's shape on the device, and the
run's optimizer recipe with the kernel asked for."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from trainer.data.base import DataInfo
from trainer.groups.optimizer.build import OptimizerRecipe


class MemoryInputs(NamedTuple):
    device: torch.device
    make_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    optimizer_for: Callable[[str], Callable[[torch.nn.Module], Any]]


def memory_inputs(device: torch.device, channels_last: bool, recipe: OptimizerRecipe, info: DataInfo) -> MemoryInputs:
    """What the memory measurements run: random batches of the data's shape on `device` (in the
    run's memory format) and the run's optimizer (its recipe, with the kernel asked for); the loss
    is the task's (`classification_loss`)."""
    memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def make_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randn(size, info.in_channels, *info.image_size, device=device)
        labels = torch.randint(0, info.num_classes, (size,), device=device)
        return images.contiguous(memory_format=memory_format), labels

    def optimizer_for(implementation: str) -> Callable[[torch.nn.Module], Any]:
        return lambda net: recipe.build(net, implementation)

    return MemoryInputs(device, make_batch, optimizer_for)
