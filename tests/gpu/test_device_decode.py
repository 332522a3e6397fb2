"""data.decode=device on CUDA: batches of JPEGs decoded by nvjpeg in one call and cropped on the GPU
give the host path's samples within a small tolerance (nvjpeg's IDCT and colour conversion are not
libjpeg's, so not bit for bit); files it refuses come from the host; auto leaves it a choice (the host
decode measured faster on an H200)."""

from __future__ import annotations

import torch

from tests.gpu.common import GPU
from tests.helpers import write_photo_jpegs
from trainer.data.badfiles import CORRUPT, read_list
from trainer.data.imagefolder import ImageFolderDataModule

pytestmark = [*GPU]

CUDA = torch.device("cuda")


def _module(root, decode, **kwargs):
    dm = ImageFolderDataModule(root=str(root), decode=decode, image_size=64, eval_crop_fraction=0.75, batch_size=8,
                               num_workers=0, **kwargs)
    dm.inspect()
    dm.apply_loader(dm.loader_settings(cuda=True))
    dm.setup()
    return dm


def test_device_batches_match_the_fast_path_within_tolerance(tmp_path):
    """Training and evaluation batches on the GPU: uint8 NCHW on CUDA, the labels the host path gives,
    the pixels within a mean of 2 grey levels of the host-decoded ones."""
    write_photo_jpegs(tmp_path, {"train": 8, "val": 4}, classes=2, size=(160, 120))
    device, fast = _module(tmp_path, "device"), _module(tmp_path, "fast")
    assert device.resolve_decode(cuda=True)[0] == "device"
    for make in ("train_dataloader", "val_dataloader"):
        for encoded, decoded in zip(getattr(device, make)(), getattr(fast, make)()):
            x, y = device.transfer_batch_to_device(encoded, CUDA, 0)
            x_ref, y_ref = decoded
            assert x.device.type == "cuda" and x.dtype == torch.uint8 and x.shape == x_ref.shape
            assert torch.equal(y.cpu(), y_ref)
            assert (x.cpu().float() - x_ref.float()).abs().mean() <= 2.0


def test_auto_resolves_to_the_host_decode_on_cuda(tmp_path):
    write_photo_jpegs(tmp_path, {"train": 2, "val": 1}, classes=2, size=(96, 72))
    dm = ImageFolderDataModule(root=str(tmp_path), decode="auto")
    dm.inspect()
    mode, how = dm.resolve_decode(cuda=True)
    assert mode == "fast" and "100% of the files are JPEGs: data.decode=device would decode them" in how


def test_a_file_nvjpeg_refuses_is_decoded_on_the_host_or_skipped(tmp_path):
    """A JPEG naming a quantization table it lacks: the batched call fails, each file is retried, the
    host refuses it too, and policy skip lists it and takes the next file."""
    write_photo_jpegs(tmp_path, {"train": 4, "val": 1}, classes=2, size=(96, 72))
    bad = sorted((tmp_path / "train").rglob("*.jpg"))[2]
    data = bytearray(bad.read_bytes())
    data[data.index(b"\xff\xc0") + 12] = 3
    bad.write_bytes(bytes(data))
    dm = _module(tmp_path, "device", max_bad_share=0.5)
    dm._bad_list.attach(tmp_path)
    for batch in dm.train_dataloader():
        x, _ = dm.transfer_batch_to_device(batch, CUDA, 0)
        assert x.shape[0] == 8
    assert {r.path: r.reason for r in read_list(dm._bad_list.path)} == {str(bad): CORRUPT}
