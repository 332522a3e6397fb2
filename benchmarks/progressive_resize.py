"""What each size of progressive resizing's default schedule costs: the input pipeline and the training step.

    .venv/bin/python benchmarks/progressive_resize.py                  # CPU: ResNet-18, 3 interleaved rounds
    .venv/bin/python benchmarks/progressive_resize.py --write          # also benchmarks/results/progressive_resize_cpu.md
    .venv/bin/python benchmarks/progressive_resize.py --device cuda --model resnet50 --batch 128 --write  # GPU
    .venv/bin/python benchmarks/progressive_resize.py --quick          # smoke check (CI)

The sizes are those of ``data.progressive_resize=true`` with the data module's defaults for a 224 px,
16-epoch run (``ImageFolderDataModule.resize_schedule``: 128, 160, 192 and 224 px). For each size,
interleaved in rounds (the order reversed every other round, so no size is always first):

- the input pipeline: images per host core of the image-folder module with progressive resizing on,
  its schedule applied (``apply_resize``) and the training sampler set to an epoch of that size;
  one loader worker, batches of 32, on benchmarks/input_pipeline.py's photo folder (500x375 JPEGs at
  quality 90), counted as that benchmark counts (the CPU seconds of the worker and of this process,
  from /proc, per image delivered). ``data.decode=fast`` decodes a JPEG at 1/2, 1/4 or 1/8 scale
  when the crop stays at least the output size, so small sizes decode cheaper; ``pil`` always
  decodes the whole file (the crop box does not depend on the size), which isolates what the
  reduced-scale decode buys;
- the training step: samples per second of forward, backward and SGD step of a torchvision ResNet
  (no weights) on batches already on the device, uint8 converted to normalized float per step as
  the framework's device path does; a few warm-up steps, then the timed ones, the device
  synchronized before the clock is read. On CUDA in bf16 autocast with channels_last and cuDNN's
  autotuner (the framework's CUDA defaults); on the CPU in float32 on torch's threads (``--threads``:
  on a shared 2-core machine two threads can stall each other, one is steadier).

Expected time of the whole schedule against every epoch at 224 px: a sample at size s costs
1 / min(loader img/s per core x cores, step samples/s), weighted by the epochs at s. The loader and
the step overlap (workers run ahead), so the slower bounds; on a CPU-only machine both share the
cores, so there the figure is a lower bound on the time.
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
from typing import Callable, Optional

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402

from input_pipeline import MEAN, SIZE, STD, machine, make_folder, measure  # noqa: E402
from trainer.data.progressive_resize import ResizeSchedule  # noqa: E402

EPOCHS = 16
LOADER_BATCH = 32
DECODES = ("fast", "pil")
RESULTS = REPO / "benchmarks" / "results"
#: --quick: what each option becomes unless given (a smoke check: the numbers mean little).
#: One thread: on a shared CI machine two can stall each other for seconds a step.
QUICK = {"images": 32, "rounds": 1, "batches": 2, "steps": 2, "warmup": 1, "batch": 4, "threads": 1}
DEFAULTS = {"images": 320, "rounds": 3, "batches": 10, "steps": 5, "warmup": 2}


# -- the schedule ------------------------------------------------------------------------------------
def default_schedule(epochs: int = EPOCHS) -> ResizeSchedule:
    """The image-folder module's default schedule for a 224 px run of `epochs` epochs."""
    from trainer.data.imagefolder import ImageFolderDataModule

    schedule = ImageFolderDataModule(image_size=SIZE, progressive_resize=True).resize_schedule(epochs)
    assert schedule is not None
    return schedule


def sizes_of(schedule: ResizeSchedule) -> list[int]:
    return sorted(set(schedule.sizes()))


def epoch_at(schedule: ResizeSchedule, size: int) -> int:
    """The first epoch that trains at `size`."""
    return schedule.sizes().index(size)


