"""The `optimizer` group: parameter groups, kernel choice and the torch optimizer.

`OptimizerRecipe` is the one way a run makes its optimizer: training, the diagnosis and the
memory measurements all build from the recipe the plan holds, so what is measured is what trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import torch
from torch import nn

from trainer.configuration.spec import AdamWConfig, LambConfig, LarsConfig, OptimizerConfig, SGDConfig
from trainer.infra.errors import UserError

#: Optimizers that torch has fused kernels for; LAMB and LARS (timm's) have foreach and for-loop ones.
FUSED_OPTIMIZERS = ("sgd", "adamw")


# Prefixes that wrappers put into parameter names (FSDP, activation checkpointing, torch.compile).
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def plain_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def named_by_model(module: nn.Module) -> frozenset[str]:
    """The parameters a model exempts from weight decay itself, by timm's convention
    `no_weight_decay()` (a ViT's position embedding and class token); names it gives that are not
    parameters of the module are left out."""
    own = getattr(module, "no_weight_decay", None)
    named = {str(n) for n in own()} if callable(own) else set()
    return frozenset(plain_name(name) for name, _ in module.named_parameters() if plain_name(name) in named)


def one_dimensional(module: nn.Module) -> frozenset[str]:
    """Names of the parameters exempt from weight decay, read before any wrapper changes shapes:
    the 1-D ones (norm weights, biases), and those the model names itself (`named_by_model`)."""
    return frozenset(plain_name(name) for name, param in module.named_parameters()
                     if param.ndim <= 1) | named_by_model(module)


def layer_lr_scales(module: nn.Module, layer_decay: float) -> dict[str, float]:
    """Layer-wise lr decay (BEiT, Bao et al. 2021; timm's and MAE's fine-tuning recipes): the lr of
    a parameter `k` layers below the head is multiplied by ``layer_decay ** k``, so the early layers
    of a pretrained network move least. The layers are the model's own `group_matcher` (timm
    models: the stem, each block, the head), as timm's `param_groups_layer_decay` groups them."""
    matcher = getattr(module, "group_matcher", None)
    if not callable(matcher):
        raise UserError("optimizer.layer_decay", f"{type(module).__name__} does not say which layer each parameter "
                        "belongs to (it has no group_matcher)", "a timm model (model=timm), or optimizer.layer_decay=null")
    from timm.models import group_parameters

    layer_of = group_parameters(module, matcher(coarse=False), reverse=True)
    top = max(layer_of.values(), default=0)
    return {plain_name(name): layer_decay ** (top - layer_of.get(name, top)) for name, _ in module.named_parameters()}


def parameter_groups(module: nn.Module, weight_decay: float, decay_norm_and_bias: bool,
                     no_decay_names: frozenset[str] | None = None,
                     lr_scales: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
    """Weights that decay, and 1-D parameters (norm weights, biases) that do not; with `lr_scales`
    (layer-wise lr decay) each of the two is split further by lr scale, and each group carries its
    ``lr_scale``.

    `no_decay_names` (from `one_dimensional` on the unwrapped module) decides by name instead of
    by shape: FSDP shards every parameter into a flat 1-D piece before the optimizer is built, so
    a shape test there would exempt every weight from decay.
    """
    grouped: dict[tuple[bool, float], list[nn.Parameter]] = {}
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        flat = plain_name(name) in no_decay_names if no_decay_names is not None else param.ndim <= 1
        decays = not flat or decay_norm_and_bias
        scale = lr_scales.get(plain_name(name), 1.0) if lr_scales else 1.0
        grouped.setdefault((decays, scale), []).append(param)
    # The decaying weights first, at full lr first: the loggers name the groups in this order.
    keys = sorted(grouped, key=lambda key: (not key[0], -key[1]))
    if not grouped or not keys[0][0]:
        keys.insert(0, (True, 1.0))  # an (empty) decaying group always leads, as before
    groups = []
    for decays, scale in keys:
        group: dict[str, Any] = {"params": grouped.get((decays, scale), []), "weight_decay": weight_decay if decays else 0.0}
        if lr_scales:
            group["lr_scale"] = scale
        groups.append(group)
    return groups


def fused_supported(device_type: str) -> bool:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return device_type in _get_fused_kernels_supported_devices()
    except ImportError:  # older or newer torch without the helper: only claim CUDA
        return device_type == "cuda"


def choose_implementation(requested: str, device_type: str, grad_scaler: bool,
                          optimizer: str = "adamw") -> tuple[str, str]:
    """The optimizer kernel to use and why.

    Fused kernels (one kernel for the whole update) on CUDA where this torch has them; foreach
    (batched per-tensor ops) otherwise, CPU included, where fused measured no faster. With an fp16 GradScaler the default stays foreach:
    a fused step takes over unscaling, so gradient clipping would see scaled gradients, and fused
    SGD has been reported to advance momentum on steps the scaler skips. LAMB and LARS (timm's)
    have no fused kernel: foreach there.
    """
    if requested in ("auto", "fused") and optimizer not in FUSED_OPTIMIZERS:
        return "foreach", f"{requested} -> foreach ({optimizer} has no fused kernel)"
    if requested != "auto":
        if requested == "fused" and not fused_supported(device_type):
            return "foreach", f"fused -> foreach (no fused kernels for {device_type} in torch {torch.__version__})"
        return requested, f"{requested} (as configured)"
    if grad_scaler:
        return "foreach", "auto -> foreach (fp16 GradScaler: fused steps unscale on their own; see trainer/groups/optimizer.py)"
    if device_type != "cuda":
        # torch has fused CPU kernels, but on the 2-core CPU of the README they were no faster than
        # foreach (0.88x and 0.99x in two sessions of benchmarks/practices.py): the default follows.
        return "foreach", f"auto -> foreach (fused kernels measured no faster than foreach on {device_type})"
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
        `implementation` only where a measurement compares kernels."""
        return build_optimizer(module, self.cfg, self.lr, self.weight_decay, implementation or self.implementation,
                               self.no_decay_names, self.lr_scales)


def build_optimizer(module: nn.Module, cfg: OptimizerConfig, lr: float, weight_decay: float,
                    implementation: str = "foreach", no_decay_names: frozenset[str] | None = None,
                    lr_scales: Mapping[str, float] | None = None) -> torch.optim.Optimizer:
    """`lr` and `weight_decay` are the effective values the run resolved (after batch scaling).
    A group with an ``lr_scale`` starts at ``lr x lr_scale``; the schedule then multiplies each
    group's own starting lr."""
    groups = parameter_groups(module, weight_decay, cfg.decay_norm_and_bias, no_decay_names, lr_scales)
    for group in groups:
        if "lr_scale" in group:
            group["lr"] = lr * group["lr_scale"]
    kernel = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[implementation]
    if isinstance(cfg, SGDConfig):
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **kernel)
    if isinstance(cfg, AdamWConfig):
        return torch.optim.AdamW(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, **kernel)
    from timm.optim import Lamb, Lars  # timm's, kept: the large-batch optimizers torch lacks

    foreach = implementation != "for_loop"
    if isinstance(cfg, LambConfig):
        # max_grad_norm=None: timm's LAMB would clip the global gradient norm at 1.0 itself, a
        # second clipping beside the clipping group's, which the run would neither choose nor report.
        return Lamb(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, max_grad_norm=None, foreach=foreach)
    assert isinstance(cfg, LarsConfig), type(cfg)
    return Lars(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, trust_coeff=cfg.trust_coeff,
                foreach=foreach)
