"""Conv-BN folding for inference: a folded eval copy of SmallCNN, ResNet-18 and ResNet-50 gives
the model's eval outputs within 1e-5 (relative to the output's scale for ResNet-50) with no
BatchNorm left; the folding arithmetic keeps dtypes, patterns that cannot fold safely are left
alone, and folding twice changes nothing more."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from trainer.models.fuse import count_modules, fold_conv_bn, fuse_for_inference
from trainer.models.layers import ConvBNAct
from trainer.models.resnet import build_resnet
from trainer.models.small_cnn import SmallCNN


def _randomize_bn(model: nn.Module, gen: torch.Generator) -> None:
    """Identity-like BNs (fresh init, zero-init residual) would hide folding mistakes."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _BatchNorm):
                c = m.num_features
                m.weight.copy_(torch.rand(c, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(c, generator=gen) * 0.2)
                m.running_mean.copy_(torch.randn(c, generator=gen) * 0.2)
                m.running_var.copy_(torch.rand(c, generator=gen) * 1.5 + 0.5)


def _train_a_little(model: nn.Module, shape: tuple[int, ...], num_classes: int,
                    steps: int = 3) -> None:
    """A few real SGD steps, so weights and running statistics are what training leaves."""
    gen = torch.Generator().manual_seed(0)
    _randomize_bn(model, gen)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for _ in range(steps):
        x = torch.randn(*shape, generator=gen)
        y = torch.randint(0, num_classes, (shape[0],), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _bn_count(model: nn.Module) -> int:
    return sum(isinstance(m, _BatchNorm) for m in model.modules())


def _snapshot(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[bool], list[str]]:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return state, [m.training for m in model.modules()], [type(m).__name__ for m in model.modules()]


def _assert_unchanged(model: nn.Module, before: tuple) -> None:
    state, modes, types = before
    after_state, after_modes, after_types = _snapshot(model)
    assert after_types == types
    assert after_modes == modes
    assert after_state.keys() == state.keys()
    assert all(torch.equal(after_state[k], state[k]) for k in state)


def _check_fusion(model: nn.Module, x: torch.Tensor, atol: float,
                  relative: bool = False) -> nn.Module:
    """Fuse, check the original is untouched, compare eval outputs.

    `relative`: `atol` is a fraction of the largest output, for nets whose logits are large.
    """
    before = _snapshot(model)
    bns = _bn_count(model)
    assert bns > 0 and model.training

    fused = fuse_for_inference(model)

    _assert_unchanged(model, before)
    assert _bn_count(model) == bns
    assert _bn_count(fused) == 0
    assert count_modules(fused) < count_modules(model)
    assert not any(m.training for m in fused.modules())

    model.eval()
    with torch.no_grad():
        expected, actual = model(x), fused(x)
    # Guard against a vacuous comparison, e.g. logits that are all ~0.
    scale = expected.abs().max().item()
    assert scale > 1e-2
    torch.testing.assert_close(actual, expected, atol=atol * scale if relative else atol, rtol=0)
    return fused


def test_small_cnn_fused_matches_eval_output_without_any_batchnorm():
    torch.manual_seed(0)
    net = SmallCNN(num_classes=10, widths=(8, 16, 32))
    _train_a_little(net, (8, 3, 16, 16), 10)
    net.train()
    fused = _check_fusion(net, torch.randn(4, 3, 16, 16), atol=1e-5)

    # Every ConvBNAct became a plain (conv-with-bias, activation) pair.
    assert not any(isinstance(m, ConvBNAct) for m in fused.modules())
    block = fused.features[0]
    assert type(block) is nn.Sequential and len(block) == 2
    assert isinstance(block[0], nn.Conv2d) and block[0].bias is not None
    assert isinstance(block[1], nn.ReLU)


@pytest.mark.parametrize("stem", ["small", "imagenet"])
def test_resnet18_fused_matches(stem: str):
    torch.manual_seed(0)
    size = 32 if stem == "small" else 64
    net = build_resnet(10, arch="resnet18", image_size=(size, size), stem=stem)
    _train_a_little(net, (2, 3, size, size), 10, steps=1)  # CPU time: the BNs are random anyway
    net.train()
    fused = _check_fusion(net, torch.randn(2, 3, size, size), atol=1e-5)

    assert isinstance(fused.bn1, nn.Identity) and fused.conv1.bias is not None
    block = fused.layer2[0]
    assert isinstance(block.bn1, nn.Identity) and isinstance(block.bn2, nn.Identity)
    # The downsample Sequential(conv, bn) lost its BN.
    assert len(block.downsample) == 1 and block.downsample[0].bias is not None


@pytest.mark.parametrize("stem", ["small", "imagenet"])
def test_resnet50_fused_matches(stem: str):
    torch.manual_seed(0)
    net = build_resnet(10, arch="resnet50", image_size=(64, 64), stem=stem)
    _train_a_little(net, (2, 3, 64, 64), 10, steps=1)
    net.train()
    # Random BN scales through 16 residual blocks give logits in the hundreds, where float32
    # rounding alone exceeds 1e-5 absolute (observed: ~2e-7 of the largest logit); a bound
    # relative to the output size still catches any real folding mistake.
    fused = _check_fusion(net, torch.randn(2, 3, 64, 64), atol=1e-5, relative=True)
    assert all(isinstance(b.bn3, nn.Identity) for b in fused.layer4)


def _random_bn(channels: int, affine: bool = True) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(channels, affine=affine, eps=1e-3)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(channels, generator=gen))
        bn.running_var.copy_(torch.rand(channels, generator=gen) + 0.1)
        if affine:
            bn.weight.copy_(torch.randn(channels, generator=gen))
            bn.bias.copy_(torch.randn(channels, generator=gen))
    return bn.eval()


@pytest.mark.parametrize(
    "conv",
    [
        # depthwise, stride 2, reflect padding
        nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=6, bias=False, padding_mode="reflect"),
        # grouped, dilated, with its own bias
        nn.Conv2d(4, 8, 3, padding=2, dilation=2, groups=2, bias=True),
        nn.Conv2d(4, 8, 1, padding="same", bias=True),
    ],
    ids=["depthwise", "grouped-dilated-bias", "pointwise-same"],
)
@pytest.mark.parametrize("affine", [True, False])
def test_fold_conv_bn_equals_bn_of_conv(conv: nn.Conv2d, affine: bool):
    torch.manual_seed(0)
    conv = copy.deepcopy(conv)  # parametrize shares instances across cases
    bn = _random_bn(conv.out_channels, affine)
    conv_before = {k: v.clone() for k, v in conv.state_dict().items()}

    folded = fold_conv_bn(conv, bn)

    for attr in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation",
                 "groups", "padding_mode"):
        assert getattr(folded, attr) == getattr(conv, attr)
    assert folded.bias is not None and folded.weight.dtype == conv.weight.dtype
    assert all(torch.equal(conv.state_dict()[k], v) for k, v in conv_before.items())
    x = torch.randn(2, conv.in_channels, 9, 9)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), bn(conv(x)), atol=1e-5, rtol=0)


