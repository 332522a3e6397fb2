"""Images per second per host core for each ``data.decode`` mode, next to torchvision's standard pipeline.

    .venv/bin/python benchmarks/input_pipeline.py                       # 400 photos, 5 interleaved rounds
    .venv/bin/python benchmarks/input_pipeline.py --write               # also the results page and docs/measured.md's table
    .venv/bin/python benchmarks/input_pipeline.py --images 64 --rounds 1 --batches 4   # smoke check

The folder is ImageNet-like: scikit-learn's two bundled photos (no download) cut at random places
and scales, flipped, with their colour varied, 500x375 or 375x500, re-encoded as JPEG quality 90
(flat synthetic colours would decode unrealistically fast). Training crops are 224 px.

Pipelines, each one loader worker feeding the benchmark's process, batches of 32:

- standard: torchvision's ImageFolder with the classification reference's PIL preset in the worker
  (RandomResizedCrop, RandomHorizontalFlip, PILToTensor, ToDtype float32, Normalize);
- with ``--augment``, also randaugment and trivialaugment: the fast mode with ``data.augment`` set so
  (RandAugment n2 m9, TrivialAugmentWide on each uint8 crop in the worker): what the policy costs;
- pil, fast, device: this framework's image-folder module with ``data.decode`` set so. The pil and
  fast modes ship uint8 crops (flip and normalization follow on the device); the device mode's
  workers ship the JPEG bytes and crop boxes, and its decoding is the device's work, so its host
  cost counts the loader only (the GPU side is timed by the prepared GPU check on a GPU machine).

Per core: the CPU seconds of the worker and of this process over the timed batches (from
/proc/<pid>/stat, so another program's load or a VM's stolen time does not count), divided into
the images delivered. The pipelines are interleaved in rounds; the table gives the median round
and the spread. Targets from issue 14: fast at least 2.0x standard; the device mode's host cost at
most 15% of the pil mode's.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image, ImageEnhance  # noqa: E402

from trainer.infra.processes import cpu_seconds  # noqa: E402

SIZE = 224
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
PIPELINES = ("standard", "pil", "fast", "device")
AUGMENTED = ("randaugment", "trivialaugment")  # --augment: the fast mode with data.augment set so
DESCRIPTIONS = {"standard": "torchvision ImageFolder + reference preset", "pil": "data.decode=pil",
                "fast": "data.decode=fast", "device": "data.decode=device (loader only)",
                "randaugment": "data.decode=fast data.augment=randaugment",
                "trivialaugment": "data.decode=fast data.augment=trivialaugment"}
TABLE_START, TABLE_END = "<!-- input-pipeline:start -->", "<!-- input-pipeline:end -->"
RESULTS = REPO / "benchmarks" / "results" / "input_pipeline_cpu.md"


# -- the folder ---------------------------------------------------------------------------------------
def make_folder(root: Path, images: int, classes: int = 10, seed: int = 0) -> Path:
    """`images` training photos in `classes` class folders (and a few for val/), cut from the bundled
    photos at random places and scales, flipped, colour-varied, saved at quality 90."""
    from sklearn.datasets import load_sample_images

    rng = np.random.default_rng(seed)
    photos = [Image.fromarray(a) for a in load_sample_images().images]
    for split, count in (("train", images), ("val", max(classes, images // 10))):
        for i in range(count):
            folder = root / split / f"class{i % classes:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            _photo(photos[i % len(photos)], rng).save(folder / f"{i:05d}.jpg", quality=90)
    return root


def _photo(source: Image.Image, rng: np.random.Generator) -> Image.Image:
    scale = rng.uniform(1.2, 2.0)
    big = source.resize((int(source.width * scale), int(source.height * scale)), Image.BICUBIC)
    width, height = (500, 375) if rng.random() < 0.7 else (375, 500)
    left, top = int(rng.integers(0, big.width - width + 1)), int(rng.integers(0, big.height - height + 1))
    photo = big.crop((left, top, left + width, top + height))
    if rng.random() < 0.5:
        photo = photo.transpose(Image.FLIP_LEFT_RIGHT)
    photo = ImageEnhance.Color(photo).enhance(rng.uniform(0.6, 1.4))
    return ImageEnhance.Brightness(photo).enhance(rng.uniform(0.8, 1.2))


# -- the pipelines -------------------------------------------------------------------------------------
def standard_loader(root: Path, batch: int) -> torch.utils.data.DataLoader:
    """torchvision's classification reference preset (PIL backend), as most scripts train."""
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    preset = v2.Compose([v2.RandomResizedCrop(SIZE, antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor(),
                         v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD), v2.ToPureTensor()])
    return torch.utils.data.DataLoader(ImageFolder(str(root / "train"), transform=preset), batch_size=batch,
                                       shuffle=True, num_workers=1, drop_last=True, persistent_workers=True)


