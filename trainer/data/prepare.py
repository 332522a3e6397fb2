"""A resized copy of an image folder: ``python -m trainer.data.prepare SRC DST --max-side 500``
(``--format shards`` writes LitData shards instead: trainer/data/prepare_shards.py).

A raw photo folder holds 12-megapixel images, some 80 times the pixels of ImageNet's (about
400x350), which training throws away at its first resize to 224; shrinking the folder once makes
every epoch's decoding cheaper. What is written, and how a killed run resumes, is in docs/data.md
("Prepare a folder once"). SRC is walked as training walks it (`imagefolder.list_split`). Pixels
stay what training sees: no EXIF rotation, no metadata carried over, alpha kept where the format
stores it (training drops it)."""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import re
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, ContextManager, Iterable, Iterator, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text

from trainer.data.badfiles import LIST_HEADER, LIST_NAME, BadFile
from trainer.data.imagefolder import list_split
from trainer.infra.devices import usable_cpus
from trainer.data.resizing import image_bytes
from trainer.infra.atomic import replace_atomic, write_text_atomic
from trainer.infra.errors import UserError, one_line_on_user_error

SKIPPED, BAD = "skipped", "bad"
SETTINGS_NAME = ".prepare.json"
# `replace_atomic`'s temporary files: ``.<name>.<random>.tmp``, hidden so training never lists them.
_LEFTOVER = re.compile(r"^\..+\.tmp$")
_SRC_ALLOWED = "an image folder: SRC/<class>/<image>, or SRC/train/<class>/<image> and SRC/val/<class>/<image>"


@dataclass(frozen=True)
class _Task:
    split: str
    src: str
    dst: str


@dataclass(frozen=True)
class _Done:
    outcome: str
    bytes_before: int = 0
    bytes_after: int = 0
    bad: BadFile | None = None


@dataclass
class PrepareReport:
    """What one run did; bytes count every image in DST (this run's and those already present)."""

    src: Path
    dst: Path
    resized: int = 0
    copied: int = 0
    skipped: int = 0
    bad: list[BadFile] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    seconds: float = 0.0
    bad_list: Path | None = None

    @property
    def total(self) -> int:
        return self.resized + self.copied + self.skipped + len(self.bad)

    def add(self, done: _Done) -> None:
        if done.bad is not None:
            self.bad.append(done.bad)
            return
        setattr(self, done.outcome, getattr(self, done.outcome) + 1)
        self.bytes_before += done.bytes_before
        self.bytes_after += done.bytes_after

    def summary(self) -> str:
        return (f"prepared {self.total} files in {self.seconds:.1f} s: {self.resized} resized, {self.copied} copied "
                f"unchanged, {self.skipped} already present, {len(self.bad)} bad; images "
                f"{self.bytes_before / 1e6:,.1f} MB in SRC, {self.bytes_after / 1e6:,.1f} MB in DST")

    def bad_line(self) -> str:
        return f"{len(self.bad)} bad files (not written) listed in {self.bad_list}"


# -- one file (runs in a pool worker) ------------------------------------------------------------------
def prepare_file(task: _Task, max_side: int, quality: int) -> _Done:
    """Resize, copy, or find `task`'s file bad. Top-level so a process pool can send it to workers."""
    made = image_bytes(task.split, task.src, max_side, quality)
    if isinstance(made, BadFile):
        return _Done(BAD, bad=made)
    outcome, data = made
    replace_atomic(Path(task.dst), lambda tmp: tmp.write_bytes(data))
    return _Done(outcome, os.path.getsize(task.src), len(data))


# -- the folder ------------------------------------------------------------------------------------------
def prepare(src: Path, dst: Path, max_side: int, quality: int = 90, workers: int | None = None,
            progress: bool = True) -> PrepareReport:
    """Write SRC's images to DST with their longer side at most `max_side` (see the module docstring)."""
    started = time.perf_counter()
    src, dst = _checked(Path(src), Path(dst), max_side, quality, workers)
    tasks = list(_tasks(src, dst))
    _claim(dst, {"max_side": max_side, "quality": quality})
    _remove_leftovers(dst)
    report = PrepareReport(src, dst)
    todo = []
    for task in tasks:  # present files are complete: every write is a rename of a finished file
        if os.path.exists(task.dst):
            report.add(_Done(SKIPPED, os.path.getsize(task.src), os.path.getsize(task.dst)))
        else:
            todo.append(task)
    try:
        _run(todo, partial(prepare_file, max_side=max_side, quality=quality), workers or usable_cpus(), progress,
             report)
    except OSError as ex:  # from a write: a full disk, a folder that cannot be written
        raise UserError(str(ex.filename or dst), ex.strerror or str(ex),
                        "a DST that can be written, with free space") from None
    report.bad_list = dst / LIST_NAME  # replaced whole: files fixed in SRC since the last run drop out
    write_text_atomic(report.bad_list, LIST_HEADER + "".join(record.tsv_line() for record in report.bad))
    report.seconds = time.perf_counter() - started
    return report


