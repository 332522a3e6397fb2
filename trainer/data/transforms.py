"""Batched augmentation and normalization on the device, after the host-to-device copy.

Whole-batch tensor ops: one kernel per batch instead of a Python call per image in a worker."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


def normalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 (0..255) or float (0..1) NCHW images to float32, standardized per channel."""
    x = images.float()
    if images.dtype == torch.uint8:
        x = x / 255.0
    m = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return (x - m) / s


def random_flip(images: torch.Tensor) -> torch.Tensor:
    """Flip each image left-right with probability one half."""
    flip = torch.rand(images.shape[0], device=images.device) < 0.5
    return torch.where(flip.view(-1, 1, 1, 1), images.flip(-1), images)


def random_translate(images: torch.Tensor, pad: int) -> torch.Tensor:
    """Shift each image by up to `pad` pixels in each direction, filling with zeros.
    The same as padding then a random crop of the original size (the CIFAR recipe)."""
    if pad <= 0:
        return images
    n, _, h, w = images.shape
    padded = F.pad(images, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (n,), device=images.device)
    dx = torch.randint(0, 2 * pad + 1, (n,), device=images.device)
    rows = (dy.view(n, 1) + torch.arange(h, device=images.device).view(1, h)).view(n, 1, h, 1)
    cols = (dx.view(n, 1) + torch.arange(w, device=images.device).view(1, w)).view(n, 1, 1, w)
    batch = torch.arange(n, device=images.device).view(n, 1, 1, 1)
    channels = torch.arange(images.shape[1], device=images.device).view(1, -1, 1, 1)
    return padded[batch, channels, rows, cols]
