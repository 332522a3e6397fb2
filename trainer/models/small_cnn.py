"""The default network: a few Conv-BN-ReLU stages, sized for small images (8x8 to 64x64).

`norm=none` drops the BatchNorm layers (the convolutions get their bias back): a plain deep
network, the fragile setting of the clipping study (benchmarks/clipping_study.py)."""

from __future__ import annotations

from typing import Annotated, Literal, Sequence

import torch
from torch import nn

from trainer.infra.schema import AT_LEAST_ONE, Doc, Range
from trainer.models.layers import ClassifierHead, ConvBNAct, init_weights


class SmallCNN(nn.Module):
    """Stages of two Conv-BN-ReLU blocks; every stage after the first halves the resolution.
    `widths` gives each stage's channel count. The input may be any size from 4x4 up: the head
    pools globally."""

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        widths: Annotated[Sequence[Annotated[int, AT_LEAST_ONE]],
                          Doc("channels of each stage of two Conv-BN-ReLU blocks")] = (32, 64, 128),
        dropout: Annotated[float, Range(ge=0, lt=1), Doc("dropout before the classifier")] = 0.1,
        norm: Annotated[Literal["batch", "none"], Doc("batch: Conv-BN-ReLU; none: Conv(bias)-ReLU, no normalization")]
        = "batch",
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for stage, width in enumerate(widths):
            if stage > 0:
                layers.append(nn.MaxPool2d(2, ceil_mode=True))
            layers += [_block(channels, width, norm), _block(width, width, norm)]
            channels = width
        self.features = nn.Sequential(*layers)
        self.head = ClassifierHead(channels, num_classes, dropout)
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _block(in_channels: int, out_channels: int, norm: str) -> nn.Module:
    if norm == "batch":
        return ConvBNAct(in_channels, out_channels)
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 3, padding=1), nn.ReLU(inplace=True))
