"""Small reusable layers."""

from __future__ import annotations

from typing import Callable, cast

import torch
from torch import nn


class ConvBNAct(nn.Sequential):
    """Convolution without bias, BatchNorm, activation: the BN shift replaces the conv bias."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, stride: int = 1, groups: int = 1,
                 activation: Callable[[], nn.Module] = lambda: nn.ReLU(inplace=True)) -> None:
        super().__init__(nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding=kernel_size // 2,
                                   groups=groups, bias=False),
                         nn.BatchNorm2d(out_channels), activation())
        self.in_channels, self.out_channels = in_channels, out_channels

    @property
    def conv(self) -> nn.Conv2d:
        return cast(nn.Conv2d, self[0])  # as made in __init__; Sequential's items are typed Module


class ClassifierHead(nn.Sequential):
    """Global average pool, dropout, linear."""

    def __init__(self, in_features: int, num_classes: int, dropout: float = 0.0) -> None:
        super().__init__(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Dropout(dropout) if dropout > 0 else nn.Identity(),
                         nn.Linear(in_features, num_classes))


class GeluMLP(nn.Module):
    """A Transformer block's feed-forward: Linear, GELU, Linear, dropout. BERT was trained with the
    exact GELU, GPT-2 with its tanh approximation (`approximate="tanh"`)."""

    def __init__(self, width: int, hidden: int, dropout: float, approximate: str = "none") -> None:
        super().__init__()
        self.fc = nn.Linear(width, hidden)
        self.act = nn.GELU(approximate=approximate)
        self.proj = nn.Linear(hidden, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


def init_weights(module: nn.Module) -> None:
    """He init for convs (ReLU nets; zero biases), unit/zero BatchNorm, small normal for the classifier."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.01)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


__all__ = ["ConvBNAct", "ClassifierHead", "GeluMLP", "init_weights", "count_parameters"]
