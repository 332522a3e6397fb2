"""Progressive resizing (trainer/data/progressive_resize.py and the image sources that crop per epoch).

The schedule holds the start size, raises it linearly over its ramp in steps of 8 or 32 px and ends
at the final size. The training loader of an image folder sends each epoch's size with every index,
so persistent loader workers crop at it in every decode mode, while evaluation stays at the final
size; an epoch at the final size gives, bit for bit, the crops of a run without the schedule, and a
smaller epoch's crop comes from the same box. Shards pick the size from LitData's epoch in the worker.
The throughput meter reports a median per size and warms up again after a change of size.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import write_photo_jpegs
from trainer.callbacks.throughput import ThroughputMeter
from trainer.data.imagefolder import ImageFolderDataModule
from trainer.data.progressive_resize import ResizeSchedule, epochs_of_run
from trainer.infra.errors import UserError

SEED = 5


def test_the_side_holds_then_rises_in_steps_and_ends_at_full_size():
    small = ResizeSchedule.of(32, 0.5, (0.5, 0.8), "auto", 5)
    assert small.step == 8 and small.sizes() == [16, 16, 16, 24, 32]
    # An FFCV-like ImageNet run: 160 px to 224 px over the last third, 32 px steps.
    imagenet = ResizeSchedule.of(224, 0.714, (0.6, 0.85), "auto", 20)
    assert imagenet.step == 32 and imagenet.sizes()[:12] == [160] * 12 and imagenet.sizes()[-3:] == [224] * 3
    assert imagenet.sizes() == sorted(imagenet.sizes()) and set(imagenet.sizes()) == {160, 192, 224}
    assert small.size_at(9) == 32  # epochs past the schedule (a longer resumed run) train at full size
    assert small.relative_cost() == pytest.approx((3 * 16**2 + 24**2 + 32**2) / (5 * 32**2))
    assert "evaluation at 32 px" in small.describe()


def test_the_start_is_a_multiple_of_the_step_and_never_above_the_final_size():
    assert ResizeSchedule.of(32, 0.1, (0.0, 1.0), "auto", 4).start == 8
    assert ResizeSchedule.of(224, 0.5, (0.0, 1.0), 16, 4).start == 112
    assert ResizeSchedule.of(20, 1.0, (0.0, 1.0), 8, 4).sizes() == [20, 20, 20, 20]


def test_a_run_bounded_by_steps_counts_its_epochs():
    assert epochs_of_run(6, None, 10) == 6
    assert epochs_of_run(-1, 25, 10) == 3
    assert epochs_of_run(None, None, 10) == 1000


def test_a_ramp_that_runs_backwards_is_one_line():
    with pytest.raises(UserError, match="data.resize_ramp"):
        ImageFolderDataModule(root="/nowhere", resize_ramp=(0.8, 0.5)).check_image_settings()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    write_photo_jpegs(root, {"train": 8, "val": 3}, classes=2, size=(96, 72))
    return root


def _module(folder: Path, mode: str, progressive: bool, workers: int) -> ImageFolderDataModule:
    module = ImageFolderDataModule(root=str(folder), image_size=32, batch_size=4, decode=mode, num_workers=workers,
                                   persistent_workers=workers > 0, progressive_resize=progressive,
                                   resize_start=0.5, resize_ramp=(0.25, 0.75))
    module.attach_run(None, SEED)
    module.inspect()
    module.apply_resize(module.resize_schedule(4))
    module.setup()
    return module


def _images(module: ImageFolderDataModule, batch) -> torch.Tensor:
    images, _ = module.transfer_batch_to_device(batch, torch.device("cpu"), 0)
    return images


@pytest.mark.parametrize("mode", ["pil", "fast", "device"])
def test_each_epoch_is_cropped_at_its_size_in_every_decode_mode_and_evaluation_at_the_final_one(folder, mode):
    module = _module(folder, mode, progressive=True, workers=1)
    assert module.resize is not None and module.resize.sizes() == [16, 16, 24, 32]
    loader = module.train_dataloader()  # one loader, persistent workers: the size reaches them per epoch
    for epoch, size in enumerate(module.resize.sizes()):
        loader.sampler.set_epoch(epoch)
        sides = {tuple(_images(module, batch).shape[-2:]) for batch in loader}
        assert sides == {(size, size)}, (mode, epoch)
    val = next(iter(module.val_dataloader()))
    assert tuple(_images(module, val).shape[-2:]) == (32, 32)


@pytest.mark.parametrize("mode", ["pil", "fast"])
def test_a_full_size_epoch_is_the_plain_runs_and_a_smaller_one_crops_the_same_box(folder, mode):
    resized, plain = _module(folder, mode, True, 0), _module(folder, mode, False, 0)
    loaders = resized.train_dataloader(), plain.train_dataloader()
    for loader in loaders:
        loader.sampler.set_epoch(3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(*loaders))  # epoch 3 is at 32 px: identical
    for loader in loaders:
        loader.sampler.set_epoch(2)
    small, full = next(iter(loaders[0]))[0], next(iter(loaders[1]))[0]
    assert small.shape[-1] == 24 and full.shape[-1] == 32
    # The same box, cropped to 24 px instead of 32: close to the 32 px crop scaled down.
    scaled = F.interpolate(full.float(), size=(24, 24), mode="bilinear", antialias=True)
    assert (scaled - small.float()).abs().mean() < 6  # of 255; a different box would differ by tens


def test_shards_pick_the_epochs_size_in_the_worker(folder, tmp_path):
    pytest.importorskip("litdata")
    from trainer.data.prepare_shards import prepare_shards
    from trainer.data.shards import ShardsDataModule

    dst = tmp_path / "shards"
    prepare_shards(folder, str(dst), workers=1, chunk_mb=1, progress=False)
    data = ShardsDataModule(source=str(dst), image_size=32, batch_size=4, num_workers=0, decode="fast",
                            progressive_resize=True, resize_start=0.5, resize_ramp=(0.25, 0.75))
    data.attach_run(None, SEED)
    data.inspect()
    data.apply_resize(data.resize_schedule(4))
    data.setup()
    for epoch, size in enumerate([16, 16, 24, 32]):
        data.train_set.set_epoch(epoch + 1)  # LitData counts epochs from 1
        assert data.train_set[0][0].shape[-1] == size
    assert next(iter(data.val_dataloader()))[0].shape[-1] == 32


def _step(meter: ThroughputMeter, side: int, epoch: int) -> None:
    trainer = SimpleNamespace(current_epoch=epoch)
    module = SimpleNamespace(device=torch.device("cpu"), log=lambda *a, **k: None)
    meter.on_train_batch_end(trainer, module, None, (torch.zeros(2, 3, side, side), torch.zeros(2)), 0)


def test_the_meter_gives_a_median_per_size_and_warms_up_again_after_a_change(monkeypatch):
    clock = iter(range(1000))
    monkeypatch.setattr("trainer.callbacks.throughput.time.perf_counter", lambda: float(next(clock)))
    meter = ThroughputMeter(warmup_steps=2, window_steps=2)
    for _ in range(7):  # 2 warm-up, an anchor, then 2 windows of 2 steps
        _step(meter, 16, 0)
    for _ in range(2):
        _step(meter, 32, 1)
    assert len(meter.window_rates) == 2  # the first two 32 px steps were warm-up again
    for _ in range(3):
        _step(meter, 32, 1)
    summary = meter.summary()
    assert set(summary["samples_per_s_by_side"]) == {"16", "32"} and summary["side_by_epoch"] == [16, 32]
    assert meter.window_sides == [16, 16, 32]
