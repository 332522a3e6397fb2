"""model=timm: any timm model by name, fitted to the data's classes, channels and (for ViTs) image
size; weights only from a local file, with the classifier adapted; mistakes are one line."""

import pytest
import torch

from trainer.infra.errors import UserError
from trainer.models.timm import build_timm


def test_a_resnet_and_a_vit_take_the_datas_classes_channels_and_size():
    resnet = build_timm(10, "resnet18", in_channels=1, image_size=(8, 8))
    assert resnet(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    vit = build_timm(7, "vit_tiny_patch16_224", in_channels=3, image_size=(16, 16), drop_path_rate=0.1,
                     options={"patch_size": 4, "depth": 2})
    assert vit(torch.randn(2, 3, 16, 16)).shape == (2, 7)
    assert vit.patch_embed.grid_size == (4, 4) and len(vit.blocks) == 2
    assert vit.blocks[1].drop_path1.drop_prob == pytest.approx(0.1)  # stochastic depth: the last block's rate


def test_pretrained_weights_come_from_a_local_file_with_the_classifier_adapted(tmp_path):
    from safetensors.torch import save_file

    source = build_timm(1000, "resnet18")
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(tmp_path / "resnet18.safetensors"))
    net = build_timm(10, "resnet18", pretrained_path=str(tmp_path / "resnet18.safetensors"))
    assert torch.equal(net.layer1[0].conv1.weight, source.layer1[0].conv1.weight)
    assert net.fc.out_features == 10  # a new head for the data's classes


@pytest.mark.parametrize("kwargs,says", [
    ({"name": "resnet181"}, "model.name: 'resnet181' is not a timm model (did you mean resnet18"),
    ({"name": "resnet18", "pretrained_path": "/no/such/file.pth"}, "model.pretrained_path: '/no/such/file.pth' is not a file"),
    ({"name": "vit_tiny_patch16_224", "image_size": (8, 8)}, "larger than the image"),
    ({"name": "resnet18", "options": {"no_such_argument": 1}}, "model.options: timm's 'resnet18' refuses it"),
])
def test_mistakes_are_one_line_naming_the_key(kwargs, says):
    with pytest.raises(UserError) as caught:
        build_timm(10, **kwargs)
    assert says in caught.value.line() and "\n" not in caught.value.line()
