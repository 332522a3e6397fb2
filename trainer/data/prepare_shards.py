"""An image folder written once as shards: ``python -m trainer.data.prepare SRC DST --format shards``.

In LitData's format (``optimize``, resumable with ``use_checkpoint``), read by ``data=shards``
(trainer/data/shards.py). Why shards, why LitData and what a shard holds are in docs/data.md.
The samples of a split are written in an order shuffled once with a fixed seed, so that each chunk
holds every class (LitData shuffles chunks and items within a window, not the whole split).
``DST/dataset.json`` is written last, when every split is complete: a reader that finds it finds
whole shards."""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from trainer.data.badfiles import LIST_HEADER, BadFile, check_splits
from trainer.data.decode import JPEG_EXTENSIONS
from trainer.data.imagefolder import SPLITS, list_split
from trainer.infra.devices import usable_cpus
from trainer.data.object_store import check_reachable, is_remote, join, read_json, storage_options, write_json
from trainer.data.resizing import image_bytes
from trainer.infra.atomic import write_text_atomic
from trainer.infra.errors import UserError

DATASET_NAME = "dataset.json"
CLAIM_NAME = "prepare.json"
FORMAT = "litdata"
#: The order samples are written in; fixed, so that a resumed run writes what the killed one began.
WRITE_ORDER_SEED = 0


@dataclass
class ShardReport:
    dst: str
    sizes: dict[str, int] = field(default_factory=dict)
    bad: list[BadFile] = field(default_factory=list)
    skipped_splits: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        sizes = ", ".join(f"{split} {n}" for split, n in self.sizes.items())
        resumed = f" ({', '.join(self.skipped_splits)} already complete)" if self.skipped_splits else ""
        return (f"wrote shards of {sum(self.sizes.values())} images to {self.dst} in {self.seconds:.1f} s: {sizes}"
                f"{resumed}; {len(self.bad)} bad files left out")


class ShardSample:
    """What LitData's workers call on each input: the sample's dict (top-level and picklable)."""

    def __init__(self, max_side: Optional[int], quality: int) -> None:
        self.max_side = max_side
        self.quality = quality

    def __call__(self, item: list[Any]) -> dict[str, Any]:
        split, path, label, index, name = item
        made = image_bytes(split, path, self.max_side, self.quality)
        if isinstance(made, BadFile):  # checked before writing: only a file changed since then gets here
            raise UserError(path, f"became unreadable while shards were written ({made.reason}: {made.detail})",
                            "a folder that does not change while it is written; rerun to carry on")
        return {"image": made[1], "label": label, "index": index, "name": name}


def prepare_shards(src: Path, dst: str, max_side: Optional[int] = None, quality: int = 90,
                   workers: Optional[int] = None, chunk_mb: int = 64, endpoint_url: Optional[str] = None,
                   progress: bool = True) -> ShardReport:
    """Write SRC's splits as LitData shards under DST (see the module docstring)."""
    started = time.perf_counter()
    src = _checked(Path(src), dst, max_side, chunk_mb)
    settings = {"format": FORMAT, "max_side": max_side, "quality": quality, "chunk_mb": chunk_mb}
    check_reachable(dst, endpoint_url)
    done = read_json(dst, DATASET_NAME, endpoint_url)
    claim = read_json(dst, CLAIM_NAME, endpoint_url)
    if claim is not None and claim != settings:
        raise UserError("DST", f"'{dst}' was written with {claim}, not {settings}",
                        "the same --max-side, --quality and --chunk-mb to finish it, or a new DST")
    if claim is None and not is_remote(dst) and Path(dst).exists() and any(Path(dst).iterdir()):
        raise UserError("DST", f"'{dst}' holds files this command did not write",
                        "a new or empty folder, or the DST of an unfinished run to resume it")
    write_json(dst, CLAIM_NAME, settings, endpoint_url)
    report = ShardReport(dst)
    splits, classes, bad = _listed(src)
    report.bad = bad
    for split, samples in splits.items():
        report.sizes[split] = len(samples)
        if done is not None or read_json(join(dst, split), "index.json", endpoint_url) is not None:
            report.skipped_splits.append(split)
            continue
        _write_split(src, split, samples, join(dst, split), ShardSample(max_side, quality), workers or usable_cpus(),
                     chunk_mb, endpoint_url, progress)
    jpegs = sum(path.lower().endswith(JPEG_EXTENSIONS) for samples in splits.values() for path, _ in samples)
    total = sum(report.sizes.values())
    write_json(dst, "bad_files.json", [record.__dict__ for record in bad], endpoint_url)
    write_json(dst, DATASET_NAME, {**settings, "classes": classes, "sizes": report.sizes,
                                   "jpeg_share": round(jpegs / max(1, total), 4), "bad_files": len(bad)},
               endpoint_url)
    if not is_remote(dst):
        write_text_atomic(Path(dst) / "bad_files.tsv", LIST_HEADER + "".join(record.tsv_line() for record in bad))
    report.seconds = time.perf_counter() - started
    return report


