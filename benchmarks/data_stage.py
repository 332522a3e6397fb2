"""The data stage end to end: `train.py` on a real folder of JPEG photos, samples/s per way of
decoding them and with or without the copy overlap.

    .venv/bin/python benchmarks/data_stage.py --out DIR/data_stage.md --json DIR/data_stage.json   # one CUDA GPU
    .venv/bin/python benchmarks/data_stage.py --quick --out /tmp/data_stage.md                     # a few seconds on a CPU

It writes an ImageNet-like folder into a temporary directory (benchmarks/input_pipeline.py's
photos: scikit-learn's two bundled photos cut at random places and scales, flipped, colour-varied,
500x375 or 375x500, JPEG quality 90, 10 classes; nothing is downloaded), then trains ResNet-50 (bf16,
channels_last, fused SGD, no compile) on it with `data=imagefolder` for a fixed number of steps, once
per setting:

- `data.decode=fast data.copy_overlap=true`: decoded and cropped in the loader workers, each batch
  copied to the GPU on a side stream while the step before runs (the defaults on CUDA but the decode);
- `data.decode=fast data.copy_overlap=false`: the same, the copy in Lightning's own move;
- `data.decode=device data.copy_overlap=true`: the workers ship the JPEG bytes, nvjpeg decodes each
  batch on the GPU.

Each run's samples/s is the throughput meter's (the median window after 5 warm-up steps, device
synchronized; data wait included), with the GPU's mean utilisation over fit from the NVML sampler
(`callbacks=device_stats`) and the loader settings the plan chose (summary.json's `derived`). The
table's `vs first` column is each run against the first. `--quick`: a few dozen small photos, the
small CNN on the CPU; without CUDA data.decode=device decodes on the CPU in the training process
(the framework's own fallback: trainer/data/images.py, `resolve_decode`) and the copy overlap steps
aside (nothing to overlap), so the quick table checks the machinery, not the hardware.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from check_runs import all_ok, compare  # noqa: E402 - after the benchmarks folder is on the path
from input_pipeline import _photo  # noqa: E402 - the benchmark's ImageNet-like photos

RUNS = [("fast_overlap", ["data.decode=fast", "data.copy_overlap=true"]),
        ("fast_no_overlap", ["data.decode=fast", "data.copy_overlap=false"]),
        ("device_overlap", ["data.decode=device", "data.copy_overlap=true"])]
SHOW = ("data.decode", "data.copy_overlap", "data.num_workers", "data.pin_memory")

GPU_BASE = ["model=resnet50", "data=imagefolder", "data.batch_size=128", "optimizer=sgd",
            "precision=bf16_mixed", "precision.tf32=true", "precision.channels_last=true",
            "optimizer.implementation=fused", "compile=off", "callbacks=device_stats",
            "trainer.max_epochs=1", "trainer.limit_val_batches=0", "trainer.limit_test_batches=0",
            "trainer.num_sanity_val_steps=0", "checkpointing=off", "progress=off", "logger=csv"]
QUICK_BASE = ["model=small_cnn", "data=imagefolder", "data.batch_size=4", "data.image_size=32",
              "data.num_workers=1", "trainer.accelerator=cpu", "callbacks=device_stats",
              "trainer.max_epochs=1", "trainer.limit_val_batches=0", "trainer.limit_test_batches=0",
              "trainer.num_sanity_val_steps=0", "checkpointing=off", "progress=off", "logger=csv"]


def make_folder(root: Path, images: int, classes: int, size: tuple[int, int], processes: int) -> int:
    """`images` training photos (and a tenth as many for val/) in `classes` class folders, written
    by `processes` processes; landscape photos are `size`, portrait ones its transpose."""
    val = max(classes, images // 10)
    indices = list(range(images)) + [-1 - i for i in range(val)]
    processes = 1 if len(indices) < 200 else processes  # a few dozen: less than the processes' start
    jobs = [indices[k::processes] for k in range(processes)]
    if processes == 1:
        return sum(_write_list(str(root), job, classes, size) for job in jobs)
    with ProcessPoolExecutor(processes) as pool:
        return sum(pool.map(_write_list, [str(root)] * processes, jobs, [classes] * processes, [size] * processes))


def _write_list(root: str, indices: list[int], classes: int, size: tuple[int, int]) -> int:
    """One process's share: photo i >= 0 is train/ number i, i < 0 val/ number -i - 1."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = [Image.fromarray(a) for a in load_sample_images().images]
    small = tuple(size) != (500, 375)
    if small:  # cut from the photos shrunk so that their short side is 1.5x the cut's long side
        photos = [p.resize((round(p.width * 1.5 * max(size) / min(p.size)), round(p.height * 1.5 * max(size) / min(p.size))))
                  for p in photos]
    for i in indices:
        split, index = ("train", i) if i >= 0 else ("val", -i - 1)
        rng = np.random.default_rng(i + 10**6)
        photo = _small_photo(photos[index % len(photos)], rng, size) if small else _photo(photos[index % len(photos)], rng)
        folder = Path(root) / split / f"class{index % classes:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        photo.save(folder / f"{index:05d}.jpg", quality=90)
    return len(indices)


