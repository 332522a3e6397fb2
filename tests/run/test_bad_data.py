"""Real short runs on an image folder with bad files: skipped and listed, or one line and exit code 2,
also when the file is found by a loader worker process, and never a hang."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import train_forked, write_digit_pngs
from tests.unit.test_badfiles import inject_bad_files, truncated_jpeg
from trainer.data.badfiles import CORRUPT, read_list

pytestmark = pytest.mark.run

RUN_TIMEOUT_S = 90


def _args(root: Path, *extra: str) -> list[str]:
    return ["data=imagefolder", f"data.root={root}", "data.image_size=16", "data.batch_size=8", "data.num_workers=0",
            "data.hflip=false", "trainer.max_epochs=1", "trainer.num_sanity_val_steps=0", "checkpointing=off",
            "progress=off", *extra]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "digits"
    write_digit_pngs(root, {"train": 6, "val": 2}, classes=range(4), size=16)
    return root


def _one_line_error(result, start: str) -> str:
    assert result.returncode == 2, result
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith(f"error: {start}"), result
    assert "Traceback" not in result.stderr + result.stdout, result
    return lines[-1]


def test_bad_files_are_skipped_and_listed(folder, tmp_path):
    expected = inject_bad_files(folder / "train" / "digit_3")
    (folder / "train" / "digit_3" / "cut.jpg").unlink()
    (folder / "val" / "digit_0" / "blank.jpeg").write_bytes(b"")
    result = train_forked(_args(folder, "data.max_bad_share=0.2"), tmp_path / "run", timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result
    rows = read_list(result.run_dir / "bad_files.tsv")
    assert sorted((r.split, Path(r.path).name, r.reason) for r in rows) == sorted(
        [("train", name, reason) for name, reason in expected.items()] + [("val", "blank.jpeg", "empty file")])
    summary = result.summary
    assert summary["status"] == "completed"
    assert summary["data"]["sizes"]["train"] == 24 and summary["data"]["sizes"]["val"] == 8
    assert any(note.startswith("4 unreadable files skipped") for note in summary["data"]["notes"]), summary["data"]
    bad = summary["data"]["bad_files"]
    assert bad["count"] == 4 and bad["policy"] == "skip" and bad["by_split"] == {"train": 3, "val": 1}
    assert bad["list"] == str(result.run_dir / "bad_files.tsv")
    assert "4 unreadable files in the image folder (skipped)" in result.stdout + result.stderr


def test_error_policy_stops_with_the_first_bad_file(folder, tmp_path):
    inject_bad_files(folder / "train" / "digit_1")
    result = train_forked(_args(folder, "data.bad_files=error"), tmp_path / "run", timeout=RUN_TIMEOUT_S)
    line = _one_line_error(result, str(folder / "train" / "digit_1" / "empty.png"))
    assert "empty file" in line and "data.bad_files=skip" in line
    assert not (result.run_dir / "summary.json").exists()


def test_too_large_a_share_of_bad_files_stops_the_run(folder, tmp_path):
    inject_bad_files(folder / "train" / "digit_1")
    result = train_forked(_args(folder), tmp_path / "run", timeout=RUN_TIMEOUT_S)  # default share: 1%
    line = _one_line_error(result, "data.max_bad_share: 3 of 28 files in train/ are unreadable (10.7%")
    assert "bad_files.tsv" in line


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_a_truncated_file_found_by_a_loader_worker_is_skipped_and_listed(folder, tmp_path):
    cut = truncated_jpeg(folder / "val" / "digit_2" / "cut.jpg")  # the header scan lets it through
    result = train_forked(_args(folder, "data.num_workers=1", "data.max_bad_share=0.2"), tmp_path / "run",
                          timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result
    rows = read_list(result.run_dir / "bad_files.tsv")
    assert [(r.split, r.path, r.reason) for r in rows] == [("val", str(cut), CORRUPT)]
    assert rows[0].detail.startswith("found while loading")
    assert f"skipped unreadable file {cut}" in result.stdout + result.stderr
    assert result.summary["data"]["sizes"]["val"] == 9  # counted by the scan, replaced when loaded
    # Found in the worker process, read back from the list by the training process:
    assert result.summary["data"]["bad_files"]["count"] == 1


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_error_policy_in_a_loader_worker_is_one_line_not_a_hang(folder, tmp_path):
    cut = truncated_jpeg(folder / "val" / "digit_2" / "cut.jpg")
    result = train_forked(_args(folder, "data.num_workers=1", "data.bad_files=error"), tmp_path / "run",
                          timeout=RUN_TIMEOUT_S)
    line = _one_line_error(result, f"{cut}: truncated or corrupt (image file is truncated")
    assert "worker process" not in line
    assert result.summary["status"] == "failed"