def framework_loader(root: Path, batch: int, decode: str, augment: str = "none") -> torch.utils.data.DataLoader:
    from trainer.data.imagefolder import ImageFolderDataModule

    module = ImageFolderDataModule(root=str(root), decode=decode, batch_size=batch, num_workers=1, pin_memory=False,
                                   persistent_workers=True, scan="off", augment=augment)
    module.inspect()
    module.apply_loader(module.loader_settings(cuda=False))
    module.setup("fit")
    return module.train_dataloader()


# -- timing --------------------------------------------------------------------------------------------
def _batches(loader: torch.utils.data.DataLoader) -> Iterator[tuple[Any, list[int]]]:
    """Batches forever, with the pids of the loader's workers (a private attribute of the iterator)."""
    while True:
        iterator = iter(loader)
        pids = [w.pid for w in getattr(iterator, "_workers", [])]
        for batch in iterator:
            yield batch, pids


def measure(loader: torch.utils.data.DataLoader, batches: int, warmup: int = 3) -> dict[str, float]:
    """Images per host-CPU second and per wall second over `batches` batches after `warmup`.

    In steady state the worker runs ahead of this process by a constant number of batches, so the
    difference of its CPU time between two points is the cost of the batches taken in between."""
    stream = _batches(loader)
    for _ in range(warmup):
        _, pids = next(stream)
    me = os.getpid()
    start_cpu = sum(cpu_seconds(p) for p in [me, *pids])
    start = time.perf_counter()
    images = 0
    for _ in range(batches):
        batch, pids = next(stream)
        images += len(batch[1]) if isinstance(batch, (tuple, list)) else len(batch)
    wall = time.perf_counter() - start
    cpu = sum(cpu_seconds(p) for p in [me, *pids]) - start_cpu
    stream.close()
    return {"per_core": images / max(cpu, 1e-9), "wall": images / wall, "cpu_ms_per_image": 1000 * cpu / images}


def run(root: Path, rounds: int, batches: int, batch: int,
        augment: bool = False) -> dict[str, list[dict[str, float]]]:
    torch.set_num_threads(1)  # this process only takes batches; the workers have one thread each
    makers: dict[str, Callable[[], torch.utils.data.DataLoader]] = {
        "standard": lambda: standard_loader(root, batch),
        **{mode: (lambda mode=mode: framework_loader(root, batch, mode)) for mode in PIPELINES[1:]},
        **{policy: (lambda policy=policy: framework_loader(root, batch, "fast", policy)) for policy in AUGMENTED},
    }
    pipelines = PIPELINES + (AUGMENTED if augment else ())
    results: dict[str, list[dict[str, float]]] = {name: [] for name in pipelines}
    for r in range(rounds):
        order = pipelines if r % 2 == 0 else tuple(reversed(pipelines))  # no pipeline always first
        for name in order:
            loader = makers[name]()
            results[name].append(measure(loader, batches))
            del loader
            print(f"round {r + 1}/{rounds} {name:<9} {results[name][-1]['per_core']:7.0f} img/s per core "
                  f"({results[name][-1]['wall']:.0f} img/s wall)", flush=True)
    return results


def device_side(root: Path, batch: int, batches: int, device: torch.device) -> dict[str, float]:
    """The device mode's other half: batches already read by the loader are decoded, cropped and
    resized on `device` (`decode_batch`), timed with the device synchronized; with the training
    process's CPU seconds per image meanwhile (launching nvjpeg and the crops)."""
    from trainer.data.decode import decode_batch
    from trainer.data.imagefolder import ImageFolderDataModule

    module = ImageFolderDataModule(root=str(root), decode="device", batch_size=batch, num_workers=0, scan="off")
    module.inspect()
    module.apply_loader(module.loader_settings(cuda=device.type == "cuda"))
    module.setup("fit")
    loaded = [b for _, b in zip(range(batches + 2), module.train_dataloader())]
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for encoded in loaded[:2]:  # warm-up: nvjpeg's handles, the resize kernels
        decode_batch(encoded, module.train_set, device)
    synchronize()
    cpu, start = time.process_time(), time.perf_counter()
    for encoded in loaded[2:]:
        decode_batch(encoded, module.train_set, device)
    synchronize()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    images = sum(len(b) for b in loaded[2:])
    return {"images_per_s": images / wall, "host_cpu_ms_per_image": 1000 * cpu / images}


