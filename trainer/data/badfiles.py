"""Unreadable files in an image folder: finding them, listing them, and loading around them.

Replaces torchvision's ``ImageFolder`` and ``pil_loader``, which crash on the first bad file deep in
a loader worker hours into a run, or (16-bit images) saturate to white; docs/reliability.md ("Bad
data") describes the behaviour. The errors survive PyTorch's worker re-raise (`WorkerSafeUserError`),
so a bad file found by a worker still ends the run with one line."""

from __future__ import annotations

import io
import logging
import os
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Optional, Sequence

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from trainer.infra.atomic import write_text_atomic
from trainer.infra.devices import usable_cpus
from trainer.infra.errors import UserError

log = logging.getLogger("trainer")

Policy = Literal["skip", "error"]
Scan = Literal["header", "full", "off"]

#: What PIL reads and image folders commonly hold; compared case-insensitively.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")

# Why a file is bad: a short fixed vocabulary, so the summary can count by reason; the exception's
# own text goes into the list's `detail` column.
NOT_AN_IMAGE = "not an image file"
EMPTY = "empty file"
UNIDENTIFIED = "not a readable image"
CORRUPT = "truncated or corrupt"
TOO_LARGE = "too large"
UNSUPPORTED = "unsupported image mode"
UNREADABLE = "cannot be read"
REASONS = (NOT_AN_IMAGE, EMPTY, UNIDENTIFIED, CORRUPT, TOO_LARGE, UNSUPPORTED, UNREADABLE)

LIST_NAME = "bad_files.tsv"
LIST_HEADER = "split\tpath\treason\tdetail\n"
SKIP_HINT = "data.bad_files=skip (unreadable files are left out and listed), or fix or remove the file"


def is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


# -- errors that survive a loader worker ------------------------------------------------------------
class WorkerSafeUserError(UserError):
    """A `UserError` that PyTorch can rebuild in the main process: torch's ``ExceptionWrapper.reraise``
    calls ``cls(message)`` with the formatted traceback as one string (a class that needs more
    arguments becomes a plain RuntimeError), so the constructor also takes that string and recovers
    the original line from the traceback's last line."""

    def __init__(self, where: str, problem: str | None = None, allowed: str | None = None) -> None:
        if problem is None:  # `where: problem` split at the first ": " rebuilds the same line
            where, sep, problem = original_line(where, type(self).__name__).partition(": ")
            if not sep:
                where, problem = "data", where
        super().__init__(where, problem, allowed)


def original_line(message: str, class_name: str) -> str:
    """The exception's own message inside a worker re-raise (``Caught X in DataLoader worker process
    N.\\nOriginal Traceback ...\\nmodule.X: message``), or `message` itself when it is not one."""
    if "Original Traceback" not in message and not message.startswith("Caught "):
        return message
    last = [line for line in message.splitlines() if line.strip()][-1].strip()  # there is one: the test above
    return re.sub(rf"^(?:[A-Za-z_]\w*\.)*{re.escape(class_name)}: ", "", last, count=1)


class BadImageError(WorkerSafeUserError):
    """A file that cannot be loaded as an image: ``BadImageError(path, reason, detail)``, or one
    message string (PyTorch's re-raise of an error from a loader worker)."""

    def __init__(self, path: str, reason: str | None = None, detail: str = "", note: str = "") -> None:
        if reason is None:
            line = original_line(path, type(self).__name__)
            own = line.removesuffix(f"; allowed: {SKIP_HINT}")
            match = re.match(rf"^(.*?): ({'|'.join(map(re.escape, REASONS))})(?: \((.*?)\))?(?:; .*)?$", own)
            self.path: str = match.group(1) if match else line.partition(": ")[0]
            self.reason: str = match.group(2) if match else ""
            self.detail: str = (match.group(3) or "") if match else ""
            super().__init__(line)
            return
        self.path, self.reason, self.detail = str(path), reason, detail
        problem = reason + (f" ({_clean(detail)})" if detail else "") + (f"; {note}" if note else "")
        super().__init__(str(path), problem, SKIP_HINT)


class BadShareError(WorkerSafeUserError):
    """More of a split's files are unreadable than ``data.max_bad_share`` allows."""


# -- loading ------------------------------------------------------------------------------------------
def load_rgb(path: str | os.PathLike[str], data: Optional[bytes | bytearray] = None,
             before_decode: Optional[Callable[[Image.Image], None]] = None) -> Image.Image:
    """The image at `path` decoded and converted to 8-bit RGB (see `to_rgb`). Unlike torchvision's
    ``pil_loader``, 16-bit images are not saturated, a failure names the file, and a truncated file
    is an error (``ImageFile.LOAD_TRUNCATED_IMAGES`` stays False). `data`: the file's bytes when the
    caller has read them; `before_decode`: called once the size is known, before the pixels are
    decoded (the fast path picks its crop and JPEG scale there)."""
    image = _open(str(path), decode=True, data=data, before_decode=before_decode)
    assert image is not None  # only decode=False gives None
    return image


