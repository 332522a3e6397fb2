"""`python -m trainer.data.prepare`: a resized, resumable copy of an image folder."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trainer.data.badfiles import CORRUPT, EMPTY, LIST_NAME, NOT_AN_IMAGE, read_list
from trainer.data.prepare import SETTINGS_NAME, main, prepare
from trainer.infra.errors import UserError

REPO = Path(__file__).resolve().parents[2]
MAX_SIDE = 300


def noise(width: int, height: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    # Smooth gradients plus a little noise: JPEGs of realistic size, quick to encode.
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = (x * 255 // max(1, width - 1) + y * 255 // max(1, height - 1)) // 2
    pixels = base[..., None] + rng.integers(0, 32, (height, width, channels))
    return np.clip(pixels, 0, 255).astype(np.uint8)


def save(path: Path, image: Image.Image, fmt: str | None = None, **options: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format=fmt, **options)
    return path


def make_folder(root: Path) -> Path:
    """train/ and val/ with every case: large and small, JPEG and PNG, RGBA, 16-bit, CMYK, hidden files."""
    save(root / "train/cat/big.jpg", Image.fromarray(noise(900, 600)), quality=95)
    save(root / "train/cat/small.jpg", Image.fromarray(noise(200, 100, seed=1)))
    save(root / "train/dog/sub/wide.png", Image.fromarray(noise(1000, 400, seed=2)))
    save(root / "val/cat/alpha.png", Image.fromarray(noise(600, 600, 4, seed=3), mode="RGBA"))
    deep = (np.arange(800 * 400, dtype=np.uint32).reshape(400, 800) % 65536).astype(np.uint16)
    save(root / "val/dog/deep.png", Image.fromarray(deep))
    save(root / "val/dog/cmyk.jpg", Image.fromarray(noise(900, 600, seed=4)).convert("CMYK"))
    save(root / "train/cat/.DS_Store", Image.new("RGB", (4, 4)), fmt="PNG")
    save(root / "train/.cache/hidden.jpg", Image.new("RGB", (4, 4)))
    return root


def add_bad_files(root: Path) -> None:
    data = io.BytesIO()
    Image.fromarray(noise(900, 600, seed=5)).save(data, format="JPEG")
    (root / "train/dog/truncated.jpg").write_bytes(data.getvalue()[: len(data.getvalue()) // 2])
    small = io.BytesIO()
    Image.fromarray(noise(200, 150, seed=6)).save(small, format="JPEG")
    (root / "train/dog/small_truncated.jpg").write_bytes(small.getvalue()[: len(small.getvalue()) // 2])
    (root / "val/cat/empty.jpg").write_bytes(b"")
    (root / "val/cat/notes.txt").write_text("labels checked by hand\n")


def outputs(dst: Path) -> dict[str, bytes]:
    """Every file in DST that training would list, by relative path."""
    found = {}
    for parent, dirs, names in os.walk(dst):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if not name.startswith(".") and name != LIST_NAME:
                path = Path(parent, name)
                found[path.relative_to(dst).as_posix()] = path.read_bytes()
    return found


def hidden_leftovers(dst: Path) -> list[str]:
    return [name for _, _, names in os.walk(dst) for name in names if name.endswith(".tmp")]


def test_layout_names_sizes_formats_and_modes(tmp_path: Path) -> None:
    """Layout and names are mirrored without hidden files; large images get longer side N exactly and
    keep their format (RGBA and 16-bit PNG included); a CMYK JPEG becomes a readable RGB JPEG; a
    small image is byte-identical."""
    src = make_folder(tmp_path / "src")
    report = prepare(src, tmp_path / "dst", MAX_SIDE, workers=1, progress=False)
    dst = tmp_path / "dst"
    assert sorted(outputs(dst)) == ["train/cat/big.jpg", "train/cat/small.jpg", "train/dog/sub/wide.png",
                                    "val/cat/alpha.png", "val/dog/cmyk.jpg", "val/dog/deep.png"]
    expected = {"train/cat/big.jpg": ("JPEG", (300, 200)), "train/dog/sub/wide.png": ("PNG", (300, 120)),
                "val/cat/alpha.png": ("PNG", (300, 300)), "val/dog/deep.png": ("PNG", (300, 150)),
                "val/dog/cmyk.jpg": ("JPEG", (300, 200))}
    for name, (fmt, size) in expected.items():
        with Image.open(dst / name) as image:
            image.load()
            assert (image.format, image.size) == (fmt, size), name
            modes = {"val/cat/alpha.png": {"RGBA"}, "val/dog/deep.png": {"I;16", "I"}, "val/dog/cmyk.jpg": {"RGB"}}
            assert image.mode in modes.get(name, {"RGB"}), name
    assert (dst / "train/cat/small.jpg").read_bytes() == (src / "train/cat/small.jpg").read_bytes()
    assert (report.resized, report.copied, report.skipped, report.bad) == (5, 1, 0, [])
    assert report.bytes_after < report.bytes_before
    assert read_list(dst / LIST_NAME) == [] and (dst / LIST_NAME).read_text().startswith("split\t")


def test_resized_pixels_match_the_source(tmp_path: Path) -> None:
    """A resized JPEG shows the same picture (draft decoding and resize do not shift or darken it)."""
    src = tmp_path / "src"
    save(src / "train/a/gradient.jpg", Image.fromarray(noise(900, 600)), quality=95)
    prepare(src, tmp_path / "dst", MAX_SIDE, workers=1, progress=False)
    reference = Image.open(src / "train/a/gradient.jpg").convert("RGB").resize((300, 200), Image.BILINEAR)
    result = Image.open(tmp_path / "dst/train/a/gradient.jpg").convert("RGB")
    difference = np.abs(np.asarray(reference, np.int16) - np.asarray(result, np.int16))
    assert difference.mean() < 3


def test_a_root_that_is_a_split(tmp_path: Path) -> None:
    """Class folders directly under SRC are mirrored the same way; the split column is the class."""
    src = tmp_path / "src"
    save(src / "cat/a.png", Image.fromarray(noise(400, 100)))
    (src / "dog").mkdir()
    (src / "dog/readme.txt").write_text("x")
    report = prepare(src, tmp_path / "dst", 100, workers=1, progress=False)
    assert Image.open(tmp_path / "dst/cat/a.png").size == (100, 25)
    assert [(r.split, r.reason) for r in report.bad] == [("dog", NOT_AN_IMAGE)]


def test_bad_files_are_listed_not_written(tmp_path: Path) -> None:
    """A truncated JPEG (large and small), a zero-byte .jpg and a notes.txt are not written and are
    listed in DST/bad_files.tsv with their split and reason, readable by `badfiles.read_list`."""
    src = make_folder(tmp_path / "src")
    add_bad_files(src)
    report = prepare(src, tmp_path / "dst", MAX_SIDE, workers=1, progress=False)
    written = outputs(tmp_path / "dst")
    assert not {"train/dog/truncated.jpg", "train/dog/small_truncated.jpg", "val/cat/empty.jpg",
                "val/cat/notes.txt"} & set(written)
    listed = {Path(r.path).relative_to(src).as_posix(): (r.split, r.reason) for r in read_list(report.bad_list)}
    assert listed == {"train/dog/truncated.jpg": ("train", CORRUPT), "train/dog/small_truncated.jpg": ("train", CORRUPT),
                      "val/cat/empty.jpg": ("val", EMPTY), "val/cat/notes.txt": ("val", NOT_AN_IMAGE)}
    assert len(report.bad) == 4 and report.resized + report.copied == 6
    assert "4 bad files" in report.bad_line() and str(tmp_path / "dst" / LIST_NAME) in report.bad_line()


def test_resume_skips_present_files_and_removes_leftovers(tmp_path: Path) -> None:
    """A rerun after outputs were lost and a stale temporary file was left: the present files are
    skipped, the missing ones rewritten, the leftover removed, bad files listed again, and DST equals
    that of one clean run."""
    src = make_folder(tmp_path / "src")
    add_bad_files(src)
    prepare(src, tmp_path / "clean", MAX_SIDE, workers=1, progress=False)
    dst = tmp_path / "dst"
    prepare(src, dst, MAX_SIDE, workers=1, progress=False)
    (dst / "train/cat/big.jpg").unlink()
    (dst / "val/dog/deep.png").unlink()
    (dst / "val/dog/.x.123.tmp").write_bytes(b"half a file")
    report = prepare(src, dst, MAX_SIDE, workers=1, progress=False)
    assert (report.resized, report.copied, report.skipped, len(report.bad)) == (2, 0, 4, 4)
    assert hidden_leftovers(dst) == []
    assert outputs(dst) == outputs(tmp_path / "clean")
    assert len(read_list(dst / LIST_NAME)) == 4


def test_parallel_equals_serial(tmp_path: Path) -> None:
    """Two worker processes write the same files and report the same counts as one."""
    src = make_folder(tmp_path / "src")
    add_bad_files(src)
    one = prepare(src, tmp_path / "one", MAX_SIDE, workers=1, progress=False)
    two = prepare(src, tmp_path / "two", MAX_SIDE, workers=2, progress=False)
    assert outputs(tmp_path / "one") == outputs(tmp_path / "two")
    assert (one.resized, one.copied, len(one.bad)) == (two.resized, two.copied, len(two.bad))
    assert sorted(r.path for r in one.bad) == sorted(r.path for r in two.bad)


def test_other_settings_or_foreign_dst_are_refused(tmp_path: Path) -> None:
    """Resuming with another --max-side, or writing into a folder this command did not make, stops
    with a UserError instead of mixing sizes or files."""
    src = make_folder(tmp_path / "src")
    prepare(src, tmp_path / "dst", MAX_SIDE, workers=1, progress=False)
    assert (tmp_path / "dst" / SETTINGS_NAME).exists()
    with pytest.raises(UserError, match="prepared with --max-side 300 --quality 90, not --max-side 200"):
        prepare(src, tmp_path / "dst", 200, workers=1, progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other/file.jpg").write_bytes(b"x")
    with pytest.raises(UserError, match="did not write"):
        prepare(src, tmp_path / "other", MAX_SIDE, workers=1, progress=False)


@pytest.mark.parametrize("args, named", [
    (["{tmp}/missing", "{tmp}/dst", "--max-side", "300"], "SRC"),
    (["{tmp}/src", "{tmp}/dst", "--max-side", "0"], "--max-side"),
    (["{tmp}/src", "{tmp}/src/out", "--max-side", "300"], "DST"),
])
def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                 named: str) -> None:
    """A missing SRC, --max-side 0 and a DST inside SRC: exit code 2 and one line naming the argument."""
    save(tmp_path / "src/train/a/x.png", Image.new("RGB", (8, 8)))
    with pytest.raises(SystemExit) as ended:
        main([a.format(tmp=tmp_path) for a in args] + ["--quiet"])
    err = capsys.readouterr().err.strip()
    assert ended.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {named}: ") and "allowed:" in err
    assert not (tmp_path / "dst").exists()


def test_cli_prints_summary_and_bad_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run from the command line ends with the summary line and the line naming the bad-file list."""
    src = make_folder(tmp_path / "src")
    add_bad_files(src)
    assert main([str(src), str(tmp_path / "dst"), "--max-side", "300", "--workers", "1", "--quiet"]) == 0
    summary, bad = capsys.readouterr().out.strip().splitlines()
    assert "5 resized, 1 copied unchanged, 0 already present, 4 bad" in summary and " MB in DST" in summary
    assert bad == f"4 bad files (not written) listed in {tmp_path / 'dst' / LIST_NAME}"