def device_lines(result: dict[str, float], device: torch.device) -> list[str]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "this CPU (no CUDA: the same code on the CPU)"
    return [f"- device mode, decode + crop + resize of prefetched batches on {name}: "
            f"{result['images_per_s']:,.0f} img/s; the training process's CPU meanwhile: "
            f"{result['host_cpu_ms_per_image']:.3f} ms per image"]


# -- the report ----------------------------------------------------------------------------------------
def table(results: dict[str, list[dict[str, float]]]) -> list[str]:
    standard = [r["per_core"] for r in results["standard"]]
    pil_cost = statistics.median(r["cpu_ms_per_image"] for r in results["pil"])
    lines = ["| pipeline | img/s per host core (median, range) | host ms per image | vs standard | vs pil host cost |",
             "|---|---|---|---|---|"]
    for name in results:
        rates = [r["per_core"] for r in results[name]]
        ratios = [a / b for a, b in zip(rates, standard)]
        cost = statistics.median(r["cpu_ms_per_image"] for r in results[name])
        lines.append(f"| {DESCRIPTIONS[name]} | {statistics.median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f}) | {cost:.2f} | "
                     f"{statistics.median(ratios):.2f}x | {cost / pil_cost:.0%} |")
    return lines


def verdicts(results: dict[str, list[dict[str, float]]]) -> list[str]:
    ratios = [f["per_core"] / s["per_core"] for f, s in zip(results["fast"], results["standard"])]
    ratio = statistics.median(ratios)
    share = (statistics.median(r["cpu_ms_per_image"] for r in results["device"])
             / statistics.median(r["cpu_ms_per_image"] for r in results["pil"]))
    return [f"- fast vs standard: {ratio:.2f}x per core, median of the rounds ({min(ratios):.2f}-{max(ratios):.2f}x; "
            f"target 2.0x: {'met' if ratio >= 2.0 else f'missed by {2.0 - ratio:.2f}x'})",
            f"- device host cost: {share:.0%} of pil's (target at most 15%: {'met' if share <= 0.15 else 'missed'})"]


def machine() -> str:
    model = ""
    try:
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
        model = match.group(1).strip() if match else ""
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs {model or platform.processor()}, torch {torch.__version__}, Python {platform.python_version()}"


def report(results: dict[str, list[dict[str, float]]], args: argparse.Namespace, command: str,
           extra: list[str]) -> str:
    return "\n".join([f"Measured {time.strftime('%Y-%m-%d')} on {machine()}: {args.images} photos 500x375/375x500 "
                      f"JPEG q90, {SIZE} px crops, batch {args.batch}, one loader worker, {args.batches} batches "
                      f"per pipeline per round, {args.rounds} interleaved rounds.", "", *table(results), "",
                      *verdicts(results), *extra, "", f"`{command}`"])


def write(text: str) -> None:
    RESULTS.write_text("# Input pipeline: images per host core\n\n" + text + "\n")
    page = REPO / "docs" / "measured.md"
    content = page.read_text()
    if TABLE_START in content and TABLE_END in content:
        head, rest = content.split(TABLE_START, 1)
        _, tail = rest.split(TABLE_END, 1)
        page.write_text(f"{head}{TABLE_START}\n{text}\n{TABLE_END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=400, help="training photos generated")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--batches", type=int, default=16, help="timed batches per pipeline per round")
    parser.add_argument("--batch", type=int, default=32, help="images per batch")
    parser.add_argument("--folder", type=Path, help="use (or make) the photo folder here instead of a temp one")
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.relative_to(REPO)} and docs/measured.md's table")
    parser.add_argument("--device-side", action="store_true",
                        help="also time the device mode's decoding on CUDA (on the CPU without one)")
    parser.add_argument("--out", type=Path, help="write the report to this file as well")
    parser.add_argument("--augment", action="store_true",
                        help="also time the fast mode with data.augment=randaugment and =trivialaugment")
    args = parser.parse_args(argv)
    command = "python benchmarks/input_pipeline.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    with tempfile.TemporaryDirectory(prefix="input-pipeline-") as temp:
        root = args.folder or Path(temp)
        if not (root / "train").is_dir():
            make_folder(root, args.images)
        results = run(root, args.rounds, args.batches, args.batch, args.augment)
        extra = []
        if args.device_side:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            extra = device_lines(device_side(root, args.batch, args.batches, device), device)
        text = report(results, args, command.strip(), extra)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.write:
        write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
