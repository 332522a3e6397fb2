"""The data stage, honestly: on a real folder of JPEG photos, is the run input-bound or compute-bound?

    .venv/bin/python benchmarks/data_stage.py --out DIR/data_stage.md --json DIR/data_stage.json   # one CUDA GPU
    .venv/bin/python benchmarks/data_stage.py --quick --out /tmp/data_stage.md                     # a few seconds on a CPU

It writes an ImageNet-like folder into a temporary directory (benchmarks/input_pipeline.py's photos:
scikit-learn's two bundled photos cut at random places and scales, flipped, colour-varied, 500x375 or
375x500, JPEG quality 90, 10 classes; nothing is downloaded; `--distinct` of them written, the rest of
the folder hard links to them: the loader decodes each file anew either way), then measures, in this
process, with ResNet-50 as benchmarks/practices.py's GPU base runs it (batch 128, bf16, TF32,
channels_last, fused SGD, no compile):

- **step alone**: the framework's training loop on device-made images of the same shape
  (`data=synthetic`): what the GPU can take;
- **loader alone**, per decode mode: batches from the data module's own training loader, moved to the
  device and finished there as a step receives them (`transfer_batch_to_device`, `finish_batch`: the
  copy, nvjpeg's decode for decode=device, normalization), with no training: what the input pipeline
  can give;
- **end to end**, per setting: the framework's training loop (`FrameworkLoop`: train.py's Trainer
  and callbacks) with `data=imagefolder`: `data.decode=fast` with and without `data.copy_overlap`,
  and `data.decode=device`.

Every measurement is timed by benchmarks/hand_loop.py's `time_windows` (the device synchronized and
the clock read at the start of a step) over 3 windows of 10 steps, after a warm-up that first drains
the loader's prefetch queue (workers x prefetch factor batches, made while the run started up: timed,
they would pass for a fast loader) and then 5 more steps. The folder holds enough files for the
warm-up and the windows in one epoch. A row's bound is the slower of its loader alone and the step
alone: input-bound when the loader gives fewer images/s than the step takes, compute-bound otherwise;
`of bound` is the end-to-end rate over that bound (near 1: the overlap of loading and compute works).
GPU utilisation: the NVML sampler's (`callbacks=device_stats`) summary of the end-to-end fit, as
summary.json's `device_utilisation` gives it.

`--quick`: a few dozen small photos, the small CNN on the CPU with one loader worker; without CUDA
data.decode=device decodes on the CPU in the training process (trainer/data/images.py, `resolve_decode`)
and the copy overlap steps aside, so the quick table checks the machinery, not the hardware.
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from hand_loop import FrameworkLoop, add_output_arguments, prepare_run, steps_for, time_windows, write_results  # noqa: E402
from input_pipeline import _photo  # noqa: E402 - the benchmark's ImageNet-like photos
from practices import merged  # noqa: E402

#: (row, its overrides); the loader alone runs for each decode mode, on the first row that has it.
RUNS = [("fast_overlap", ["data.decode=fast", "data.copy_overlap=true"]),
        ("fast_no_overlap", ["data.decode=fast", "data.copy_overlap=false"]),
        ("device_overlap", ["data.decode=device", "data.copy_overlap=true"])]
SHOW = ("data.decode", "data.copy_overlap", "data.num_workers", "data.prefetch_factor", "data.pin_memory")

COMMON = ["callbacks=device_stats", "trainer.max_epochs=1", "trainer.limit_val_batches=0",
          "trainer.limit_test_batches=0", "trainer.num_sanity_val_steps=0", "checkpointing=off", "progress=off",
          "logger=csv"]
GPU_BASE = ["model=resnet50", "data.batch_size=128", "optimizer=sgd", "precision=bf16_mixed", "precision.tf32=true",
            "precision.channels_last=true", "optimizer.implementation=fused", "compile=off", *COMMON]
QUICK_BASE = ["model=small_cnn", "data.batch_size=4", "data.num_workers=1", "trainer.accelerator=cpu", *COMMON]
#: The loader's largest prefetch queue with auto settings: 8 workers x a prefetch factor of 2.
MOST_QUEUED = 16


def make_folder(root: Path, images: int, classes: int, size: tuple[int, int], processes: int,
                distinct: Optional[int] = None) -> int:
    """`images` training photos (and a tenth as many for val/) in `classes` class folders: `distinct`
    of them written by `processes` processes, the others hard links to those (a file is decoded anew
    each time it is read, so a link costs the loader what its photo does). Landscape photos are `size`,
    portrait ones its transpose. Returns the files written or linked."""
    distinct = min(images, distinct or images)
    distinct -= distinct % classes if distinct > classes else 0  # a link's class is its photo's
    val = max(classes, images // 10)
    indices = list(range(distinct)) + [-1 - i for i in range(val)]
    processes = 1 if len(indices) < 200 else processes  # a few dozen: less than the processes' start
    jobs = [indices[k::processes] for k in range(processes)]
    if processes == 1:
        written = sum(_write_list(str(root), job, classes, size) for job in jobs)
    else:
        with ProcessPoolExecutor(processes) as pool:
            written = sum(pool.map(_write_list, [str(root)] * processes, jobs, [classes] * processes,
                                   [size] * processes))
    for index in range(distinct, images):
        source = index % distinct
        os.link(root / "train" / f"class{source % classes:02d}" / f"{source:05d}.jpg",
                root / "train" / f"class{index % classes:02d}" / f"{index:05d}.jpg")
    return written + images - distinct


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


class LoaderAlone:
    """The data module's training loader with no training: each step takes the next batch and moves
    and finishes it on the device as a training step would receive it (`run` as the loops have it)."""

    def __init__(self, datamodule: Any, device: Any) -> None:
        self.datamodule, self.device = datamodule, device
        datamodule.setup("fit")
        self.units_per_step = datamodule.batch_size

    def run(self, steps: int, on_step_start: Any = None) -> None:
        loader = self.datamodule.train_dataloader()
        batches = iter(loader)
        for index in range(steps):
            if on_step_start is not None:
                on_step_start(index)
            moved = self.datamodule.transfer_batch_to_device(next(batches), self.device, 0)
            self.datamodule.finish_batch(moved, training=True)
        del batches, loader  # the workers stop


def queued_batches(plan: Any) -> int:
    """Batches the loader prepares ahead: workers x prefetch factor (torch's default 2 when unset)."""
    loader = plan.loader
    return loader.num_workers * (loader.prefetch_factor or 2) if loader.num_workers else 0


def timed(loop: Any, steps: int, warmup: int, window: int, device: Any) -> dict[str, Any]:
    seconds = time_windows(loop, steps, warmup, window, device)
    rates = [loop.units_per_step * window / s for s in seconds]
    return {"samples_per_s": statistics.median(rates), "window_rates": rates}


def settings_of(plan: Any) -> dict[str, Any]:
    """The loader and decode settings the plan chose (summary.json's `derived` values)."""
    return {key: getattr(plan.derived.get(key), "value", None) for key in SHOW}


def device_label(device: Any) -> str:
    import torch

    from trainer.infra.fingerprint import cpu_name

    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def verdict(loader_rate: Optional[float], step_rate: Optional[float], end_to_end: Optional[float]) -> dict[str, Any]:
    """Which of the loader alone and the step alone bounds the run, and how near the run comes to it."""
    if not loader_rate or not step_rate:
        return {"bound": None, "of_bound": None}
    bound = "input-bound" if loader_rate < step_rate else "compute-bound"
    return {"bound": bound, "of_bound": end_to_end / min(loader_rate, step_rate) if end_to_end else None}


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _fmt(value: Any, pattern: str) -> str:
    return pattern.format(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def table(record: dict[str, Any], header: str) -> str:
    step = record.get("step_alone") or {}
    lines = [header, "", f"Step alone (device-made images): {_fmt(step.get('samples_per_s'), '{:,.0f}')} img/s"
             + (f" ({step['error']})" if step.get("error") else "") + ". "
             + "Loader alone: " + (", ".join(f"decode={mode} {_fmt(r.get('samples_per_s'), '{:,.0f}')} img/s"
                                               for mode, r in record.get("loader_alone", {}).items()) or "-") + ".",
             "",
             "| run | status | end to end img/s | loader alone | step alone | bound | of bound | GPU util | "
             + " | ".join(SHOW) + " |",
             "|---|---|---:|---:|---:|---|---:|---:|" + "---|" * len(SHOW)]
    for row in record["rows"]:
        util = row.get("device_utilisation") or {}
        settings = row.get("settings") or {}
        lines.append(f"| {row['name']} | {row['status']} | {_fmt(row.get('samples_per_s'), '{:,.0f}')} | "
                     f"{_fmt(row.get('loader_alone'), '{:,.0f}')} | {_fmt(row.get('step_alone'), '{:,.0f}')} | "
                     f"{row.get('bound') or '-'} | {_fmt(row.get('of_bound'), '{:.2f}')} | "
                     f"{_fmt(util.get('gpu_util_mean') if util.get('sampled') else None, '{:.0f}%')} | "
                     + " | ".join(str(settings.get(key, "-")) for key in SHOW) + " |")
    notes = [f"- {row['name']}: {row['error']}" for row in record["rows"] if row.get("error")]
    why = next(((row.get("device_utilisation") or {}).get("why") for row in record["rows"]
                if (row.get("device_utilisation") or {}).get("why")), None)
    if why:
        notes.append(f"- GPU utilisation {why}")
    return "\n".join(lines + ([""] + notes if notes else []))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few small photos, the small CNN on the CPU")
    parser.add_argument("--images", type=int, help="training files (default: enough for the warm-up, with the "
                                                   "largest auto prefetch queue, and the windows in one epoch)")
    parser.add_argument("--distinct", type=int, help="distinct photos among them (default 2,048; --quick 40)")
    parser.add_argument("--size", default=None, help="landscape photos' WIDTHxHEIGHT (default 500x375; --quick 64x48)")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--warmup", type=int, help="steps after the prefetch queue drained (default 5; --quick 2)")
    parser.add_argument("--window", type=int, help="steps a window (default 10; --quick 3)")
    parser.add_argument("--windows", type=int, default=3, help="timed windows a measurement (default 3)")
    parser.add_argument("--set", action="append", default=[], metavar="OVERRIDE", help="an override for every run")
    parser.add_argument("--root", type=Path, help="write the photos here and keep them (default: a temporary folder)")
    add_output_arguments(parser, "every measurement's figures", runs_dir_default="under the photos' folder")
    args = parser.parse_args(argv)
    quick = args.quick
    base = merged(QUICK_BASE if quick else GPU_BASE, args.set)
    batch = int(next(o.split("=", 1)[1] for o in base if o.startswith("data.batch_size=")))
    warmup_after = args.warmup if args.warmup is not None else (2 if quick else 5)
    window = args.window or (3 if quick else 10)
    most_queued = 2 if quick else MOST_QUEUED
    images = args.images or batch * (steps_for(args.windows, most_queued + warmup_after, window) + 2)
    distinct = args.distinct or (40 if quick else 2048)
    width, height = (int(v) for v in (args.size or ("64x48" if quick else "500x375")).split("x"))
    with tempfile.TemporaryDirectory(prefix="data_stage_") as tmp:
        root = args.root or Path(tmp) / "photos"
        runs_dir = args.runs_dir or Path(tmp) / "runs"
        began = time.perf_counter()
        files = make_folder(root, images, args.classes, (width, height), os.cpu_count() or 1, distinct)
        made_s = time.perf_counter() - began
        print(f"{images} training JPEG files and {files - images} for val/ ({min(distinct, images)} distinct training "
              f"photos, {width}x{height}) in {root} in "
              f"{made_s:.1f} s", flush=True)
        folder = ["data=imagefolder", f"data.root={root}", *(["data.image_size=32"] if quick else [])]
        record: dict[str, Any] = {"images": images, "distinct": min(distinct, images), "size": [width, height],
                                  "classes": args.classes, "quick": quick, "write_s": round(made_s, 1),
                                  "window": window, "windows": args.windows, "base": base, "loader_alone": {},
                                  "rows": []}
        header = (f"The data stage: {images:,} JPEG files ({record['distinct']:,} distinct photos, {width}x{height} or "
                  f"{height}x{width}, quality 90, {args.classes} classes; written in {made_s:.0f} s), the framework's "
                  f"loop in one process. Img/s: the median of {args.windows} windows of {window} steps, timed after "
                  f"the loader's prefetch queue drained and {warmup_after} more steps, device synchronized; data "
                  f"wait included. Base: `{' '.join(base)}`; per run: `{' '.join(shlex.quote(o) for o in folder)}` "
                  "and the run's switches.")

        def write() -> None:
            write_results(args.out, table(record, header), args.json, record)

        # The step alone: device-made images of the folder's training size, the same network and batch.
        step_steps = steps_for(args.windows, warmup_after, window)
        try:
            image_size = 32 if quick else 224  # data=imagefolder's training crop
            # The folder's loader keys mean nothing to device-made images (data=synthetic has none).
            model_only = [o for o in base if not o.startswith("data.") or o.startswith("data.batch_size=")]
            run = prepare_run(merged(model_only, ["data=synthetic", f"data.shape=[3,{image_size},{image_size}]",
                                                  f"data.train_samples={batch * (step_steps + 1)}"]),
                              runs_dir / "step_alone")
            loop = FrameworkLoop(run)
            record["device"] = device_label(loop.device)
            record["step_alone"] = timed(loop, step_steps, warmup_after, window, loop.device)
            del run, loop
        except Exception as ex:  # noqa: BLE001 - the end-to-end rows still run
            record["step_alone"] = {"error": f"{type(ex).__name__}: {ex}"[:600]}
        _free()
        print(f"step alone: {_fmt(record['step_alone'].get('samples_per_s'), '{:,.0f}')} img/s", flush=True)
        write()
        step_rate = record["step_alone"].get("samples_per_s")
        for name, switches in RUNS:
            overrides = merged(base, folder, switches)
            row: dict[str, Any] = {"name": name, "overrides": overrides, "status": "failed"}
            try:
                run = prepare_run(overrides, runs_dir / name)
                queue = queued_batches(run.plan)
                warmup = queue + warmup_after
                steps = steps_for(args.windows, warmup, window)
                row.update(settings=settings_of(run.plan), queued_batches=queue, warmup=warmup, steps=steps)
                decode = run.plan.decode
                loader = LoaderAlone(run.parts.datamodule, run.plan.device)
                if len(run.parts.datamodule.train_dataloader()) < steps:
                    raise ValueError(f"{len(run.parts.datamodule.train_dataloader())} batches an epoch, fewer than "
                                     f"the {steps} steps a measurement needs: give more --images")
                if decode not in record["loader_alone"]:
                    record["loader_alone"][decode] = {**timed(loader, steps, warmup, window, run.plan.device),
                                                      "run": name, "queued_batches": queue}
                    _free()
                framework = FrameworkLoop(run, meter_warmup=warmup)
                row.update(timed(framework, steps, warmup, window, run.plan.device), status="completed")
                from trainer.callbacks.utilisation import device_utilisation

                row["device_utilisation"] = device_utilisation(framework.trainer.callbacks)
                row["loader_alone"] = record["loader_alone"][decode].get("samples_per_s")
                row["step_alone"] = step_rate
                row.update(verdict(row["loader_alone"], step_rate, row["samples_per_s"]))
                del run, loader, framework
            except Exception as ex:  # noqa: BLE001 - one failed run is one failed row
                row["error"] = f"{type(ex).__name__}: {ex}"[:600]
            _free()
            record["rows"].append(row)
            print(f"{name}: {row['status']}" + (f", {row['samples_per_s']:,.0f} img/s end to end, loader alone "
                                                f"{_fmt(row.get('loader_alone'), '{:,.0f}')}, {row.get('bound')}"
                                                if row["status"] == "completed" else f": {row.get('error')}"),
                  flush=True)
            write()
    print(table(record, header))
    return 0 if record["rows"] and all(r["status"] == "completed" for r in record["rows"]) and \
        "error" not in record["step_alone"] else 1


if __name__ == "__main__":
    sys.exit(main())
