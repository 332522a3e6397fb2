"""data.augment (RandAugment, TrivialAugmentWide) for image folders: applied to training crops only,
in the loader workers of both host decode paths (pil, fast), drawn from each sample's own seed (the
same seed gives the same image, so a resumed epoch augments alike); the device path, which decodes
whole batches on the device, refuses it in one line and auto picks the host path for it."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import write_photo_jpegs
from trainer.data.imagefolder import ImageFolderDataModule
from trainer.infra.errors import UserError


def module(root, **kwargs) -> ImageFolderDataModule:
    dm = ImageFolderDataModule(root=str(root), image_size=32, batch_size=4, num_workers=0,
                               train_crop_scale=[1.0, 1.0], hflip=False, **kwargs)
    dm.inspect()
    dm.setup()
    return dm


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    write_photo_jpegs(root, {"train": 3, "val": 2}, size=(64, 48))
    return root


@pytest.mark.parametrize("decode", ["pil", "fast"])
@pytest.mark.parametrize("augment", ["randaugment", "trivialaugment"])
def test_training_crops_are_augmented_from_the_samples_seed(photos, decode, augment):
    plain = module(photos, decode=decode)
    augmented = module(photos, decode=decode, augment=augment, augment_magnitude=15)
    if decode == "pil":  # torchvision's transforms draw from the global generator the loader seeds
        def sample(dm, index, seed):
            torch.manual_seed(seed)
            return dm.train_set.load(index, None)
    else:
        def sample(dm, index, seed):
            return dm.train_set.load(index, seed)
    changed = 0
    for index in range(3):
        for seed in (1, 2, 3, 4):
            base, once, again = sample(plain, index, seed), sample(augmented, index, seed), sample(augmented, index, seed)
            assert once.dtype == torch.uint8 and once.shape == base.shape == (3, 32, 32)
            assert torch.equal(once, again)  # the same seed, the same augmentation
            changed += not torch.equal(once, base)
    assert changed >= 8  # of 12: an op can be the identity, or leave a crop as it was


def test_evaluation_images_are_not_augmented(photos):
    plain = module(photos, decode="fast")
    augmented = module(photos, decode="fast", augment="randaugment", augment_magnitude=30)
    for index in range(2):
        assert torch.equal(plain.val_set.load(index, None), augmented.val_set.load(index, None))


def test_the_device_path_refuses_it_and_auto_decodes_on_the_host(photos):
    with pytest.raises(UserError) as caught:
        ImageFolderDataModule(root=str(photos), decode="device", augment="randaugment")
    assert caught.value.where == "data.augment" and "data.decode=fast" in caught.value.line()
    dm = ImageFolderDataModule(root=str(photos), image_size=32, augment="trivialaugment")
    dm.inspect()
    mode, how = dm.resolve_decode(cuda=True)
    assert mode == "fast" and "data.augment" in how
    assert dm.decode_choices() == ("pil", "fast")
