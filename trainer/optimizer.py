"""The `optimizer` group: parameter groups, kernel choice and the torch optimizer."""

from __future__ import annotations

from typing import Any, Union

import torch
from torch import nn

from trainer.config import AdamWConfig, SGDConfig

OptimizerConfig = Union[SGDConfig, AdamWConfig]


# Prefixes that wrappers put into parameter names (FSDP, activation checkpointing, torch.compile).
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def plain_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def one_dimensional(module: nn.Module) -> frozenset[str]:
    """Names of the 1-D parameters (norm weights, biases), read before any wrapper changes shapes."""
    return frozenset(plain_name(name) for name, param in module.named_parameters() if param.ndim <= 1)


def parameter_groups(module: nn.Module, weight_decay: float, decay_norm_and_bias: bool,
                     no_decay_names: frozenset[str] | None = None) -> list[dict[str, Any]]:
    """Two groups: weights that decay, and 1-D parameters (norm weights, biases) that do not.

    `no_decay_names` (from `one_dimensional` on the unwrapped module) decides by name instead of
    by shape: FSDP shards every parameter into a flat 1-D piece before the optimizer is built, so
    a shape test there would exempt every weight from decay.
    """
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        flat = plain_name(name) in no_decay_names if no_decay_names is not None else param.ndim <= 1
        (no_decay if flat and not decay_norm_and_bias else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def fused_supported(device_type: str) -> bool:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return device_type in _get_fused_kernels_supported_devices()
    except ImportError:  # older or newer torch without the helper: only claim CUDA
        return device_type == "cuda"


def choose_implementation(requested: str, device_type: str, grad_scaler: bool) -> tuple[str, str]:
    """The optimizer kernel to use and why.

    Fused kernels (one kernel for the whole update) on CUDA where this torch has them; foreach
    (batched per-tensor ops) otherwise, CPU included, where fused measured no faster. With an fp16 GradScaler the default stays foreach:
    a fused step takes over unscaling, so gradient clipping would see scaled gradients, and fused
    SGD has been reported to advance momentum on steps the scaler skips.
    """
    if requested != "auto":
        if requested == "fused" and not fused_supported(device_type):
            return "foreach", f"fused -> foreach (no fused kernels for {device_type} in torch {torch.__version__})"
        return requested, f"{requested} (as configured)"
    if grad_scaler:
        return "foreach", "auto -> foreach (fp16 GradScaler: fused steps unscale on their own; see trainer/optimizer.py)"
    if device_type != "cuda":
        # torch has fused CPU kernels, but on the 2-core CPU of the README they were no faster than
        # foreach (0.88x and 0.99x in two sessions of benchmarks/practices.py): the default follows.
        return "foreach", f"auto -> foreach (fused kernels measured no faster than foreach on {device_type})"
    if fused_supported(device_type):
        return "fused", f"auto -> fused (torch {torch.__version__} has fused kernels for {device_type})"
    return "foreach", f"auto -> foreach (no fused kernels for {device_type})"


def build_optimizer(module: nn.Module, cfg: OptimizerConfig, lr: float, weight_decay: float,
                    implementation: str = "foreach",
                    no_decay_names: frozenset[str] | None = None) -> torch.optim.Optimizer:
    """`lr` and `weight_decay` are the effective values the run resolved (after batch scaling)."""
    groups = parameter_groups(module, weight_decay, cfg.decay_norm_and_bias, no_decay_names)
    kernel = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[implementation]
    if isinstance(cfg, SGDConfig):
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **kernel)
    return torch.optim.AdamW(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, **kernel)