def _checked(src: Path, dst: str, max_side: Optional[int], chunk_mb: int) -> Path:
    if max_side is not None and max_side < 1:
        raise UserError("--max-side", f"{max_side} is not a size", "a whole number of pixels >= 1, e.g. 500")
    if chunk_mb < 1:
        raise UserError("--chunk-mb", f"{chunk_mb} is not a chunk size", "1 or more MB (LitData suggests 64-256)")
    if not (src / "train").is_dir() or not (src / "val").is_dir():
        raise UserError("SRC", f"'{src}' has no train/ and val/ folders",
                        "an image folder: SRC/train/<class>/<image> and SRC/val/<class>/<image>")
    if not is_remote(dst):
        target = Path(dst).resolve()
        if target == src.resolve() or src.resolve() in target.parents:
            raise UserError("DST", f"'{dst}' is inside SRC '{src}'", "a folder outside SRC")
    return src.resolve()


def _listed(src: Path) -> tuple[dict[str, list[tuple[str, int]]], list[str], list[BadFile]]:
    """Each split's readable (file, label) pairs in the image-folder source's order, the class names
    (train/'s classes with a readable image), and the unreadable files."""
    good, bad = check_splits({split: list_split(src / split) for split in SPLITS if (src / split).is_dir()}, "full")
    classes = [name for name, files in good["train"].items() if files]
    if not classes:
        raise UserError("SRC", f"no readable images under '{src / 'train'}'", "a folder of readable images")
    label = {name: i for i, name in enumerate(classes)}
    splits = {split: [(path, label[name]) for name, files in by_class.items() if name in label for path in files]
              for split, by_class in good.items()}
    return splits, classes, bad


def _write_split(src: Path, split: str, samples: list[tuple[str, int]], output: str, sample: ShardSample, workers: int,
                 chunk_mb: int, endpoint_url: Optional[str], progress: bool) -> None:
    import litdata

    inputs = [[split, path, label, index, os.path.relpath(path, src)] for index, (path, label) in enumerate(samples)]
    random.Random(WRITE_ORDER_SEED).shuffle(inputs)
    methods = multiprocessing.get_all_start_methods()
    if not is_remote(output):
        Path(output).mkdir(parents=True, exist_ok=True)
    # Lists, not tuples: LitData compares the inputs with the JSON of its checkpoint to resume.
    # Forked workers inherit the imports (spawned ones would import torch again, seconds each).
    with _staging_folders(output):
        litdata.optimize(fn=sample, inputs=inputs, output_dir=output, chunk_bytes=f"{chunk_mb}MB",
                         num_workers=max(1, min(workers, len(inputs))), use_checkpoint=True, reorder_files=False,
                         verbose=progress, storage_options=storage_options(endpoint_url),
                         start_method="fork" if "fork" in methods else None)


#: LitData's variables for the folders where it stages a remote output's chunks (and its inputs).
STAGING_VARIABLES = ("DATA_OPTIMIZER_CACHE_FOLDER", "DATA_OPTIMIZER_DATA_CACHE_FOLDER")


@contextlib.contextmanager
def _staging_folders(output: str) -> Iterator[None]:
    """LitData stages the chunks of a remote output in one folder per machine (`/tmp/chunks`) and
    empties it when its upload ends: two writes at once on one machine (two data sets, or a test
    beside another) delete each other's chunks. Deliberately replaced with one folder per
    destination, the same one when a killed write to it resumes; a folder the person set is kept."""
    if not is_remote(output) or any(os.environ.get(name) for name in STAGING_VARIABLES):
        yield
        return
    key = hashlib.sha256(output.encode()).hexdigest()[:16]
    root = Path(tempfile.gettempdir()) / f"trainer-shards-{key}"
    try:
        for name, sub in zip(STAGING_VARIABLES, ("chunks", "data")):
            os.environ[name] = str(root / sub)
        yield
    finally:
        for name in STAGING_VARIABLES:
            os.environ.pop(name, None)
