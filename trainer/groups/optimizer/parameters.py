"""The optimizer's parameter groups, decided on the plain network: which parameters are exempt from
weight decay (1-D ones and those the model names), and each one's lr scale under layer-wise decay.

Deliberately not timm's `param_groups_weight_decay` / `param_groups_layer_decay`: they test
`param.ndim <= 1` on the module they are given, and under FSDP the optimizer is built over flat 1-D
shards, where that test exempts every weight (tests/unit/test_library_pins.py pins it). Here the
names are read once on the plain network and the groups are formed by name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any, Callable, Mapping, Sequence

from torch import nn

from trainer.groups.optimizer.schema import OptimizerConfig
from trainer.infra.errors import UserError

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
    of a pretrained network move least. The layers are the model's own `group_matcher` (timm's
    models, model=encoder: the stem, each block, the head), grouped as timm's `group_parameters`
    groups them (`layer_indices`), with or without timm installed."""
    matcher = getattr(module, "group_matcher", None)
    if not callable(matcher):
        raise UserError("optimizer.layer_decay", f"{type(module).__name__} does not say which layer each parameter "
                        "belongs to (it has no group_matcher)", "a model with a group_matcher (model=timm, "
                        "model=encoder), or optimizer.layer_decay=null")
    names = [plain_name(name) for name, _ in module.named_parameters()]
    layer_of = layer_indices(names, matcher(coarse=False))
    top = max(layer_of.values(), default=0)
    return {name: layer_decay ** (top - layer_of[name]) for name in names}


#: timm's marker (`timm.models._manipulate.MATCH_PREV_GROUP`): a regex whose suffix is this puts the
#: parameters it matches into the layer before them (a ViT's final norm, with the last block).
MATCH_PREV_GROUP = 99999.0


def layer_indices(names: Sequence[str], group_matcher: Mapping[str, Any] | Callable[[str], Any]) -> dict[str, int]:
    """Each parameter name's layer, 0 (the stem) upwards, as timm's `group_with_matcher` numbers them
    (the framework's copy, so that layer decay needs no timm; tests/unit/test_encoder.py compares the
    two). A dict matcher maps a group's name to a regex (its capture groups order the layers within
    the group, ``blocks.(\\d+)``) or to a list of (regex, suffix) pairs; a name no regex matches
    belongs to the last layer (the head). A callable matcher returns a name's ordinal itself."""
    if isinstance(group_matcher, Mapping):
        compiled: list[tuple[re.Pattern[str], tuple[float, ...], tuple[float, ...]]] = []
        for ordinal, spec in enumerate(group_matcher.values()):
            if spec is None:
                continue
            pairs = spec if isinstance(spec, (tuple, list)) else [(spec, None)]
            compiled += [(re.compile(pattern), (float(ordinal),), tuple(map(float, suffix or ())))
                         for pattern, suffix in pairs]

        def ordinal_of(name: str) -> tuple[float, ...]:
            for pattern, prefix, suffix in compiled:
                found = pattern.match(name)
                if found:
                    return prefix + tuple(float(g) for g in found.groups() if g is not None) + suffix
            return (math.inf,)
    else:
        def ordinal_of(name: str) -> tuple[float, ...]:
            ordinal = group_matcher(name)
            return tuple(ordinal) if isinstance(ordinal, Iterable) else (ordinal,)

    ordinals = {name: ordinal_of(name) for name in names}
    layer, layer_of_ordinal = -1, {}
    for key in sorted(set(ordinals.values())):
        if layer < 0 or key[-1] != MATCH_PREV_GROUP:
            layer += 1
        layer_of_ordinal[key] = layer
    return {name: layer_of_ordinal[key] for name, key in ordinals.items()}


def parameter_groups(module: nn.Module, weight_decay: float, decay_norm_and_bias: bool,
                     no_decay_names: frozenset[str] | None = None,
                     lr_scales: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
    """Weights that decay, and 1-D parameters (norm weights, biases) that do not; with `lr_scales`
    (layer-wise lr decay) each of the two is split further by lr scale, and each group carries its
    ``lr_scale``. `no_decay_names` (`one_dimensional` of the plain network) decides by name instead
    of by shape (see the module docstring)."""
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


def describe_groups(cfg: OptimizerConfig, net: nn.Module, lr: float, lr_scales: Mapping[str, float] | None
                    ) -> dict[str, tuple[Any, str]]:
    """What the model adds to the optimizer's groups, for the plan's lines: parameters it exempts
    from decay by name, and the layer-wise lr decay ({key: (value, how)})."""
    lines: dict[str, tuple[Any, str]] = {
        "optimizer.decay_norm_and_bias": (cfg.decay_norm_and_bias, "weight decay on every parameter" if
                                          cfg.decay_norm_and_bias else "no weight decay on 1-D parameters "
                                          "(norm weights, biases)")}
    named = sorted(named_by_model(net))
    if named and not cfg.decay_norm_and_bias:
        lines["optimizer.decay_norm_and_bias"] = (
            False, f"no weight decay on 1-D parameters (norm weights, biases) nor on {', '.join(named)} (the model's "
            "no_weight_decay())")
    if cfg.layer_decay and lr_scales:
        layers = len(set(lr_scales.values()))
        lines["optimizer.layer_decay"] = (
            cfg.layer_decay, f"{layers} layers (the model's group_matcher): lr {lr:.3g} at the head down to "
            f"{lr * min(lr_scales.values()):.3g} at the stem ({cfg.layer_decay:g}^{layers - 1})")
    return lines