def check_file(path: str, decode: bool) -> tuple[str, str] | None:
    """(reason, detail) when `path` is not a usable image, else None. Without `decode` only the
    header is read (cheap: catches non-images, empty files and wrong content); with it the whole
    image is decoded and converted (also catches truncated and corrupt data)."""
    if not is_image_name(path):
        return NOT_AN_IMAGE, _extension_detail(path)
    try:
        _open(path, decode=decode)
    except BadImageError as ex:
        return ex.reason, ex.detail
    return None


def read_bytes(path: str) -> bytearray:
    """The whole file, in a writable buffer (tensors can then share it without a copy); a file that
    cannot be read or is empty is a `BadImageError`."""
    try:
        with open(path, "rb") as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            filled = f.readinto(data)
    except OSError as ex:
        raise BadImageError(path, UNREADABLE, ex.strerror or str(ex)) from None
    if not data:
        raise BadImageError(path, EMPTY, "0 bytes")
    return data if filled == len(data) else data[:filled]


def _open(path: str, decode: bool, data: Optional[bytes | bytearray] = None,
          before_decode: Optional[Callable[[Image.Image], None]] = None) -> Image.Image | None:
    if data is not None:
        if not data:
            raise BadImageError(path, EMPTY, "0 bytes")
        f: Any = io.BytesIO(data)
    else:
        try:
            f = open(path, "rb")
        except OSError as ex:
            raise BadImageError(path, UNREADABLE, ex.strerror or str(ex)) from None
    with f:
        if data is None and os.fstat(f.fileno()).st_size == 0:
            raise BadImageError(path, EMPTY, "0 bytes")
        try:
            image = Image.open(f)
        except Image.DecompressionBombError as ex:
            raise BadImageError(path, TOO_LARGE, str(ex)) from None
        except Exception as ex:  # noqa: BLE001 - PIL's plugins raise OSError, SyntaxError, ValueError, struct.error ...
            raise BadImageError(path, _os_failure(ex) or UNIDENTIFIED, _pil_detail(ex)) from None
        if not decode:
            return None
        if before_decode is not None:
            before_decode(image)
        try:
            image.load()
        except Exception as ex:  # noqa: BLE001 - as above, from the decoders
            raise BadImageError(path, _os_failure(ex) or CORRUPT, _pil_detail(ex)) from None
        try:
            return to_rgb(image)
        except (ValueError, OSError, TypeError) as ex:
            raise BadImageError(path, UNSUPPORTED, f"mode {image.mode}: {ex}") from None


def _os_failure(ex: BaseException) -> str | None:
    """UNREADABLE for a failure of the file system (an errno: I/O error, a network share gone), as
    opposed to PIL's own OSErrors about the content ("image file is truncated"), which have none."""
    return UNREADABLE if isinstance(ex, OSError) and ex.errno is not None else None


def _extension_detail(path: str) -> str:
    extension = os.path.splitext(path)[1]
    return f"extension '{extension}' is not one of {' '.join(IMAGE_EXTENSIONS)}" if extension else "no extension"


def _pil_detail(ex: BaseException) -> str:
    return _clean(str(ex) or type(ex).__name__)


def _clean(text: str) -> str:
    # Details end up in one error line and in a tab-separated list: one line, no tabs, not endless.
    text = " ".join(str(text).split())
    return text if len(text) <= 200 else text[:197] + "..."


