"""The default network: a few Conv-BN-ReLU stages, sized for small images (8x8 to 64x64)."""

from __future__ import annotations

from typing import Annotated, Sequence

import torch
from torch import nn

from trainer.models.layers import ClassifierHead, ConvBNAct, init_weights
from trainer.schema import AT_LEAST_ONE, Doc, Range


class SmallCNN(nn.Module):
    """Stages of two Conv-BN-ReLU blocks; every stage after the first halves the resolution.

    `widths` gives each stage's channel count. The input may be any size from 4x4 up: the head
    pools globally.
    """

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        widths: Annotated[Sequence[Annotated[int, AT_LEAST_ONE]],
                          Doc("channels of each stage of two Conv-BN-ReLU blocks")] = (32, 64, 128),
        dropout: Annotated[float, Range(ge=0, lt=1), Doc("dropout before the classifier")] = 0.1,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for stage, width in enumerate(widths):
            if stage > 0:
                layers.append(nn.MaxPool2d(2, ceil_mode=True))
            layers += [ConvBNAct(channels, width), ConvBNAct(width, width)]
            channels = width
        self.features = nn.Sequential(*layers)
        self.head = ClassifierHead(channels, num_classes, dropout)
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
