"""Images per host core and time to the first batch: an image folder against shards, local and on S3.

    .venv/bin/python benchmarks/shard_pipeline.py                  # 400 photos, 3 interleaved rounds
    .venv/bin/python benchmarks/shard_pipeline.py --write          # also benchmarks/results/shard_pipeline_cpu.md
    .venv/bin/python benchmarks/shard_pipeline.py --images 64 --rounds 1   # smoke check

The photos are the decode benchmark's (benchmarks/input_pipeline.py: 500x375 JPEGs at quality 90,
224 px training crops, ``data.decode=fast``, one loader worker, batches of 32). Pipelines:

- folder: ``data=imagefolder``, one file opened per sample;
- shards, local: ``data=shards`` on a folder of shards (read in place, no cache);
- shards, S3, first epoch: on the S3 test server (tests/s3_server.py: moto over HTTPS on the
  loopback address), with an empty cache, so every chunk is downloaded while the epoch runs;
- shards, S3, cached: the same source and cache again, every chunk already there.

Per core: the CPU seconds of the worker and of this process over the epoch's batches after the
first (from /proc/<pid>/stat), divided into the images delivered, as the decode benchmark counts.
Time to first batch: from asking the loader for an iterator to holding the first batch (worker
start, the index, the first chunk, decoding). A cold page cache is tried (``vm.drop_caches``,
root on bare metal); where the machine refuses it, the report says so and every pipeline reads
warm files. moto is a Python server on the same two cores, so the S3 rows bound what a remote store
costs the host, not what a production store's network gives.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402

from input_pipeline import SIZE, machine, make_folder  # noqa: E402
from trainer.infra.processes import cpu_seconds  # noqa: E402

PIPELINES = ("folder", "shards, local", "shards, S3, first epoch", "shards, S3, cached")
RESULTS = REPO / "benchmarks" / "results" / "shard_pipeline_cpu.md"


def drop_page_cache() -> bool:
    """Whether the kernel's page cache could be dropped (needs root and a kernel that allows it)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def folder_loader(root: Path, batch: int) -> Any:
    from trainer.data.imagefolder import ImageFolderDataModule

    module = ImageFolderDataModule(root=str(root), decode="fast", batch_size=batch, num_workers=1, pin_memory=False,
                                   persistent_workers=False, scan="off", image_size=SIZE)
    module.inspect()
    module.apply_loader(module.loader_settings(cuda=False))
    module.setup("fit")
    return module.train_dataloader()


def shard_loader(source: str, batch: int, cache: Path | None = None) -> Any:
    from trainer.data.shards import ShardsDataModule

    module = ShardsDataModule(source=source, decode="fast", batch_size=batch, num_workers=1, pin_memory=False,
                              image_size=SIZE, cache_dir=str(cache) if cache else None)
    module.inspect()
    module.apply_loader(module.loader_settings(cuda=False))
    module.setup("fit")
    return module.train_dataloader()