# -- the input pipeline --------------------------------------------------------------------------------
def resized_loader(root: Path, decode: str, schedule: ResizeSchedule,
                   batch: int = LOADER_BATCH) -> torch.utils.data.DataLoader:
    """The training loader of a progressive-resizing run; its sampler's epoch picks the size. Its
    worker persists, so one loader serves every size and round (the size travels with the indices)."""
    from trainer.data.imagefolder import ImageFolderDataModule

    module = ImageFolderDataModule(root=str(root), image_size=SIZE, decode=decode, progressive_resize=True,
                                   batch_size=batch, num_workers=1, pin_memory=False, persistent_workers=True,
                                   scan="off")
    module.inspect()
    module.apply_loader(module.loader_settings(cuda=False))
    module.apply_resize(schedule)
    module.setup("fit")
    return module.train_dataloader()


def loader_rate(loader: torch.utils.data.DataLoader, epoch: int, batches: int) -> dict[str, float]:
    torch.set_num_threads(1)  # this process only takes batches, as in input_pipeline.py
    loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
    return measure(loader, batches)


# -- the training step ---------------------------------------------------------------------------------
class Stepper:
    """A ResNet, its SGD optimizer and the loss, stepped on one device-resident batch per size."""

    def __init__(self, model: str, batch: int, device: torch.device) -> None:
        import torchvision

        self.device, self.batch = device, batch
        self.cuda = device.type == "cuda"
        self.model = getattr(torchvision.models, model)(num_classes=10).to(device)  # random weights, no download
        if self.cuda:
            self.model = self.model.to(memory_format=torch.channels_last)
            torch.backends.cudnn.benchmark = True
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255
        self.labels = torch.randint(0, 10, (batch,), device=device)

    def step(self, images: torch.Tensor) -> None:
        x = (images.float() - self.mean) / self.std
        if self.cuda:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cuda):
            loss = torch.nn.functional.cross_entropy(self.model(x), self.labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def rate(self, size: int, steps: int, warmup: int, threads: int) -> dict[str, float]:
        """Samples per second over `steps` timed steps at `size` px, after `warmup` steps."""
        torch.set_num_threads(threads)
        images = torch.randint(0, 256, (self.batch, 3, size, size), dtype=torch.uint8, device=self.device)
        synchronize: Callable[[], None] = torch.cuda.synchronize if self.cuda else (lambda: None)
        for _ in range(warmup):  # allocator, cuDNN's algorithm choice for this shape
            self.step(images)
        synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            self.step(images)
        synchronize()
        return {"samples_per_s": steps * self.batch / (time.perf_counter() - start)}


# -- the rounds ----------------------------------------------------------------------------------------
def close(loader: torch.utils.data.DataLoader) -> None:
    """Stop a loader's persistent worker now. One still alive when the interpreter exits after an
    error (a traceback holds the loader) hangs the exit, so this does not wait for garbage collection."""
    iterator = getattr(loader, "_iterator", None)  # private: DataLoader has no public way to stop its workers
    if iterator is not None:
        iterator._shutdown_workers()
        loader._iterator = None


def run(args: argparse.Namespace, root: Optional[Path], schedule: ResizeSchedule,
        device: torch.device) -> dict[tuple[str, int], list[dict[str, float]]]:
    """{(pipeline, size): one record per round}; pipelines: the decode modes and "step"."""
    threads = torch.get_num_threads()  # this process's own, given back at the end (the test runs in-process)
    loaders = {mode: resized_loader(root, mode, schedule) for mode in args.decodes} if root else {}
    try:
        return rounds(args, schedule, loaders, Stepper(args.model, args.batch, device))
    finally:
        for loader in loaders.values():
            close(loader)
        torch.set_num_threads(threads)


def rounds(args: argparse.Namespace, schedule: ResizeSchedule, loaders: dict[str, torch.utils.data.DataLoader],
           stepper: Stepper) -> dict[tuple[str, int], list[dict[str, float]]]:
    jobs = [(name, size) for size in sizes_of(schedule) for name in (*loaders, "step")]
    results: dict[tuple[str, int], list[dict[str, float]]] = {job: [] for job in jobs}
    for r in range(args.rounds):
        for name, size in jobs if r % 2 == 0 else reversed(jobs):  # no size always first
            if name == "step":
                record = stepper.rate(size, args.steps, args.warmup, args.threads)
                shown = f"{record['samples_per_s']:8.1f} samples/s"
            else:
                record = loader_rate(loaders[name], epoch_at(schedule, size), args.batches)
                shown = f"{record['per_core']:8.0f} img/s per core ({record['wall']:.0f} img/s wall)"
            results[(name, size)].append(record)
            print(f"round {r + 1}/{args.rounds} {size:>3} px {name:<4} {shown}", flush=True)
    return results


# -- the report ----------------------------------------------------------------------------------------
def _key(name: str) -> str:
    return "samples_per_s" if name == "step" else "per_core"


def rates(results: dict[tuple[str, int], list[dict[str, float]]], name: str, size: int) -> list[float]:
    return [r[_key(name)] for r in results.get((name, size), [])]


def ratio(results: dict[tuple[str, int], list[dict[str, float]]], name: str, size: int) -> float:
    """The speed-up of `size` over 224 px: the median of the rounds' ratios (each round's pair was
    measured minutes apart at most, so a machine's drift cancels)."""
    return statistics.median(a / b for a, b in zip(rates(results, name, size), rates(results, name, SIZE)))


def _cell(results: dict[tuple[str, int], list[dict[str, float]]], name: str, size: int) -> str:
    """The median rate (range) and its speed-up over 224 px."""
    values = rates(results, name, size)
    if not values:
        return "- | -"
    pattern = "{:,.1f}" if name == "step" and max(values) < 100 else "{:,.0f}"
    low, mid, high = (pattern.format(v) for v in (min(values), statistics.median(values), max(values)))
    return f"{mid} ({low}-{high}) | {ratio(results, name, size):.2f}x"


def table(results: dict[tuple[str, int], list[dict[str, float]]], schedule: ResizeSchedule) -> list[str]:
    lines = ["| size | px² share of 224 | epochs of 16 | loader fast img/s per core (median, range) | fast vs 224 | "
             "loader pil img/s per core | pil vs 224 | step samples/s (median, range) | step vs 224 |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size in sizes_of(schedule):
        cells = " | ".join(_cell(results, name, size) for name in ("fast", "pil", "step"))
        lines.append(f"| {size} | {(size / SIZE) ** 2:.2f} | {schedule.sizes().count(size)} | {cells} |")
    return lines


def expected_time(results: dict[tuple[str, int], list[dict[str, float]]], schedule: ResizeSchedule, name: str,
                  cores: int) -> Optional[float]:
    """The schedule's time over all-224's: per sample 1 / min(loader per core x cores, step rate)."""
    def per_sample(size: int) -> float:
        step = statistics.median(rates(results, "step", size))
        if name == "step":
            return 1 / step
        return 1 / min(statistics.median(rates(results, name, size)) * cores, step)

    if name != "step" and not rates(results, name, SIZE):
        return None
    return sum(per_sample(size) for size in schedule.sizes()) / (len(schedule.sizes()) * per_sample(SIZE))


def verdicts(results: dict[tuple[str, int], list[dict[str, float]]], schedule: ResizeSchedule, cores: int,
             device: str) -> list[str]:
    steps = ", ".join(f"{size} px {statistics.median(rates(results, 'step', size)):,.1f} "
                      f"({ratio(results, 'step', size):.2f}x)" for size in sizes_of(schedule))
    lines = [f"- step samples/s by size on {device}: {steps}"]
    times = {name: expected_time(results, schedule, name, cores) for name in ("fast", "pil", "step")}
    shown = [f"{times[n]:.2f}x with data.decode={n}" for n in ("fast", "pil") if times[n] is not None]
    shown.append(f"{times['step']:.2f}x for the step alone")
    lines.append(f"- the default schedule ({schedule.describe().split(' epochs (')[0]} epochs), expected time of "
                 f"{len(schedule.sizes())} epochs against all at {SIZE} px: {', '.join(shown)}; the pixels alone "
                 f"{schedule.relative_cost():.2f}x (per sample 1 / min(loader img/s per core x {cores} cores, "
                 f"step samples/s), weighted by the epochs at each size)")
    return lines


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"


def report(results: dict[tuple[str, int], list[dict[str, float]]], schedule: ResizeSchedule,
           args: argparse.Namespace, device: torch.device, command: str) -> str:
    loader = (f"{args.images} photos 500x375/375x500 JPEG q90, one loader worker, batches of {LOADER_BATCH}, "
              f"{args.batches} batches per size per round" if args.decodes else "loader not measured (--decodes none)")
    where = device_name(device) + ("" if device.type == "cuda" else f" ({args.threads} torch threads)")
    return "\n".join([f"Measured {time.strftime('%Y-%m-%d')} on {machine()}: {loader}; training step "
                      f"{args.model} on {where}, batch {args.batch}, {args.warmup} warm-up + {args.steps} timed "
                      f"steps per size per round; {args.rounds} interleaved rounds.", "", *table(results, schedule),
                      "", *verdicts(results, schedule, args.cores, device_name(device)), "", f"`{command}`"])


def write(text: str, device: torch.device) -> Path:
    path = RESULTS / f"progressive_resize_{'gpu' if device.type == 'cuda' else 'cpu'}.md"
    path.write_text("# Progressive resizing: what each size costs the loader and the step\n\n" + text + "\n")
    return path


# -- the command line ----------------------------------------------------------------------------------
def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, help=f"training photos generated (default {DEFAULTS['images']})")
    parser.add_argument("--rounds", type=int, help=f"interleaved rounds (default {DEFAULTS['rounds']})")
    parser.add_argument("--batches", type=int, help=f"timed loader batches per size per round (default {DEFAULTS['batches']})")
    parser.add_argument("--steps", type=int, help=f"timed training steps per size per round (default {DEFAULTS['steps']})")
    parser.add_argument("--warmup", type=int, help=f"training steps before the timed ones (default {DEFAULTS['warmup']})")
    parser.add_argument("--batch", type=int, help="training step batch (default 16 on the CPU, 128 on CUDA)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if cuda else "cpu")
    parser.add_argument("--model", default=None, help="a torchvision ResNet (default resnet18 on the CPU, resnet50 on CUDA)")
    parser.add_argument("--decodes", default=",".join(DECODES),
                        help="loader decode modes to time, comma-separated, or none (the step only)")
    parser.add_argument("--threads", type=int,
                        help="torch threads of the CPU step (default torch's: OMP_NUM_THREADS or one per core; "
                             "on a busy machine 1 is steadier)")
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)),
                        help="host cores for the loader in the expected time (default: those available)")
    parser.add_argument("--folder", type=Path, help="use (or make) the photo folder here instead of a temp one")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/progressive_resize_{cpu,gpu}.md")
    parser.add_argument("--out", type=Path, help="write the report to this file as well")
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a smoke check: " +
                        ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    args = parser.parse_args(argv)
    for key, value in {**DEFAULTS, **(QUICK if args.quick else {})}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.threads = args.threads or torch.get_num_threads()
    args.batch = args.batch or (128 if args.device == "cuda" else 16)
    args.model = args.model or ("resnet50" if args.device == "cuda" else "resnet18")
    args.decodes = tuple(d for d in args.decodes.split(",") if d and d != "none")
    unknown = set(args.decodes) - set(DECODES)
    if unknown:
        parser.error(f"--decodes: {', '.join(sorted(unknown))} not one of {', '.join(DECODES)}, none")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    command = "python benchmarks/progressive_resize.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    device = torch.device(args.device)
    schedule = default_schedule()
    with tempfile.TemporaryDirectory(prefix="progressive-resize-") as temp:
        root: Optional[Path] = None
        if args.decodes:
            root = args.folder or Path(temp)
            if not (root / "train").is_dir():
                make_folder(root, args.images)
        results = run(args, root, schedule, device)
        text = report(results, schedule, args, device, command.strip())
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.write:
        print(f"wrote {write(text, device)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
