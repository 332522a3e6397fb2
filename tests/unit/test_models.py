"""The shipped networks: SmallCNN is Conv-BN-ReLU blocks without conv bias and fits any small
input; a ResNet for small images keeps the resolution in its stem; ResNet-50 at ImageNet size has
torchvision's parameter count and zero-initialized residual BatchNorms."""

import torch
import torchvision

from trainer.models.layers import ConvBNAct, count_parameters
from trainer.models.resnet import build_resnet
from trainer.models.small_cnn import SmallCNN


def test_small_cnn_is_conv_bn_relu_blocks_and_fits_any_small_input():
    net = SmallCNN(num_classes=10, in_channels=1, widths=(8, 16))
    blocks = [m for m in net.modules() if isinstance(m, ConvBNAct)]
    assert len(blocks) == 4 and all(b.conv.bias is None for b in blocks)
    for size in (8, 13, 32):
        assert net(torch.zeros(2, 1, size, size)).shape == (2, 10)


def test_small_cnn_without_normalization_has_biased_convs_and_no_batchnorm():
    """model.norm=none, the clipping study's fragile network: plain Conv(bias)-ReLU blocks, biases zero."""
    net = SmallCNN(num_classes=10, in_channels=1, widths=(8, 16), norm="none")
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules())
    assert len(convs) == 4 and all(c.bias is not None and not c.bias.any() for c in convs)
    assert net(torch.zeros(2, 1, 13, 13)).shape == (2, 10)


def test_resnet_for_small_images_keeps_resolution_in_the_stem():
    net = build_resnet(num_classes=7, arch="resnet18", in_channels=1, image_size=(8, 8))
    assert net.conv1.in_channels == 1 and net.conv1.stride == (1, 1)
    assert isinstance(net.maxpool, torch.nn.Identity)
    assert net(torch.zeros(2, 1, 8, 8)).shape == (2, 7)


def test_resnet50_at_imagenet_size_is_torchvisions():
    net = build_resnet(num_classes=1000, arch="resnet50", image_size=(224, 224))
    reference = torchvision.models.resnet50(weights=None)
    assert count_parameters(net) == count_parameters(reference) == 25_557_032
    assert net.conv1.kernel_size == (7, 7)
    # zero-init residual: the last BN of every bottleneck starts at zero
    assert all(not block.bn3.weight.detach().any() for layer in (net.layer1, net.layer4) for block in layer)
