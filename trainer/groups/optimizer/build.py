"""The run's optimizer: the kernel it runs, and `OptimizerRecipe`, the one way a run makes it.

Training, the diagnosis, the memory plan and the batch and lr finders all build from the recipe the
plan holds (or the probe's, before there is a plan), so what is measured is what trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch
from torch import nn

from trainer.groups.optimizer.parameters import layer_lr_scales, one_dimensional, parameter_groups
from trainer.groups.optimizer.registry import kernel_arguments, kernels, locate_optimizer, row_of
from trainer.groups.optimizer.schema import OptimizerConfig


def fused_supported(device_type: str) -> bool:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return device_type in _get_fused_kernels_supported_devices()
    except ImportError:  # older or newer torch without the helper: only claim CUDA
        return device_type == "cuda"


def choose_implementation(requested: str, device_type: str, grad_scaler: bool, cfg: OptimizerConfig) -> tuple[str, str]:
    """The optimizer kernel to use and why.

    Fused kernels (one kernel for the whole update) wherever this torch and the class have them,
    the CPU included (torch's fused Adam, AdamW, SGD and Adagrad: on one CPU core the step alone
    measured 2.5x to 5.7x faster than foreach for AdamW and SGD, from 8 tensors to ResNet-50's,
    benchmarks/results/optimizer_kernels_cpu.md; and a fused step takes the non-finite guard's skip
    as `found_inf`, where a foreach one has to be put back); foreach (batched per-tensor ops)
    otherwise. With an fp16 GradScaler the default stays foreach: a fused step takes over unscaling,
    so gradient clipping would see scaled gradients, and fused SGD has been reported to advance
    momentum on steps the scaler skips. A class without a kernel asked for runs its plain loop.
    """
    offered = kernels(locate_optimizer(cfg.target))
    if requested in ("auto", "fused") and "fused" not in offered:
        fallback = "foreach" if "foreach" in offered else "for_loop"
        return fallback, f"{requested} -> {fallback} ({cfg.name} has no fused kernel)"
    if requested == "foreach" and "foreach" not in offered:
        return "for_loop", f"foreach -> for_loop ({cfg.name} has no foreach kernel)"
    if requested != "auto":
        if requested == "fused" and not fused_supported(device_type):
            return "foreach", f"fused -> foreach (no fused kernels for {device_type} in torch {torch.__version__})"
        return requested, f"{requested} (as configured)"
    if grad_scaler:
        return "foreach", "auto -> foreach (fp16 GradScaler: fused steps unscale on their own; see trainer/groups/optimizer/build.py)"
    if fused_supported(device_type):
        return "fused", f"auto -> fused (torch {torch.__version__} has fused kernels for {device_type})"
    return "foreach", f"auto -> foreach (no fused kernels for {device_type})"


@dataclass(frozen=True)
class OptimizerRecipe:
    """Everything that makes the run's optimizer, decided once on the plain network (before any
    wrapper renames or flattens its parameters): the config, the effective lr and weight decay, the
    kernel, the parameters exempt from decay and each parameter's lr scale (layer-wise decay)."""

    cfg: OptimizerConfig
    lr: float
    weight_decay: float
    implementation: str
    no_decay_names: frozenset[str]
    lr_scales: Mapping[str, float] | None = None

    @classmethod
    def for_network(cls, net: nn.Module, cfg: OptimizerConfig, lr: float, weight_decay: float,
                    implementation: str = "foreach") -> OptimizerRecipe:
        scales = layer_lr_scales(net, cfg.layer_decay) if cfg.layer_decay else None
        return cls(cfg, lr, weight_decay, implementation, one_dimensional(net),
                   MappingProxyType(scales) if scales is not None else None)

    def build(self, module: nn.Module, implementation: str | None = None) -> torch.optim.Optimizer:
        """The optimizer over `module` (the network, or a module holding it under any wrapper);
        `implementation` only where a measurement compares kernels. A group with an ``lr_scale``
        starts at ``lr x lr_scale``; the schedule then multiplies each group's own starting lr."""
        groups = parameter_groups(module, self.weight_decay, self.cfg.decay_norm_and_bias, self.no_decay_names,
                                  self.lr_scales)
        for group in groups:
            if "lr_scale" in group:
                group["lr"] = self.lr * group["lr_scale"]
        optimizer_class = locate_optimizer(self.cfg.target)
        row = row_of(self.cfg.target)
        return optimizer_class(groups, lr=self.lr, **kernel_arguments(implementation or self.implementation,
                                                                       optimizer_class),
                               **(row.fixed if row else {}), **self.cfg.arguments)
