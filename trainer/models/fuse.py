"""Fold BatchNorm into the preceding convolution, for inference only.

In eval mode BatchNorm is a fixed per-channel affine map, so it can be absorbed into the
convolution that feeds it: one kernel launch and one activation tensor fewer per block. The folded
network is for evaluation, export or serving only: BN's batch statistics are gone, and gradient
steps on the folded weights are not steps on conv + BN. Folding is exact only when the BN consumes
the conv's output and nothing else does, so only patterns whose data flow is known are rewritten
(see `fuse_for_inference`); anything else is left as it is, which is always correct, just slower."""

from __future__ import annotations

import copy
from typing import TypeGuard, TypeVar, cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

from trainer.models.layers import ConvBNAct

# Attribute pairs (conv, bn) whose data flow torchvision's forward() fixes: each bn reads only
# the output of its conv. Subclasses that override forward() are not trusted with this.
_RESNET_PAIRS: dict[type[nn.Module], tuple[tuple[str, str], ...]] = {
    ResNet: (("conv1", "bn1"),),
    BasicBlock: (("conv1", "bn1"), ("conv2", "bn2")),
    Bottleneck: (("conv1", "bn1"), ("conv2", "bn2"), ("conv3", "bn3")),
}

# A Conv2d's kernel size, stride and dilation: pairs, which torch types as _ConvNd's tuple[int, ...].
_Pair = tuple[int, int]
_M = TypeVar("_M", bound=nn.Module)


def fold_conv_bn(conv: nn.Conv2d, bn: _BatchNorm) -> nn.Conv2d:
    """A new Conv2d, with bias, computing ``bn(conv(x))`` as ``bn`` does in eval mode.
    The inputs are not modified. The arithmetic is done in float64 and rounded once to the conv's
    dtype, so the folded weights are as close to the two-step result as that dtype allows
    (a small ``var + eps`` can make the scale large, which amplifies rounding)."""
    if not isinstance(conv, nn.Conv2d) or not isinstance(bn, _BatchNorm):
        raise TypeError(f"expected a Conv2d and a BatchNorm, got {type(conv).__name__} and {type(bn).__name__}")
    if bn.num_features != conv.out_channels:
        raise ValueError(f"BatchNorm has {bn.num_features} features but the conv produces {conv.out_channels} channels")
    if bn.running_mean is None or bn.running_var is None:
        # Without running statistics BN normalises with each batch's own statistics even in eval
        # mode: that is not a fixed affine map, so there is nothing to fold.
        raise ValueError("BatchNorm has no running statistics (track_running_stats=False); "
                         "it cannot be folded")

    weight = conv.weight
    with torch.no_grad():
        w = weight.detach().to(torch.float64)
        mean = bn.running_mean.detach().to(device=weight.device, dtype=torch.float64)
        var = bn.running_var.detach().to(device=weight.device, dtype=torch.float64)
        scale = torch.rsqrt(var + bn.eps)
        shift = -mean * scale
        if bn.affine:
            gamma = bn.weight.detach().to(device=weight.device, dtype=torch.float64)
            beta = bn.bias.detach().to(device=weight.device, dtype=torch.float64)
            scale = scale * gamma
            shift = shift * gamma + beta
        bias = conv.bias.detach().to(torch.float64) * scale if conv.bias is not None else torch.zeros_like(scale)
        # Output channels are dim 0 of the weight whatever `groups` is, so one scale per row.
        folded_w = w * scale.reshape(-1, *([1] * (w.dim() - 1)))
        folded_b = bias + shift

        fused = nn.Conv2d(conv.in_channels, conv.out_channels, cast(_Pair, conv.kernel_size),
                          stride=cast(_Pair, conv.stride), padding=cast("str | _Pair", conv.padding),
                          dilation=cast(_Pair, conv.dilation), groups=conv.groups, bias=True,
                          padding_mode=conv.padding_mode, device=weight.device, dtype=weight.dtype)
        fused.weight.copy_(folded_w.to(weight.dtype))
        assert fused.bias is not None  # made with bias=True
        fused.bias.copy_(folded_b.to(weight.dtype))
    fused.train(conv.training)
    return fused