def _checked(src: Path, dst: Path, max_side: int, quality: int, workers: int | None) -> tuple[Path, Path]:
    if max_side < 1:
        raise UserError("--max-side", f"{max_side} is not a size", "a whole number of pixels >= 1, e.g. 500")
    if not 1 <= quality <= 100:
        raise UserError("--quality", f"{quality} is not a JPEG quality", "1 to 100 (above 95 only grows files)")
    if workers is not None and workers < 1:
        raise UserError("--workers", f"{workers} is not a number of processes", "1 or more")
    if not src.is_dir():
        raise UserError("SRC", f"'{src}' {'is not a folder' if src.exists() else 'does not exist'}", _SRC_ALLOWED)
    if dst.exists() and not dst.is_dir():
        raise UserError("DST", f"'{dst}' is not a folder", "a new folder, or the DST of an earlier run")
    src, dst = src.resolve(), dst.resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise UserError("DST", f"'{dst}' and SRC '{src}' overlap", "a folder outside SRC that does not contain it")
    return src, dst


def _tasks(src: Path, dst: Path) -> Iterator[_Task]:
    listed = list_split(src)
    if not any(listed.values()):
        raise UserError("SRC", f"no files in the sub-folders of '{src}'", _SRC_ALLOWED)
    for top, paths in listed.items():
        for path in paths:
            yield _Task(top, path, str(dst / os.path.relpath(path, src)))


def _claim(dst: Path, settings: dict[str, int]) -> None:
    """Record the settings in DST; refuse a DST made with other settings, or not by this command."""
    marker = dst / SETTINGS_NAME
    if marker.exists():
        try:
            before = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            before = None
        if before != settings:
            raise UserError("DST", f"'{dst}' was prepared with {_flags(before)}, not {_flags(settings)}",
                            "the same --max-side and --quality to finish it, or a new DST")
        return
    if dst.exists() and any(not entry.name.startswith(".") for entry in os.scandir(dst)):
        raise UserError("DST", f"'{dst}' holds files this command did not write",
                        "a new or empty folder, or the DST of an unfinished run to resume it")
    write_text_atomic(marker, json.dumps(settings) + "\n")


def _flags(settings: object) -> str:
    if not isinstance(settings, dict):
        return "unknown settings"
    return " ".join(f"--{key.replace('_', '-')} {value}" for key, value in settings.items())


def _remove_leftovers(dst: Path) -> None:
    """Temporary files of a killed run: never renamed into place, so never complete."""
    for parent, _, names in os.walk(dst):
        for name in names:
            if _LEFTOVER.match(name):
                os.unlink(os.path.join(parent, name))


def _run(todo: list[_Task], work: Callable[[_Task], _Done], workers: int, progress: bool,
         report: PrepareReport) -> None:
    with _pool(workers if len(todo) > 1 else 1) as pool:
        # Submitted before the progress bar starts its refresh thread: forked workers start with no
        # other thread's state half-held. Chunks large enough to keep the inter-process traffic
        # small, small enough to balance the load.
        chunk = max(1, min(256, len(todo) // (workers * 16)))
        results: Iterable[_Done] = pool.map(work, todo, chunksize=chunk) if pool is not None else map(work, todo)
        with _bar(progress) as bar:
            bar_task = bar.add_task("prepare", total=report.total + len(todo), completed=report.total)
            for done in results:
                report.add(done)
                bar.advance(bar_task)


def _pool(workers: int) -> ContextManager[ProcessPoolExecutor | None]:
    if workers == 1:
        return contextlib.nullcontext()
    # Fork where there is one: the workers inherit the imports (spawn would import torch again in each).
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    return ProcessPoolExecutor(workers, mp_context=context)


class _RateColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        return Text(f"{task.speed:,.0f} files/s" if task.speed else "- files/s")


def _bar(enabled: bool) -> Progress:
    return Progress(TextColumn("prepare"), BarColumn(), MofNCompleteColumn(), _RateColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True), disable=not enabled)


# -- the command -----------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer.data.prepare",
                                     description="Write a copy of an image folder with smaller images, or as shards.")
    parser.add_argument("src", type=Path, metavar="SRC", help="the image folder (train/<class>/..., val/<class>/...)")
    parser.add_argument("dst", metavar="DST", help="the folder to write, or for shards also s3://bucket/prefix "
                        "(rerun to finish an interrupted run)")
    parser.add_argument("--format", choices=("folder", "shards"), default="folder",
                        help="folder: an image folder of the same layout (default); shards: LitData shards for "
                        "data=shards (trainer/data/prepare_shards.py)")
    parser.add_argument("--max-side", type=int, default=None, help="longer side in pixels of resized images (e.g. "
                        "500); required for a folder, optional for shards (default: the bytes as they are)")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality of resized JPEGs (default 90)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: the usable CPUs)")
    parser.add_argument("--chunk-mb", type=int, default=64, help="shards: the size of one chunk (default 64 MB)")
    parser.add_argument("--endpoint-url", default=None, help="shards on an S3-compatible store that is not AWS "
                        "(default: AWS_ENDPOINT_URL, else AWS)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(argv) if argv is not None else None)
    with one_line_on_user_error():
        if args.format == "shards":
            from trainer.data.prepare_shards import prepare_shards

            shards = prepare_shards(args.src, args.dst, args.max_side, args.quality, args.workers, args.chunk_mb,
                                    args.endpoint_url, progress=not args.quiet)
            print(shards.summary())
            return 0
        if args.max_side is None:
            raise UserError("--max-side", "not given", "the longer side in pixels of the copy, e.g. --max-side 500")
        if str(args.dst).startswith("s3://"):
            raise UserError("DST", f"'{args.dst}' is on object storage, where a folder copy is not written",
                            "a local folder, or --format shards")
        report = prepare(args.src, Path(args.dst), args.max_side, args.quality, args.workers, progress=not args.quiet)
    print(report.summary())
    print(report.bad_line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