def to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB from any PIL mode: PIL's conversion for L, 1, CMYK, YCbCr and the like. Alpha is
    dropped, not composited, as torchvision's and timm's loaders do (palette transparency through
    RGBA, as PIL asks). 16-bit: the high byte (30000 of 65535 is mid-grey, not PIL's white); 32-bit
    integer (I): the same when every value is in 0..65535 (older PIL's 16-bit PNG, most 16-bit TIFFs),
    else stretched from minimum to maximum. Float (F): [0, 1] scaled by 255, any other range
    stretched; NaN becomes 0."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode == "I" or mode.startswith("I;16"):
        values = np.asarray(image).astype(np.int64)
        if values.size and values.min() >= 0 and values.max() <= 0xFFFF:
            return _grey_to_rgb((values >> 8).astype(np.uint8))
        return _grey_to_rgb(_stretch(values.astype(np.float64)))
    if mode == "F":
        values = np.nan_to_num(np.asarray(image, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
        if values.size and values.min() >= 0.0 and values.max() <= 1.0:
            return _grey_to_rgb(np.round(values * 255.0).astype(np.uint8))
        return _grey_to_rgb(_stretch(values))
    if mode == "PA" or (mode == "P" and "transparency" in image.info):
        return image.convert("RGBA").convert("RGB")
    return image.convert("RGB")


def _stretch(values: np.ndarray) -> np.ndarray:
    low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
    if high <= low:
        return np.zeros(values.shape, dtype=np.uint8)
    return np.round((values - low) * (255.0 / (high - low))).astype(np.uint8)


def _grey_to_rgb(values: np.ndarray) -> Image.Image:
    return Image.fromarray(np.ascontiguousarray(values), mode="L").convert("RGB")


# -- the scan ----------------------------------------------------------------------------------------
def scan_threads() -> int:
    """Opening files is I/O-bound and PIL releases the GIL while decoding: more threads than CPUs."""
    return min(8, usable_cpus() * 2)


def check_files(paths: Sequence[str], scan: Scan) -> dict[str, tuple[str, str]]:
    """The bad ones among `paths`: {path: (reason, detail)}. With scan ``off`` only the names are
    judged (a file without an image extension is bad); ``header`` opens each file; ``full`` decodes."""
    if scan == "off":
        return {p: (NOT_AN_IMAGE, _extension_detail(p)) for p in paths if not is_image_name(p)}
    decode = scan == "full"
    with ThreadPoolExecutor(max_workers=scan_threads(), thread_name_prefix="image-scan") as pool:
        results = pool.map(lambda p: check_file(p, decode), paths)
        return {p: r for p, r in zip(paths, results) if r is not None}


def check_splits(listed: dict[str, dict[str, list[str]]],
                 scan: Scan) -> tuple[dict[str, dict[str, list[str]]], list[BadFile]]:
    """`listed`'s files (split -> class -> files) checked as `scan` says: the readable ones in the
    same layout, and the others as records."""
    found = check_files([f for classes in listed.values() for files in classes.values() for f in files], scan)
    good = {split: {name: [f for f in files if f not in found] for name, files in classes.items()}
            for split, classes in listed.items()}
    bad = [BadFile(split, f, *found[f]) for split, classes in listed.items()
           for files in classes.values() for f in files if f in found]
    return good, bad


# -- the list ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BadFile:
    split: str
    path: str
    reason: str
    detail: str = ""

    def tsv_line(self) -> str:
        return "\t".join(_tsv_field(v) for v in (self.split, self.path, self.reason, self.detail)) + "\n"


def _tsv_field(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def _tsv_unfield(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"t": "\t", "n": "\n", "r": "\r"}.get(m.group(1), m.group(1)), value)


def read_list(path: Path) -> list[BadFile]:
    """The records of a ``bad_files.tsv``, first occurrence of each path only."""
    records: dict[str, BadFile] = {}
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    for line in text.splitlines()[1:]:
        fields = [_tsv_unfield(v) for v in line.split("\t")]
        if len(fields) < 3:
            continue  # a line cut short by a crash mid-write
        records.setdefault(fields[1], BadFile(*fields[:4]))
    return list(records.values())


class BadFileList:
    """The bad files of one data set: those the scan found and those found while loading; in
    ``bad_files.tsv`` too once `attach` has named the run folder. A file found later, possibly in a
    loader worker, is appended with one ``os.write`` on an ``O_APPEND`` descriptor (short lines from
    several processes do not interleave), and `records` reads the file back."""

    def __init__(self, policy: Policy, scan: Scan, max_share: float, totals: dict[str, int],
                 scanned: Iterable[BadFile]) -> None:
        self.policy, self.scan, self.max_share, self.totals = policy, scan, max_share, dict(totals)
        self.path: Optional[Path] = None
        self._records: dict[str, BadFile] = {}
        for record in scanned:
            self._records.setdefault(record.path, record)

    def attach(self, folder: Path) -> Path:
        """Write the list into `folder` (replacing an older one) and append to it from now on."""
        path = Path(folder) / LIST_NAME
        write_text_atomic(path, LIST_HEADER + "".join(r.tsv_line() for r in self._records.values()))
        self.path = path
        return path

    def records(self) -> list[BadFile]:
        if self.path is None:
            return list(self._records.values())
        merged = dict(self._records)
        for record in read_list(self.path):
            merged.setdefault(record.path, record)
        return list(merged.values())

    def record_found_while_loading(self, record: BadFile) -> None:
        """Add a file that failed to load (its detail is marked so in the list); stop the run when the
        split's share is now too large."""
        if record.path in self._records:
            return
        warning = record.detail
        record = BadFile(record.split, record.path, record.reason, f"found while loading: {record.detail}")
        self._records[record.path] = record
        if self.path is not None:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, record.tsv_line().encode("utf-8"))
            finally:
                os.close(fd)
        where = f"listed in {self.path}" if self.path else "no run folder: list kept in memory"
        log.warning("skipped unreadable file %s (%s%s): replaced by the next file of %s/; %s", record.path,
                    record.reason, f": {warning}" if warning else "", record.split, where)
        self.check_share(record.split)

    def check_share(self, split: str) -> None:
        count, total = sum(r.split == split for r in self.records()), self.totals.get(split, 0)
        if total and count / total > self.max_share:
            raise BadShareError("data.max_bad_share",
                                f"{count} of {total} files in {split}/ are unreadable ({count / total:.1%}, more than "
                                f"the {self.max_share:.1%} allowed): {self.where_listed(split)}",
                                "fix or remove the files, or raise data.max_bad_share (a share in [0, 1])")

    def where_listed(self, split: str | None = None) -> str:
        """``listed in PATH``; without a run folder, the first few files themselves."""
        if self.path is not None:
            return f"listed in {self.path}"
        first = [r.path for r in self.records() if split is None or r.split == split][:3]
        return "the first: " + ", ".join(first) if first else "none listed"

    def summary(self) -> dict[str, Any]:
        records = self.records()
        by_split = dict(Counter(r.split for r in records))
        shares = [by_split.get(s, 0) / n for s, n in self.totals.items() if n]
        return {"policy": self.policy, "scan": self.scan, "count": len(records),
                "share": round(max(shares, default=0.0), 6),
                "by_reason": dict(sorted(Counter(r.reason for r in records).items())), "by_split": by_split,
                "list": str(self.path) if self.path is not None else None}


# -- the data set ---------------------------------------------------------------------------------------
class ImageFiles(Dataset[tuple[Any, int]]):
    """(transformed image, label) for a list of files of one split, loaded with `load_rgb`.

    Policy ``skip``: a file that fails to load is listed in `bad_list` and its sample replaced by the
    next loadable index of the split (with that file's label), whichever worker or epoch met it, so
    runs stay reproducible; ``error``: the `BadImageError` stops the run. An item is an index,
    ``(index, sample_seed)`` or ``(index, sample_seed, size)`` (progressive resizing, `use_size`)."""

    #: Items arrive as (index, seed) and `load` draws from the seed (else `SeededSamples` seeds the
    #: global RNG around the call, which torchvision's random transforms use).
    takes_seeds = False

    def __init__(self, split: str, samples: Sequence[tuple[str, int]], classes: Sequence[str],
                 transform: Optional[Callable[[Image.Image], Any]], policy: Policy, bad_list: BadFileList) -> None:
        self.split = split
        self.samples = list(samples)
        self.targets = [label for _, label in self.samples]
        self.classes = list(classes)
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.transform, self.policy, self.bad_list = transform, policy, bad_list
        self._known_bad: set[int] = set()  # per process: a worker does not retry a file it saw fail
        #: Progressive resizing with decode=pil: the training pipeline per crop side.
        self.transforms_by_size: Optional[dict[int, Callable[[Image.Image], Any]]] = None

    def use_size(self, size: int) -> None:
        """Crop to `size` from now on (progressive resizing; the sampler sends the epoch's size)."""
        if self.transforms_by_size is None:
            raise RuntimeError(f"{type(self).__name__} of {self.split} was built without sized transforms")
        self.transform = self.transforms_by_size[size]

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int, seed: Optional[int]) -> Any:
        """Sample `index` from its file (`seed`: the sample's own, when `takes_seeds`)."""
        image = load_rgb(self.samples[index][0])
        return self.transform(image) if self.transform is not None else image

    def collate_fn(self) -> Optional[Callable[[list[Any]], Any]]:
        """The loader's collate function for these samples (None: PyTorch's default)."""
        return None

    def __getitem__(self, item: Any) -> tuple[Any, int]:
        if not isinstance(item, tuple):
            return self.first_loadable(item, None)
        index, seed, *size = item
        if size:
            self.use_size(size[0])
        return self.first_loadable(index, seed)

    def first_loadable(self, index: int, seed: Optional[int]) -> tuple[Any, int]:
        """The sample of `index`, or under policy skip that of the next loadable index after it."""
        count = len(self.samples)
        for step in range(count):
            candidate = (index + step) % count
            if candidate in self._known_bad:
                continue
            try:
                return self.load(candidate, seed), self.samples[candidate][1]
            except BadImageError as ex:
                self.found_bad(candidate, ex)
        raise BadShareError("data.root", f"no file of {self.split}/ can be loaded ({self.bad_list.where_listed()})",
                            "a folder of readable images")

    def found_bad(self, index: int, ex: BadImageError) -> None:
        """Policy error: raise `ex`; skip: remember and list the file."""
        if self.policy == "error":
            raise ex
        self._known_bad.add(index)
        self.bad_list.record_found_while_loading(BadFile(self.split, self.samples[index][0], ex.reason, ex.detail))