def fuse_for_inference(model: nn.Module) -> nn.Module:
    """A deep copy of ``model``, in eval mode, with every foldable Conv2d + BatchNorm pair folded.

    Rewritten patterns: ``ConvBNAct`` becomes ``nn.Sequential(folded_conv, activation)``; in a
    sequential chain a Conv2d directly followed by a BatchNorm absorbs it and the BN is removed
    (other children keep their names, so state-dict keys stay recognisable); in torchvision's
    ResNet, BasicBlock and Bottleneck the ``bnN`` attribute becomes ``nn.Identity()`` (their
    ``forward`` calls it by name). BNs without running statistics, convs or BNs shared between
    several places, and Conv2d subclasses (which may compute something else) are left alone. The
    original is never modified; the copy is for inference only (see the module docstring)."""
    fused = copy.deepcopy(model).eval()
    # Replacement containers are created in training mode; the whole result must be eval.
    return _fuse(fused, _shared_module_ids(fused)).eval()


def count_modules(model: nn.Module) -> int:
    """Number of distinct leaf modules (those without children), e.g. to see what folding saved."""
    return sum(1 for m in model.modules() if next(m.children(), None) is None)


def _shared_module_ids(model: nn.Module) -> set[int]:
    """Modules reachable along more than one path: folding one use would corrupt the others."""
    seen: set[int] = set()
    shared: set[int] = set()
    for _, m in model.named_modules(remove_duplicate=False):
        (shared if id(m) in seen else seen).add(id(m))
    return shared


def _foldable(conv: nn.Module, bn: nn.Module, shared: set[int]) -> bool:
    # Not a Conv2d subclass: it may override forward (weight standardisation, ...).
    return (type(conv) is nn.Conv2d and isinstance(bn, (nn.BatchNorm2d, nn.SyncBatchNorm))
            and bn.running_mean is not None and bn.num_features == conv.out_channels
            and id(conv) not in shared and id(bn) not in shared)


def _keeps_forward(module: nn.Module, base: type[_M]) -> TypeGuard[_M]:
    """True when ``module`` runs ``base``'s forward, so ``base``'s data flow holds."""
    return isinstance(module, base) and type(module).forward is base.forward


def _fuse(module: nn.Module, shared: set[int]) -> nn.Module:
    """Fold inside ``module`` (children first) and return it or its replacement."""
    for name, child in list(module.named_children()):
        new = _fuse(child, shared)
        if new is not child:
            setattr(module, name, new)

    if _keeps_forward(module, ConvBNAct):
        conv, bn, *rest = module.children()
        if _foldable(conv, bn, shared):  # a Conv2d and a BatchNorm
            return nn.Sequential(fold_conv_bn(cast(nn.Conv2d, conv), cast(_BatchNorm, bn)), *rest)
        return module

    for cls, pairs in _RESNET_PAIRS.items():
        if _keeps_forward(module, cls):
            for conv_name, bn_name in pairs:
                conv, bn = getattr(module, conv_name), getattr(module, bn_name)
                if _foldable(conv, bn, shared):
                    setattr(module, conv_name, fold_conv_bn(conv, bn))
                    setattr(module, bn_name, nn.Identity())
            return module

    if _keeps_forward(module, nn.Sequential):
        _fold_sequential(module, shared)
    return module


def _fold_sequential(seq: nn.Sequential, shared: set[int]) -> None:
    """Fold each Conv2d into the BatchNorm(s) right after it, deleting the BNs in place.
    Deleting by name (rather than rebuilding the container) keeps the container's type, hooks
    and the names of the surviving children; Sequential indexes by position, so the gap left in
    the names does not matter to forward()."""
    prev_name = ""  # the name of `prev`, once there is one
    prev: nn.Module | None = None
    for name, child in list(seq.named_children()):
        if prev is not None and _foldable(prev, child, shared):  # a Conv2d and a BatchNorm
            prev = fold_conv_bn(cast(nn.Conv2d, prev), cast(_BatchNorm, child))
            setattr(seq, prev_name, prev)
            delattr(seq, name)
            continue  # `prev` stays the conv, so a second BN in a row folds too
        prev_name, prev = name, child
