"""A short real run on each data module and on a team's own model, each reaching a stated test
accuracy: synthetic (> 0.9), the expanded digits at a tenth of their size (>= 0.85), an image folder of PNG digits (>= 0.8), a tiny CIFAR-10 copy in
torchvision's format (>= 0.9) and a custom `_target_` model (>= 0.9)."""

import pytest

from tests.helpers import ON_CPU, train_forked, write_cifar_copy, write_digit_pngs

pytestmark = pytest.mark.run

FAST = ["progress=plain", "checkpointing=off"]


def test_synthetic_learns_its_class_patterns(tmp_path):
    result = train_forked(["data=synthetic", "data.shape=[3,16,16]", "data.train_samples=1024", "data.signal=1.0",
                    "trainer.max_epochs=3", *FAST], tmp_path / "run")
    assert result.returncode == 0, result
    summary = result.summary
    assert summary["data"]["image_size"] == [16, 16] and summary["data"]["in_channels"] == 3
    assert summary["steps"] == 3 * (1024 // 64)
    # Ten classes: chance is 0.1; the patterns are easy to separate.
    assert summary["metrics"]["test"]["acc"] > 0.9


def test_expanded_digits_train_at_sixteen_pixels(tmp_path):
    # 4 distortions of each training original (5,028 images), 2 of each test original; 2 epochs.
    # On the CPU: the band was measured there (0.917).
    result = train_forked([*ON_CPU, "data=digits_expanded", "data.copies=4", "data.eval_copies=2",
                           f"data.cache_dir={tmp_path / 'cache'}", "trainer.max_epochs=2", *FAST], tmp_path / "run")
    assert result.returncode == 0, result
    summary = result.summary
    assert summary["data"]["sizes"] == {"train": 4 * 1257, "val": 2 * 270, "test": 2 * 270}
    assert summary["data"]["image_size"] == [16, 16] and summary["steps"] == 2 * (4 * 1257 // 64)
    assert summary["metrics"]["test"]["acc"] >= 0.85


def test_imagefolder_of_png_digits(tmp_path):
    root = tmp_path / "digits_png"
    write_digit_pngs(root, {"train": 40, "val": 10}, size=16)
    # On the CPU: the accuracy band below was measured there (fp32).
    result = train_forked([*ON_CPU, "data=imagefolder", f"data.root={root}", "data.image_size=16", "data.train_crop_scale=[0.85,1.0]",
                    "data.hflip=false", "data.eval_crop_fraction=1.0", "data.batch_size=32", "data.num_workers=1",
                    "trainer.max_epochs=12", *FAST], tmp_path / "run")
    assert result.returncode == 0, result
    summary = result.summary
    assert summary["data"]["num_classes"] == 10 and summary["data"]["in_channels"] == 3
    assert summary["data"]["sizes"] == {"train": 400, "val": 100, "test": 100}
    assert any("no test/ folder" in note for note in summary["data"]["notes"])
    assert summary["derived"]["data.num_workers"]["value"] == 1
    assert summary["metrics"]["test"]["acc"] >= 0.8


@pytest.mark.parametrize("decode", ["fast", "device"])
def test_imagefolder_of_jpeg_digits_in_each_decode_mode(tmp_path, decode):
    """make train ARGS="data=imagefolder data.root=... data.decode=MODE" trains to the pil path's
    accuracy band; the summary says which decoder ran and why (device without CUDA: on the CPU)."""
    root = tmp_path / "digits_jpeg"
    write_digit_pngs(root, {"train": 40, "val": 10}, size=16, suffix=".jpg")
    result = train_forked([*ON_CPU, "data=imagefolder", f"data.root={root}", "data.image_size=16", "data.train_crop_scale=[0.85,1.0]",
                    "data.hflip=false", "data.eval_crop_fraction=1.0", "data.batch_size=32", "data.num_workers=1",
                    f"data.decode={decode}", "trainer.max_epochs=12", *FAST], tmp_path / "run")
    assert result.returncode == 0, result
    derived = result.summary["derived"]["data.decode"]
    assert derived["value"] == decode and "as configured" in derived["how"]
    assert result.summary["metrics"]["test"]["acc"] >= 0.8


def test_cifar10_tiny_copy_in_torchvision_format(tmp_path):
    write_cifar_copy(tmp_path / "cifar", train_per_batch=300, test=200, batches=2)
    result = train_forked(["data=cifar10", f"data.root={tmp_path / 'cifar'}", "data.batch_size=32", "trainer.max_epochs=8",
                    "optimizer.lr=0.01", "optimizer.lr_scaling=none",
                    "model.widths=[16,32]", *FAST], tmp_path / "run")
    assert result.returncode == 0, result
    summary = result.summary
    assert summary["data"]["sizes"] == {"train": 540, "val": 60, "test": 200}
    assert summary["data"]["image_size"] == [32, 32]
    assert summary["metrics"]["test"]["acc"] >= 0.9


def test_a_team_model_plugged_in_by_target(tmp_path):
    result = train_forked(["model=custom", "model._target_=tests.helpers.TinyMLP", "+model.hidden=48",
                    "optimizer.lr=0.01", "optimizer.lr_scaling=none", "trainer.max_epochs=15", *FAST], tmp_path / "run")
    assert result.returncode == 0, result
    summary = result.summary
    assert summary["model"]["target"] == "tests.helpers.TinyMLP"
    assert summary["model"]["parameters"] == 64 * 48 + 48 + 48 * 10 + 10
    assert summary["metrics"]["test"]["acc"] >= 0.9