def loader_workers(parent: int, exclude: set[int]) -> list[int]:
    """The processes `parent` started, but for those in `exclude` (the S3 server): its loader workers.
    Read from /proc, because LitData's loader iterates through a generator that hides torch's
    iterator and its ``_workers``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        if int(fields[1]) == parent and pid not in exclude:
            found.append(pid)
    return found


def measure(loader: Any, exclude: set[int]) -> dict[str, float]:
    """One epoch: the time to its first batch, then images per host-CPU second over the rest."""
    started = time.perf_counter()
    iterator = iter(loader)
    first = next(iterator)
    to_first = time.perf_counter() - started
    me = os.getpid()
    pids = loader_workers(me, exclude)
    start_cpu, start = sum(cpu_seconds(p) for p in [me, *pids]), time.perf_counter()
    images, batches = 0, len(loader)
    for taken, batch in enumerate(iterator, start=2):
        images += len(batch[1])
        if taken == batches:  # before the iterator ends the epoch and its workers with it
            break
    cpu = sum(cpu_seconds(p) for p in [me, *pids]) - start_cpu
    wall = time.perf_counter() - start
    for _ in iterator:  # anything left (none: the epoch's length is known)
        pass
    del first
    return {"first_batch_s": to_first, "per_core": images / max(cpu, 1e-9), "wall": images / max(wall, 1e-9)}


def run(root: Path, shards: Path, s3_source: str, work: Path, rounds: int, batch: int,
        cold: bool, exclude: set[int]) -> tuple[dict[str, list[dict[str, float]]], bool]:
    torch.set_num_threads(1)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in PIPELINES}
    dropped = True
    for r in range(rounds):
        cache = work / f"cache{r}"
        makers: dict[str, Callable[[], Any]] = {
            "folder": lambda: folder_loader(root, batch),
            "shards, local": lambda: shard_loader(str(shards), batch),
            "shards, S3, first epoch": lambda cache=cache: shard_loader(s3_source, batch, cache),
            "shards, S3, cached": lambda cache=cache: shard_loader(s3_source, batch, cache),
        }
        # The S3 pair stays in order (the cached epoch reads what the first one fetched); the
        # other two swap places every round.
        order = list(PIPELINES) if r % 2 == 0 else ["shards, local", "folder", *PIPELINES[2:]]
        for name in order:
            if cold:
                dropped = drop_page_cache() and dropped
            results[name].append(measure(makers[name](), exclude))
            row = results[name][-1]
            print(f"round {r + 1}/{rounds} {name:<24} {row['per_core']:6.0f} img/s per core, first batch "
                  f"{row['first_batch_s']:.2f} s", flush=True)
    return results, cold and dropped


def table(results: dict[str, list[dict[str, float]]]) -> list[str]:
    folder = [r["per_core"] for r in results["folder"]]
    lines = ["| pipeline | img/s per host core (median, range) | vs folder | first batch, s (median, range) | "
             "img/s wall |", "|---|---|---|---|---|"]
    for name, rows in results.items():
        rates, firsts = [r["per_core"] for r in rows], [r["first_batch_s"] for r in rows]
        ratio = statistics.median(a / b for a, b in zip(rates, folder))
        lines.append(f"| {name} | {statistics.median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f}) | "
                     f"{ratio:.2f}x | {statistics.median(firsts):.2f} ({min(firsts):.2f}-{max(firsts):.2f}) | "
                     f"{statistics.median(r['wall'] for r in rows):,.0f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=400, help="training photos generated")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--batch", type=int, default=32, help="images per batch")
    parser.add_argument("--chunk-mb", type=int, default=4, help="shard chunk size (several chunks per epoch)")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each pipeline")
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.relative_to(REPO)}")
    parser.add_argument("--out", type=Path, help="write the report to this file as well")
    args = parser.parse_args(argv)
    command = "python benchmarks/shard_pipeline.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    from tests import s3_server
    from trainer.data.prepare_shards import prepare_shards

    with tempfile.TemporaryDirectory(prefix="shard-pipeline-") as temp:
        work = Path(temp)
        root = make_folder(work / "photos", args.images)
        server = s3_server.start(work)
        saved = dict(os.environ)
        try:
            os.environ.update(server.env())
            prepare_shards(root, str(work / "shards"), chunk_mb=args.chunk_mb, progress=False)
            s3_source = f"s3://{s3_server.BUCKET}/photos"
            prepare_shards(root, s3_source, chunk_mb=args.chunk_mb, progress=False)
            results, cold = run(root, work / "shards", s3_source, work, args.rounds, args.batch, args.cold,
                               {server.process.pid})
        finally:
            server.stop()
            os.environ.clear()
            os.environ.update(saved)
    page_cache = ("cold page cache before each pipeline" if cold else
                  "warm page cache (dropping it was refused here)" if args.cold else "warm page cache")
    text = "\n".join([f"Measured {time.strftime('%Y-%m-%d')} on {machine()}: {args.images} photos 500x375/375x500 "
                      f"JPEG q90, {SIZE} px crops (data.decode=fast), batch {args.batch}, one loader worker, "
                      f"chunks of {args.chunk_mb} MB, one epoch per pipeline per round, {args.rounds} interleaved "
                      f"rounds, {page_cache}.", "", *table(results), "", f"`{command.strip()}`"])
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.write:
        RESULTS.write_text("# Shards against an image folder: images per host core, time to first batch\n\n"
                           + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
