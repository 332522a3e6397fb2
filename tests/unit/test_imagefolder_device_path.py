"""Shipping uint8 and normalizing on the device gives the same tensors as doing it in the workers."""

import torch

from tests.helpers import write_digit_pngs
from trainer.data.imagefolder import ImageFolderDataModule


def _module(root, device_normalize):
    dm = ImageFolderDataModule(root=str(root), image_size=12, eval_crop_fraction=0.75, batch_size=8,
                               num_workers=0, device_normalize=device_normalize)
    dm.inspect()
    dm.setup()
    return dm


def test_device_path_equals_host_path(tmp_path):
    write_digit_pngs(tmp_path, {"train": 2, "val": 2}, size=16)
    host, device = _module(tmp_path, False), _module(tmp_path, True)
    host_x, host_y = next(iter(host.val_dataloader()))
    raw_x, raw_y = next(iter(device.val_dataloader()))
    assert raw_x.dtype == torch.uint8 and host_x.dtype == torch.float32
    assert raw_x.element_size() * 4 == host_x.element_size()  # a quarter of the bytes on the wire
    on_device = device.device_transform(raw_x, training=False)
    assert torch.equal(host_y, raw_y)
    assert torch.allclose(on_device, host_x, atol=1e-6)
    assert device.inspect().sample_bytes * 4 == host.inspect().sample_bytes == 3 * 12 * 12 * 4


def test_device_flip_only_in_training(tmp_path):
    write_digit_pngs(tmp_path, {"train": 2, "val": 2}, size=16)
    dm = _module(tmp_path, True)
    raw, _ = next(iter(dm.val_dataloader()))
    torch.manual_seed(0)
    raw = raw.repeat(8, 1, 1, 1)
    flipped = dm.device_transform(raw, training=True)
    plain = dm.device_transform(raw, training=False)
    differs = (flipped != plain).flatten(1).any(1)
    assert torch.equal(flipped[~differs], plain[~differs])
    assert torch.allclose(flipped[differs], plain[differs].flip(-1))
    assert 0 < int(differs.sum()) < len(raw)