def test_fold_conv_bn_keeps_dtype_and_rejects_what_cannot_fold():
    conv = nn.Conv2d(3, 4, 3, bias=False).double()
    bn = _random_bn(4).double()
    x = torch.randn(1, 3, 5, 5, dtype=torch.float64)
    folded = fold_conv_bn(conv, bn)
    assert folded.weight.dtype == torch.float64
    torch.testing.assert_close(folded(x), bn(conv(x)), atol=1e-12, rtol=0)

    with pytest.raises(ValueError, match="running statistics"):
        fold_conv_bn(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False))
    with pytest.raises(ValueError, match="features"):
        fold_conv_bn(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(5))


def test_sequential_chains_fold_and_unsafe_patterns_are_left_alone():
    shared_bn = _random_bn(4)

    class Branchy(nn.Sequential):
        # Overrides forward: its children are not a chain, so nothing inside may be folded.
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self[1](x) + self[0](x).mean()

    model = nn.Sequential()
    model.add_module("stem", nn.Conv2d(4, 4, 3, padding=1))
    model.add_module("norm", _random_bn(4))
    model.add_module("norm_again", _random_bn(4))  # a second BN in a row folds too
    model.add_module("act", nn.ReLU())
    model.add_module("a", nn.Sequential(nn.Conv2d(4, 4, 1), shared_bn))
    model.add_module("b", nn.Sequential(nn.Conv2d(4, 4, 1), shared_bn))  # shared: keep
    model.add_module("c", Branchy(nn.Conv2d(4, 4, 1), _random_bn(4)))
    model.add_module("d", nn.Sequential(nn.Conv2d(4, 4, 1),
                                        nn.BatchNorm2d(4, track_running_stats=False)))
    model.eval()

    fused = fuse_for_inference(model)

    assert list(dict(fused.named_children())) == ["stem", "act", "a", "b", "c", "d"]
    assert len(fused.a) == len(fused.b) == 2 and fused.a[1] is fused.b[1]
    assert isinstance(fused.c[1], nn.BatchNorm2d) and isinstance(fused.d[1], nn.BatchNorm2d)
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=0)


def test_fusing_twice_changes_nothing_more():
    net = SmallCNN(num_classes=3, widths=(4,))
    _train_a_little(net, (4, 3, 8, 8), 3, steps=1)
    once = fuse_for_inference(net)
    twice = fuse_for_inference(once)
    assert count_modules(twice) == count_modules(once)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(twice(x), once(x), atol=0, rtol=0)
