"""Images in torchvision's ImageFolder layout: ``root/train/<class>/*``, ``root/val/<class>/*``
(and optionally ``test/``), robust to the bad files real folders hold.

Bad files are checked, skipped or refused as docs/reliability.md ("Bad data") describes; the
machinery is in `trainer.data.badfiles`."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Sequence

import torch
from PIL import ImageFile

from trainer.data.badfiles import (IMAGE_EXTENSIONS, BadFile, BadFileList, BadImageError, ImageFiles, check_splits,
                                   is_image_name, scan_threads)
from trainer.data.base import DataInfo, ImageRecord
from trainer.data.decode import JPEG_EXTENSIONS, DecodedFiles, EncodedFiles
from trainer.data.images import EncodedImagesData
from trainer.infra.errors import UserError
from trainer.infra.schema import FRACTION, Doc

log = logging.getLogger("trainer")

SPLITS = ("train", "val", "test")


def list_split(folder: Path) -> dict[str, list[str]]:
    """Every file per class sub-folder, sorted, sub-folders included (as torchvision's ImageFolder
    walks them). Hidden files and folders (a leading '.') are left out: ``.DS_Store``, ``.ipynb_checkpoints``."""
    classes: dict[str, list[str]] = {}
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if not entry.is_dir() or entry.name.startswith("."):
            continue
        files = []
        for parent, dirs, names in os.walk(entry.path, followlinks=True):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            files += [os.path.join(parent, n) for n in sorted(names) if not n.startswith(".")]
        classes[entry.name] = files
    return classes


@dataclass
class _Scanned:
    """What `inspect` learned of the folder: kept so a second call does not scan again."""

    root: Path
    scan: str
    splits: dict[str, Path]
    good: dict[str, dict[str, list[str]]]  # split -> class -> readable files
    bad: list[BadFile]
    totals: dict[str, int]
    seconds: float


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _names(names: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class ImageFolderDataModule(EncodedImagesData):
    """An image folder, decoded and cropped as `EncodedImagesData` says.
    Bad files: `bad_files` (skip | error), `max_bad_share` and `scan` (header | full | off); see
    ``conf/data/imagefolder.yaml``. Set `run_dir` before `inspect` to get ``bad_files.tsv`` there;
    `bad_files_summary` reports what was found, including files found later by loader workers."""

    def __init__(
        self,
        root: Annotated[Optional[str], Doc("the folder holding train/<class>/ and val/<class>/ "
                                           "(optionally test/)")] = None,
        bad_files: Annotated[Literal["skip", "error"], Doc("unreadable files (corrupt, truncated, not images): skip "
                                                           "them and list them in bad_files.tsv, or error: stop at "
                                                           "the first")] = "skip",
        max_bad_share: Annotated[float, FRACTION, Doc("more than this share of a split unreadable stops the "
                                                      "run")] = 0.01,
        scan: Annotated[Literal["header", "full", "off"], Doc("checks before training: header (open each file), "
                                                              "full (also decode it) or off (quoted in YAML)")] = "header",
        **images: Any,
    ) -> None:
        super().__init__(**images)
        if bad_files not in ("skip", "error"):
            raise UserError("data.bad_files", f"'{bad_files}' is not a policy", "skip, error")
        if scan not in ("header", "full", "off"):
            raise UserError("data.scan", f"'{scan}' is not a scan mode", "header, full, off")
        if not 0.0 <= float(max_bad_share) <= 1.0:
            raise UserError("data.max_bad_share", f"{max_bad_share} is not a share", "a number in [0, 1]")
        self.root = root
        self.bad_files = bad_files
        self.max_bad_share = float(max_bad_share)
        self.scan = scan
        self._classes: Optional[dict[str, int]] = None
        self._splits: dict[str, Path] = {}
        self._scanned: Optional[_Scanned] = None
        self._bad_list: Optional[BadFileList] = None
        self._notes: list[str] = []

    # -- before training ----------------------------------------------------------------------------
    def inspect(self) -> DataInfo:
        if self.root is None:
            raise UserError("data.root", "not set", "data.root=/path/to/dataset (an ImageNet-style folder with train/ and "
                            "val/ class folders), or data=synthetic for a throughput-only run")
        root = Path(self.root).expanduser()
        if not root.is_dir():
            raise UserError("data.root", f"'{root}' does not exist or is not a folder",
                            "a folder holding train/ and val/ class folders")
        self.check_image_settings()
        scanned = self._scanned
        if scanned is None or scanned.root != root or scanned.scan != self.scan:
            scanned = self._scan_folder(root)
            self._bad_list = BadFileList(self.bad_files, self.scan, self.max_bad_share, scanned.totals, scanned.bad)
            if self.run_dir is not None:
                self._bad_list.attach(Path(self.run_dir))
            self._notes = self._judge(scanned)
            self._scanned = scanned  # only once judged: a folder that failed fails again when asked again
        assert self._bad_list is not None
        if self.run_dir is not None and self._bad_list.path is None:
            self._bad_list.attach(Path(self.run_dir))
        self._splits = dict(scanned.splits)
        train_classes = sorted(c for c, files in scanned.good["train"].items() if files)
        self._classes = {name: i for i, name in enumerate(train_classes)}
        sizes = {split: sum(len(files) for c, files in classes.items() if c in self._classes)
                 for split, classes in scanned.good.items()}
        notes = list(self._notes)
        if "test" not in sizes:
            notes.insert(0, "no test/ folder: test metrics are measured on val/")
            sizes["test"] = sizes["val"]
        if scanned.bad:
            notes.append(self._bad_note(scanned.bad))
        return DataInfo(ImageRecord(3, (self.image_size, self.image_size)), sizes, len(train_classes), train_classes, notes,
                        sample_bytes=self.sample_bytes())

    def _scan_folder(self, root: Path) -> _Scanned:
        """List every split, check its files as `scan` says; stop on missing folders or no images."""
        splits: dict[str, Path] = {}
        listed: dict[str, dict[str, list[str]]] = {}
        for split in SPLITS:
            folder = root / split
            if not folder.is_dir():
                if split == "test":
                    continue
                raise UserError("data.root", f"'{folder}' is missing",
                                "a folder with train/ and val/ (and optionally test/) sub-folders of classes")
            listed[split] = list_split(folder)
            if not any(is_image_name(f) for files in listed[split].values() for f in files):
                raise UserError("data.root", f"no images ({', '.join(IMAGE_EXTENSIONS)}) in class folders under '{folder}'",
                                f"{folder}/<class>/<image>")
            splits[split] = folder
        started = time.perf_counter()
        good, bad = check_splits(listed, self.scan)
        seconds = time.perf_counter() - started
        totals = {split: sum(len(files) for files in classes.values()) for split, classes in listed.items()}
        if self.scan != "off":
            log.info("data.scan=%s: %s checked in %.1f s (%d threads), %d unreadable", self.scan,
                     _plural(sum(totals.values()), "file"), seconds, scan_threads(), len(bad))
        return _Scanned(root, self.scan, splits, good, bad, totals, seconds)

    def _judge(self, scanned: _Scanned) -> list[str]:
        """Apply the policy and the share limit to the scan's findings; the notes for DataInfo."""
        assert self._bad_list is not None
        bad = scanned.bad
        if bad:
            listed = (f"listed in {self._bad_list.path}" if self._bad_list.path
                      else "list kept in memory (no run folder)")
            log.warning("%s in the image folder (%s): %s", _plural(len(bad), "unreadable file"),
                        "skipped" if self.bad_files == "skip" else "data.bad_files=error", listed)
        if bad and self.bad_files == "error":
            more = f"{_plural(len(bad) - 1, 'more unreadable file')} " + (
                f"listed in {self._bad_list.path}" if self._bad_list.path else "found by the scan")
            raise BadImageError(bad[0].path, bad[0].reason, bad[0].detail, note=more if len(bad) > 1 else "")
        for split in scanned.totals:
            self._bad_list.check_share(split)
        notes = []
        if ImageFile.LOAD_TRUNCATED_IMAGES:
            notes.append("PIL's ImageFile.LOAD_TRUNCATED_IMAGES was switched on by another library: truncated "
                         "images are filled with grey and trained on instead of being skipped")
        train = scanned.good["train"]
        empty = [name for name, files in train.items() if not files]
        if len(empty) == 1:
            notes.append(f"class folder '{empty[0]}' in train/ has no readable images: left out")
        elif empty:
            notes.append(f"{len(empty)} class folders in train/ have no readable images, left out: {_names(empty)}")
        classes = [name for name, files in train.items() if files]
        for split, by_class in scanned.good.items():  # train/ first; its own classes are neither extra nor missing
            present = {name for name, files in by_class.items() if files}
            if not present:
                raise UserError("data.root", f"no readable images in the class folders under '{scanned.splits[split]}' "
                                f"({self._bad_list.where_listed(split)})", "a folder of readable images")
            extra = sorted(present - set(classes))
            if extra:
                unreadable = [name for name in extra if name in train]
                why = " (their train/ files are all unreadable)" if unreadable == extra else ""
                raise UserError(str(scanned.splits[split]),
                                f"classes with no training images{why}: {', '.join(extra[:5])}",
                                "the class folders of train/ (or a subset)")
            missing = [name for name in classes if name not in present]
            if missing:
                notes.append(f"{_plural(len(missing), 'class')} of train/ with no readable images in {split}/ "
                             f"(not measured there): {_names(missing)}")
        return notes

    def _bad_note(self, bad: list[BadFile]) -> str:
        assert self._bad_list is not None
        splits = Counter(b.split for b in bad)
        by_split = ", ".join(f"{split} {splits[split]}" for split in SPLITS if split in splits)
        by_reason = ", ".join(f"{reason} {n}" for reason, n in sorted(Counter(b.reason for b in bad).items()))
        where = f": listed in {self._bad_list.path}" if self._bad_list.path else ""
        return f"{_plural(len(bad), 'unreadable file')} skipped (by split: {by_split}; by reason: {by_reason}){where}"

    def bad_files_summary(self) -> dict[str, Any]:
        """What was found unreadable: by the scan and since, while loading (also in worker processes,
        read back from ``bad_files.tsv``), each file counted once. For summary.json's data.bad_files."""
        if self._bad_list is None:  # not inspected: nothing found
            return BadFileList(self.bad_files, self.scan, self.max_bad_share, {}, []).summary()
        summary = self._bad_list.summary()
        if self._scanned is not None:
            summary["scan_seconds"] = round(self._scanned.seconds, 3)
        return summary

    def _jpeg_share(self) -> float:
        if self._scanned is None:
            return 0.0
        files = [f for classes in self._scanned.good.values() for names in classes.values() for f in names]
        return sum(f.lower().endswith(JPEG_EXTENSIONS) for f in files) / max(1, len(files))

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        if self._classes is None:
            self.inspect()
        assert self._classes is not None and self._scanned is not None and self._bad_list is not None
        if self._bad_list.path is None:
            # A run that did not name its folder before `inspect`: Lightning's default_root_dir is
            # where the run writes everything else, so the list goes there before workers append to it.
            folder = self.run_dir or getattr(self.trainer, "default_root_dir", None)
            if folder is not None:
                path = self._bad_list.attach(Path(folder))
                if self._scanned.bad:
                    log.warning("%s listed in %s", _plural(len(self._scanned.bad), "unreadable file"), path)
        classes = list(self._classes)
        if self.decode_in_use is None:  # used on its own, not by a run (which applies its plan's mode)
            self.apply_decode(self.resolve_decode(cuda=torch.cuda.is_available())[0])

        def make(split: str, train: bool) -> ImageFiles:
            assert self._scanned is not None and self._classes is not None and self._bad_list is not None
            samples = [(path, self._classes[name]) for name, files in self._scanned.good[split].items()
                       if name in self._classes for path in files]
            if self.decode_in_use == "pil":
                files = ImageFiles(split, samples, classes, self.pil_transforms(train), self.bad_files, self._bad_list)
                if train and self.resize is not None:
                    files.transforms_by_size = self.pil_transforms_by_size()
                return files
            if self.decode_in_use == "fast":
                return DecodedFiles(split, samples, classes, policy=self.bad_files, bad_list=self._bad_list,
                                    geometry=self.geometry(train), augment=self.host_augment() if train else None)
            return EncodedFiles(split, samples, classes, policy=self.bad_files, bad_list=self._bad_list,
                                geometry=self.geometry(train))

        self.train_set = make("train", True)
        self.val_set = make("val", False)
        self.test_set = make("test", False) if "test" in self._splits else self.val_set
