"""torchvision's ResNets, randomly initialised, fitted to the data's channels and image size."""

from __future__ import annotations

from typing import Annotated, Literal, Sequence

import torchvision
from torch import nn

from trainer.infra.schema import Doc

Stem = Literal["auto", "imagenet", "small"]


def build_resnet(
    num_classes: int,
    arch: Annotated[Literal["resnet18", "resnet34", "resnet50", "resnet101"], Doc("torchvision architecture "
                                                                                  "(no pretrained weights)")] = "resnet50",
    in_channels: int = 3,
    image_size: Sequence[int] = (224, 224),
    stem: Annotated[Stem, Doc("imagenet: 7x7 conv and max-pool; small: one 3x3 conv; auto: small at 64 px or "
                              "less")] = "auto",
    zero_init_residual: Annotated[bool, Doc("start each residual branch at zero (Goyal et al. 2017)")] = True,
) -> nn.Module:
    """A torchvision ResNet (no pretrained weights: nothing is downloaded). The ``small`` stem (3x3,
    stride 1, no pool) is the usual choice for 32x32 images; a zero-initialised residual branch helps
    large-batch training."""
    net = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes,
                                             zero_init_residual=zero_init_residual)
    small = stem == "small" or (stem == "auto" and max(image_size) <= 64)
    if small:
        net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    elif in_channels != 3:
        net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    if small or in_channels != 3:
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    return net
