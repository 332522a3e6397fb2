"""Bad files in an image folder: every mode converted to 8-bit RGB (16-bit by its high byte, so
mid-grey, not PIL's saturated white); the scan's verdict on truncated, empty, fake and non-image
files; unreadable files skipped and listed (or stopping the run with one line), the share limit,
empty and missing class folders; failures inside DataLoader workers, raised or killed, reported
as one line within a bounded time, never a hang."""

from __future__ import annotations

import io
import os
import signal
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile
from torch.utils.data import DataLoader, Dataset

from tests.helpers import compose, write_digit_pngs
from trainer.configuration.spec import validate
from trainer.data.badfiles import (CORRUPT, EMPTY, NOT_AN_IMAGE, UNIDENTIFIED, BadImageError, BadShareError,
                                   check_files, load_rgb, read_list, to_rgb)
from trainer.data.imagefolder import ImageFolderDataModule, list_split
from trainer.data.loader import loader_failure
from trainer.infra.errors import UserError

WORKER_TIMEOUT_S = 30  # a DataLoader that waits longer for a batch raises instead of hanging


# -- files of every kind --------------------------------------------------------------------------------
def truncated_jpeg(path: Path, keep: float = 0.5) -> Path:
    """A JPEG cut off part-way: its header is fine, its data ends early (an interrupted download)."""
    pixels = np.random.default_rng(0).integers(0, 256, size=(48, 48, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=95)
    data = buffer.getvalue()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def inject_bad_files(folder: Path) -> dict[str, str]:
    """One file of each kind the scan knows into `folder`; {file name: reason under scan=header}."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "empty.png").write_bytes(b"")
    (folder / "error_page.jpg").write_text("<html><body>404 Not Found</body></html>")
    (folder / "notes.txt").write_text("collected 2021, see wiki")
    (folder / ".DS_Store").write_bytes(b"\x00\x01 finder metadata")  # hidden: ignored, not bad
    truncated_jpeg(folder / "cut.jpg")  # passes the header scan; found by scan=full or when loaded
    return {"empty.png": EMPTY, "error_page.jpg": UNIDENTIFIED, "notes.txt": NOT_AN_IMAGE}


def saved(image: Image.Image, path: Path, fmt: str) -> Path:
    image.save(path, fmt)
    return path


def module(root: Path, **kwargs) -> ImageFolderDataModule:
    defaults = dict(root=str(root), image_size=16, eval_crop_fraction=1.0, batch_size=4, num_workers=0)
    return ImageFolderDataModule(**{**defaults, **kwargs})


@pytest.fixture
def digits(tmp_path: Path) -> Path:
    root = tmp_path / "digits"
    write_digit_pngs(root, {"train": 4, "val": 2}, classes=range(3), size=16)
    return root


# -- load_rgb: every mode to 8-bit RGB ------------------------------------------------------------------
def _pixel(image: Image.Image) -> tuple[int, int, int]:
    assert image.mode == "RGB"
    return image.getpixel((0, 0))


def test_grey_and_alpha_modes(tmp_path):
    assert _pixel(load_rgb(saved(Image.new("L", (4, 4), 100), tmp_path / "l.png", "PNG"))) == (100, 100, 100)
    # Alpha is dropped, as torchvision's and timm's loaders do: the colour under it is kept.
    assert _pixel(load_rgb(saved(Image.new("LA", (4, 4), (100, 0)), tmp_path / "la.png", "PNG"))) == (100, 100, 100)
    rgba = saved(Image.new("RGBA", (4, 4), (10, 20, 30, 0)), tmp_path / "rgba.png", "PNG")
    assert _pixel(load_rgb(rgba)) == (10, 20, 30)
    one_bit = Image.new("1", (4, 4), 1)
    one_bit.putpixel((1, 1), 0)
    rgb = load_rgb(saved(one_bit, tmp_path / "one.png", "PNG"))
    assert _pixel(rgb) == (255, 255, 255) and rgb.getpixel((1, 1)) == (0, 0, 0)


def test_palette_with_transparency_goes_through_rgba_without_a_warning(tmp_path):
    palette = Image.new("P", (4, 4), 0)
    palette.putpalette([200, 10, 10, 0, 0, 255] + [0] * 762)
    palette.putpixel((1, 1), 1)
    path = tmp_path / "p.png"
    palette.save(path, "PNG", transparency=0)
    assert Image.open(path).info.get("transparency") == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PIL warns when a palette image with transparency skips RGBA
        rgb = load_rgb(path)
    assert _pixel(rgb) == (200, 10, 10) and rgb.getpixel((1, 1)) == (0, 0, 255)
    gif = tmp_path / "p.gif"
    palette.save(gif, "GIF", transparency=0)
    assert _pixel(load_rgb(gif))[0] > 150


def test_cmyk_jpeg_becomes_rgb(tmp_path):
    path = saved(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), tmp_path / "cmyk.jpg", "JPEG")
    assert Image.open(path).mode == "CMYK"
    r, g, b = _pixel(load_rgb(path))
    assert r > 240 and g < 15 and b < 15  # pure red, within JPEG's rounding


def test_16_bit_png_is_scaled_not_saturated(tmp_path):
    path = saved(Image.fromarray(np.full((4, 4), 30000, np.uint16)), tmp_path / "deep.png", "PNG")
    opened = Image.open(path)
    assert opened.mode == "I;16"
    assert _pixel(opened.convert("RGB")) == (255, 255, 255)  # PIL's own conversion clips at 255: white
    assert _pixel(load_rgb(path)) == (117, 117, 117)  # 30000 >> 8: mid-grey, as 30000/65535 is
    big_endian = Image.frombytes("I;16B", (2, 2), np.full((2, 2), 65535, ">u2").tobytes())
    assert _pixel(to_rgb(big_endian)) == (255, 255, 255)


def test_32_bit_integer_and_float_images(tmp_path):
    sixteen_bit_values = saved(Image.fromarray(np.full((4, 4), 30000, np.int32)), tmp_path / "i.tif", "TIFF")
    assert Image.open(sixteen_bit_values).mode == "I"
    assert _pixel(load_rgb(sixteen_bit_values)) == (117, 117, 117)
    wide = np.array([[-1000, 0], [500_000, 1_000_000]], np.int32)  # outside 16 bits: stretched over its range
    assert np.asarray(to_rgb(Image.fromarray(wide)))[..., 0].tolist() == [[0, 0], [128, 255]]
    unit = saved(Image.fromarray(np.full((4, 4), 0.5, np.float32)), tmp_path / "f.tif", "TIFF")
    assert Image.open(unit).mode == "F"
    assert _pixel(load_rgb(unit)) == (128, 128, 128)
    radiance = np.array([[0.0, 250.0], [1000.0, np.nan]], np.float32)
    assert np.asarray(to_rgb(Image.fromarray(radiance)))[..., 0].tolist() == [[0, 64], [255, 0]]


def test_truncated_images_stay_an_error():
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False  # importing the data modules did not switch it on


# -- the scan -------------------------------------------------------------------------------------------
def test_scan_classifies_each_kind_of_bad_file(tmp_path):
    expected = inject_bad_files(tmp_path / "cls")
    good = saved(Image.new("RGB", (8, 8), (1, 2, 3)), tmp_path / "cls" / "good.JPEG", "JPEG")  # upper case counts
    listed = list_split(tmp_path)["cls"]
    assert sorted(Path(p).name for p in listed) == sorted([*expected, "cut.jpg", "good.JPEG"])  # hidden file left out

    def names(found):
        return {Path(p).name: reason for p, (reason, _) in found.items()}

    assert names(check_files(listed, "header")) == expected  # the truncated JPEG's header is fine
    assert names(check_files(listed, "full")) == {**expected, "cut.jpg": CORRUPT}
    assert names(check_files(listed, "off")) == {"notes.txt": NOT_AN_IMAGE}
    assert str(good) not in check_files(listed, "full")


def test_a_truncated_file_is_caught_when_loaded(tmp_path):
    path = truncated_jpeg(tmp_path / "cut.jpg")
    with pytest.raises(BadImageError) as caught:
        load_rgb(path)
    assert caught.value.path == str(path) and caught.value.reason == CORRUPT
    assert "truncated" in caught.value.detail
    line = caught.value.line()
    assert line.startswith(f"{path}: truncated or corrupt") and "data.bad_files=skip" in line and "\n" not in line


# -- the data module: skip, list, share limit, error -----------------------------------------------------
def test_skip_lists_every_bad_file_and_counts_them(digits, tmp_path):
    expected = inject_bad_files(digits / "train" / "digit_1")
    (digits / "val" / "digit_2" / "zero.png").write_bytes(b"")
    run_dir = tmp_path / "run"
    dm = module(digits, max_bad_share=0.5)
    dm.run_dir = run_dir
    info = dm.inspect()
    assert info.sizes == {"train": 12 + 1, "val": 6, "test": 6}  # the truncated JPEG is only found when loaded
    note = next(n for n in info.notes if "unreadable" in n)
    assert note.startswith("4 unreadable files skipped") and str(run_dir / "bad_files.tsv") in note
    lines = (run_dir / "bad_files.tsv").read_text().splitlines()
    assert lines[0] == "split\tpath\treason\tdetail"
    rows = {Path(line.split("\t")[1]).name: line.split("\t") for line in lines[1:]}
    assert {name: row[2] for name, row in rows.items()} == {**expected, "zero.png": EMPTY}
    assert rows["zero.png"][0] == "val" and rows["notes.txt"][0] == "train"
    summary = dm.bad_files_summary()
    assert summary["count"] == 4 and summary["policy"] == "skip" and summary["scan"] == "header"
    assert summary["by_reason"] == {EMPTY: 2, NOT_AN_IMAGE: 1, UNIDENTIFIED: 1}
    assert summary["share"] == pytest.approx(3 / 16)  # train: 3 of 16 files; val: 1 of 7
    assert summary["list"] == str(run_dir / "bad_files.tsv")
    dm.inspect()  # a second look neither scans again nor loses the list
    assert dm.bad_files_summary()["count"] == 4


def test_without_a_run_folder_the_list_stays_in_memory(digits):
    inject_bad_files(digits / "train" / "digit_0")
    dm = module(digits, max_bad_share=0.5)
    info = dm.inspect()
    assert any(n.startswith("3 unreadable files skipped") for n in info.notes)
    assert dm.bad_files_summary()["count"] == 3 and dm.bad_files_summary()["list"] is None


def test_a_file_that_fails_to_load_is_replaced_by_the_next_one(digits, tmp_path):
    val = digits / "val" / "digit_1"
    cut = truncated_jpeg(val / f"{sorted(p.name for p in val.iterdir())[0][:-4]}_cut.jpg")  # sorts after its twin
    dm = module(digits, scan="header", max_bad_share=0.5)
    dm.run_dir = tmp_path / "run"
    dm.inspect()
    dm.setup()
    files = [p for p, _ in dm.val_set.samples]
    i = files.index(str(cut))
    replaced, label = dm.val_set[i]
    following, following_label = dm.val_set[i + 1]
    assert torch.equal(replaced, following) and label == following_label == dm.val_set.targets[i + 1]
    again, _ = dm.val_set[i]  # known now: straight to the replacement
    assert torch.equal(again, following)
    fresh = module(digits, scan="header", max_bad_share=0.5)  # another process, another worker: same choice
    fresh.setup()
    assert torch.equal(fresh.val_set[i][0], following)
    assert torch.equal(dm.val_set[len(files) - 1][0], dm.val_set[len(files) - 1][0])
    rows = read_list(dm.run_dir / "bad_files.tsv")
    assert [(r.split, r.path, r.reason) for r in rows] == [("val", str(cut), CORRUPT)]
    assert rows[0].detail.startswith("found while loading")
    assert dm.bad_files_summary()["count"] == 1  # found twice (two modules), counted once


def test_the_last_file_wraps_around_to_the_first(tmp_path):
    root = tmp_path / "data"
    write_digit_pngs(root, {"train": 3, "val": 2}, classes=range(2), size=16)
    cut = truncated_jpeg(root / "val" / "digit_1" / "zz_cut.jpg")
    dm = module(root, max_bad_share=0.5)
    dm.setup()
    assert dm.val_set.samples[-1][0] == str(cut)
    assert torch.equal(dm.val_set[len(dm.val_set) - 1][0], dm.val_set[0][0])


def test_error_policy_names_the_first_bad_file(digits, tmp_path):
    inject_bad_files(digits / "train" / "digit_2")
    dm = module(digits, bad_files="error")
    dm.run_dir = tmp_path / "run"
    with pytest.raises(BadImageError) as caught:
        dm.inspect()
    line = caught.value.line()
    first = digits / "train" / "digit_2" / "empty.png"
    assert line.startswith(f"{first}: empty file") and "2 more unreadable files listed in" in line
    assert isinstance(caught.value, UserError) and "\n" not in line
    assert len(read_list(tmp_path / "run" / "bad_files.tsv")) == 3
    with pytest.raises(BadImageError):  # asked again, the answer is the same
        dm.inspect()


def test_error_policy_stops_on_a_file_found_while_loading(digits):
    cut = truncated_jpeg(digits / "val" / "digit_0" / "cut.jpg")
    dm = module(digits, bad_files="error")
    dm.setup()
    with pytest.raises(BadImageError) as caught:
        dm.val_set[[p for p, _ in dm.val_set.samples].index(str(cut))]
    assert caught.value.path == str(cut)


def test_more_bad_files_than_the_share_allows_stop_the_run(digits, tmp_path):
    inject_bad_files(digits / "train" / "digit_0")
    dm = module(digits, max_bad_share=0.1)
    dm.run_dir = tmp_path / "run"
    with pytest.raises(BadShareError) as caught:
        dm.inspect()
    line = caught.value.line()
    assert line.startswith("data.max_bad_share: 3 of 16 files in train/ are unreadable "
                           "(18.8%, more than the 10.0% allowed)")
    assert str(tmp_path / "run" / "bad_files.tsv") in line
    module(digits, max_bad_share=0.2).inspect()  # 18.8% is within 20%


def test_the_share_limit_also_counts_files_found_while_loading(digits):
    cuts = [truncated_jpeg(digits / "val" / f"digit_{i}" / "cut.jpg") for i in range(2)]
    dm = module(digits, max_bad_share=0.2)  # 2 of 8 val files: over the limit, but only once they are loaded
    dm.setup()
    files = [p for p, _ in dm.val_set.samples]
    dm.val_set[files.index(str(cuts[0]))]  # 1 of 8 is within 20%
    with pytest.raises(BadShareError, match=r"data.max_bad_share: 2 of 8 files in val/ are unreadable \(25.0%"):
        dm.val_set[files.index(str(cuts[1]))]


def test_empty_and_unreadable_class_folders_are_left_out_with_a_note(digits):
    (digits / "train" / "digit_7").mkdir()
    inject_bad_files(digits / "train" / "digit_8")  # nothing readable: treated like an empty folder
    (digits / "train" / "digit_8" / "cut.jpg").unlink()
    info = module(digits, max_bad_share=1.0).inspect()
    assert info.class_names == ["digit_0", "digit_1", "digit_2"] and info.num_classes == 3
    assert "2 class folders in train/ have no readable images, left out: digit_7, digit_8" in info.notes


def test_one_empty_class_folder_is_named(digits):
    (digits / "train" / "digit_9").mkdir()
    info = module(digits).inspect()
    assert "class folder 'digit_9' in train/ has no readable images: left out" in info.notes


def test_a_train_class_missing_from_val_is_a_note_not_an_error(digits):
    for path in (digits / "val" / "digit_2").iterdir():
        path.unlink()
    info = module(digits).inspect()
    assert info.num_classes == 3 and info.sizes["val"] == 4
    assert "1 class of train/ with no readable images in val/ (not measured there): digit_2" in info.notes


def test_val_class_whose_train_files_are_all_unreadable_is_an_error(digits):
    for path in (digits / "train" / "digit_1").iterdir():
        path.write_bytes(b"")
    with pytest.raises(UserError, match=r"classes with no training images \(their train/ files are all unreadable\): "
                                        r"digit_1"):
        module(digits, max_bad_share=1.0).inspect()


def test_the_config_keys_are_checked():
    spec = validate(compose(["data=imagefolder", "data.root=/data", "data.scan=off", "data.bad_files=error"]))
    assert (spec.data["scan"], spec.data["bad_files"], spec.data["max_bad_share"]) == ("off", "error", 0.01)
    for override, key in (("data.bad_files=ignore", "data.bad_files"), ("data.scan=deep", "data.scan"),
                          ("data.max_bad_share=1.5", "data.max_bad_share")):
        with pytest.raises(UserError) as caught:
            validate(compose(["data=imagefolder", "data.root=/data", override]))
        assert caught.value.where == key


# -- failures inside loader workers ------------------------------------------------------------------------
class Failing(Dataset):
    def __init__(self, how: str) -> None:
        self.how = how

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        if self.how == "value":
            raise ValueError("label file has 3 columns\nexpected 2")
        if self.how == "user":
            raise UserError("data.labels", "no such column 'y'", "x, z")  # cannot be rebuilt from one string
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does
        return index


def _failure_of(dataset: Dataset, num_workers: int = 1) -> BaseException:
    batches = iter(DataLoader(dataset, batch_size=2, num_workers=num_workers,
                              timeout=WORKER_TIMEOUT_S if num_workers else 0))
    try:
        for _ in batches:
            pass
    except Exception as ex:  # noqa: BLE001 - the test inspects whatever the loader raised
        failure = ex
    else:
        raise AssertionError("the loader did not fail")
    finally:
        # The returned exception keeps the iterator alive through its traceback: stop its worker
        # now, not at some later garbage collection in the middle of another test's loader.
        getattr(batches, "_shutdown_workers", lambda: None)()
    return failure


@pytest.mark.timeout(60)
def test_a_bad_image_found_by_a_worker_is_one_line_naming_the_file(digits):
    cut = truncated_jpeg(digits / "val" / "digit_0" / "cut.jpg")
    dm = module(digits, bad_files="error")
    dm.setup()
    for workers in (1, 0):
        failure = _failure_of(dm.val_set, workers)
        assert isinstance(failure, BadImageError)  # rebuilt in this process from the worker's message
        report = loader_failure(failure)
        assert report is not None
        line = report.line()
        assert line.startswith(f"{cut}: truncated or corrupt (image file is truncated")
        assert "Traceback" not in line and "\n" not in line and "worker process" not in line
        assert failure.path == str(cut) and failure.reason == CORRUPT
        assert failure.detail.startswith("image file is truncated (") and failure.detail.endswith("not processed)")


@pytest.mark.timeout(60)
def test_an_exception_in_a_worker_is_one_line_with_the_hint():
    report = loader_failure(_failure_of(Failing("value")))
    assert report is not None
    assert report.line() == ("data.num_workers: loader worker process 0 raised ValueError: label file has 3 columns "
                             "expected 2; allowed: rerun with data.num_workers=0 to see the full traceback in the main "
                             "process")
    user = loader_failure(_failure_of(Failing("user")))  # a plain UserError arrives as RuntimeError
    assert user is not None and user.line() == "data.labels: no such column 'y'; allowed: x, z"


@pytest.mark.timeout(60)
def test_a_worker_that_dies_is_one_line_naming_the_signal():
    failure = _failure_of(Failing("kill"))
    assert isinstance(failure, RuntimeError) and "DataLoader worker" in str(failure)
    report = loader_failure(failure)
    assert report is not None
    line = report.line()
    assert line.startswith("data.num_workers: a loader worker process (pid ")
    assert "SIGKILL" in line and "/dev/shm" in line and "data.num_workers=0" in line and "\n" not in line


def test_the_killed_by_signal_message_is_recognized():
    # The other wording, from PyTorch's SIGCHLD handler when it sees the death first.
    report = loader_failure(RuntimeError("DataLoader worker (pid 4242) is killed by signal: Bus error. It is possible "
                                         "that dataloader's workers are out of shared memory."))
    assert report is not None and "pid 4242) was killed by SIGBUS (Bus error)" in report.line()
    code = loader_failure(RuntimeError("DataLoader worker (pid 7) exited unexpectedly with exit code 1. Details are "
                                       "lost due to multiprocessing."))
    assert code is not None and "exited with code 1" in code.line()


def test_other_failures_are_not_loader_failures():
    assert loader_failure(ValueError("shapes do not match")) is None
    assert loader_failure(RuntimeError("CUDA error: device-side assert triggered")) is None


def test_full_scan_finds_truncated_files_up_front(digits):
    cut = truncated_jpeg(digits / "train" / "digit_0" / "cut.jpg")
    header = module(digits, max_bad_share=0.5).inspect()
    full = module(digits, scan="full", max_bad_share=0.5)
    assert full.inspect().sizes["train"] == header.sizes["train"] - 1 == 12
    assert full.bad_files_summary()["by_reason"] == {CORRUPT: 1}
    with pytest.raises(BadImageError, match="found by the scan|truncated"):
        module(digits, scan="full", bad_files="error").inspect()
    assert str(cut) in check_files([str(cut)], "full")


def test_the_list_goes_to_lightnings_root_dir_when_the_run_named_no_folder(digits, tmp_path):
    from types import SimpleNamespace

    inject_bad_files(digits / "train" / "digit_0")
    dm = module(digits, max_bad_share=0.5)
    dm.trainer = SimpleNamespace(default_root_dir=str(tmp_path / "lightning"))
    dm.setup()
    assert len(read_list(tmp_path / "lightning" / "bad_files.tsv")) == 3
    assert dm.bad_files_summary()["list"] == str(tmp_path / "lightning" / "bad_files.tsv")


def test_a_library_that_accepts_truncated_images_is_noted(digits, monkeypatch):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    assert any("LOAD_TRUNCATED_IMAGES" in note for note in module(digits).inspect().notes)