@pytest.mark.slow
def test_killed_run_leaves_no_partial_file(tmp_path: Path) -> None:
    """SIGKILL in the middle of a command-line run, then a rerun: every file in DST decodes fully, no
    temporary file is left, and DST equals that of a clean run (if the run finished before the kill,
    the rerun is checked all the same)."""
    src = tmp_path / "src"
    encoded = io.BytesIO()
    Image.fromarray(noise(800, 600, seed=7)).save(encoded, format="PNG")
    for i in range(60):
        save_bytes = src / f"train/c{i % 3}/{i:02d}.png"
        save_bytes.parent.mkdir(parents=True, exist_ok=True)
        save_bytes.write_bytes(encoded.getvalue())
    dst = tmp_path / "dst"
    proc = subprocess.Popen([sys.executable, "-m", "trainer.data.prepare", str(src), str(dst), "--max-side", "64",
                             "--workers", "1", "--quiet"], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not outputs(dst) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    for content in outputs(dst).values():  # what the kill left: complete files only
        Image.open(io.BytesIO(content)).load()
    report = prepare(src, dst, 64, workers=1, progress=False)
    assert report.skipped + report.resized == 60 and report.bad == []
    assert hidden_leftovers(dst) == []
    prepare(src, tmp_path / "clean", 64, workers=1, progress=False)
    assert outputs(dst) == outputs(tmp_path / "clean")
