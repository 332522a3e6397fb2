"""Batch-size scaling rules for the learning rate and the weight decay (pure functions).

Hyper-parameters are given at a reference global batch (`ref_batch_size`, 256 by default) and
moved to the run's global batch B = per-device batch x devices x nodes x accumulation:

- lr ``sqrt`` (default): lr * (B/ref)^0.5, timm's choice for Adam-family optimizers;
  ``linear``: lr * B/ref (Goyal et al. 2017, with warmup; timm's choice for SGD); ``none``.
- weight decay ``linear`` (default): wd * B/ref; ``sqrt``: wd * (B/ref)^0.5 (keeps lr*wd
  proportional to B together with sqrt lr, as Wang & Aitchison 2024 suggest); ``none``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Rule = Literal["sqrt", "linear", "none"]
RULES: tuple[str, ...] = ("sqrt", "linear", "none")


def scale_factor(rule: str, global_batch: int, ref_batch: int) -> float:
    if global_batch < 1 or ref_batch < 1:
        raise ValueError(f"batch sizes must be positive, got {global_batch} and {ref_batch}")
    ratio = global_batch / ref_batch
    if rule == "sqrt":
        return math.sqrt(ratio)
    if rule == "linear":
        return ratio
    if rule == "none":
        return 1.0
    raise ValueError(f"unknown scaling rule {rule!r}; allowed: {', '.join(RULES)}")


@dataclass(frozen=True)
class Scaled:
    value: float
    how: str


def scale(name: str, value: float, rule: str, global_batch: int, ref_batch: int) -> Scaled:
    """`value` given at `ref_batch`, moved to `global_batch` by `rule`, with its derivation."""
    factor = scale_factor(rule, global_batch, ref_batch)
    scaled = value * factor
    if rule == "none":
        return Scaled(scaled, f"{name} {value:g} as configured (no batch scaling; rule none)")
    return Scaled(scaled, f"{name} {value:g} at batch {ref_batch} -> {scaled:.6g} at batch {global_batch} "
                          f"({rule} rule, x{factor:.4g})")