def _small_photo(source: Any, rng: Any, size: tuple[int, int]) -> Any:
    """`_photo` at another size: a random cut of `size` (or its transpose) from the shrunk photo."""
    width, height = size if rng.random() < 0.7 else size[::-1]
    left, top = int(rng.integers(0, source.width - width + 1)), int(rng.integers(0, source.height - height + 1))
    return source.crop((left, top, left + width, top + height))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few small photos, the small CNN on the CPU")
    parser.add_argument("--images", type=int, help="training photos (default 2,048; --quick 40)")
    parser.add_argument("--size", default=None, help="landscape photos' WIDTHxHEIGHT (default 500x375; --quick 64x48)")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--steps", type=int, help="training steps per run (default 16: 5 warm-up, one window of 10; "
                                                  "--quick 8)")
    parser.add_argument("--set", action="append", default=[], metavar="OVERRIDE", help="an override for every run")
    parser.add_argument("--root", type=Path, help="write the photos here and keep them (default: a temporary folder)")
    parser.add_argument("--runs-dir", type=Path, help="the run folders (default: under the photos' folder)")
    parser.add_argument("--out", type=Path, help="the Markdown table")
    parser.add_argument("--json", type=Path, help="every run's figures")
    parser.add_argument("--run-timeout", type=float, help="seconds one run may take")
    parser.add_argument("--in-process", action="store_true", help="every run in this interpreter (dry runs)")
    args = parser.parse_args(argv)
    images = args.images or (40 if args.quick else 2048)
    width, height = (int(v) for v in (args.size or ("64x48" if args.quick else "500x375")).split("x"))
    steps = args.steps or (8 if args.quick else 16)
    base = QUICK_BASE if args.quick else GPU_BASE
    with tempfile.TemporaryDirectory(prefix="data_stage_") as tmp:
        root = args.root or Path(tmp) / "photos"
        began = time.perf_counter()
        written = make_folder(root, images, args.classes, (width, height), os.cpu_count() or 1)
        made_s = time.perf_counter() - began
        print(f"{written} JPEGs ({width}x{height}) written to {root} in {made_s:.1f} s", flush=True)
        overrides = [f"data.root={root}", f"trainer.limit_train_batches={steps}", *args.set]
        header = (f"The data stage end to end: `train.py` with `data=imagefolder` on {images:,} JPEG photos "
                  f"({width}x{height} or {height}x{width}, quality 90, {args.classes} classes; written in {made_s:.0f} s), "
                  f"{steps} steps a run; samples/s: the throughput meter's median window after warm-up, data "
                  f"wait included. Base: `{' '.join(base)}`; per run: `{' '.join(shlex.quote(o) for o in overrides)}`.")
        extra: dict[str, Any] = {"images": images, "size": [width, height], "classes": args.classes, "steps": steps,
                                 "quick": args.quick, "write_s": round(made_s, 1)}
        rows = compare([(name, [*switch, *overrides]) for name, switch in RUNS], base,
                       args.runs_dir or Path(tmp) / "runs", args.out, args.json, args.run_timeout, args.in_process,
                       SHOW, header, extra)
    return 0 if all_ok(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
