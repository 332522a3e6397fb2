"""Time to accuracy on a small JPEG image folder: torchvision's reference recipe against this
framework's recipe for small image folders, on the same folder and machine, in one session.

1. Writes the bundled digits (1,797, scikit-learn) as 32 px JPEGs in an ImageFolder tree, a
   stratified 80/20 train/val split (nothing downloaded).
2. Runs, interleaved, `--rounds` times each, round i with seed i on both sides:
   - the reference (benchmarks/reference_classification.py: ResNet-18, SGD lr 0.1 per 256, step
     schedule, the reference's transforms) for `--epochs` epochs;
   - `train.py +recipe=small_images` with target.metric=val/acc and target.value = that round's
     reference accuracy after `--epochs` epochs, so it records when it first got there.
3. Writes the table (medians and each round) to `--out` (markdown) and the raw numbers beside it.

The reference's time counts from its first training batch to the end of each epoch's validation;
ours is summary.json's target.wall_s (seconds into training when the validation at the target
ended), measured the same way. Both also report the whole process's wall time.

    python benchmarks/time_to_accuracy.py --rounds 2 --out benchmarks/results/time_to_accuracy_cpu.md
    python benchmarks/time_to_accuracy.py --write-folder /tmp/digits_jpeg    # the folder alone, for:
    benchmarks/ladder.sh small_images data=imagefolder data.root=/tmp/digits_jpeg target.metric=val/acc target.value=0.85
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from trainer.infra.fingerprint import cpu_name

REPO = Path(__file__).resolve().parent.parent


def write_digits_folder(root: Path, size: int = 32, val_share: float = 0.2, seed: int = 0) -> dict[str, int]:
    """The digits as `size`-px grayscale JPEGs (quality 95): root/{train,val}/digit_N/*.jpg."""
    from PIL import Image
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (bunch.images * (255.0 / 16.0)).round().astype(np.uint8)
    rng = np.random.default_rng(seed)
    counts = {"train": 0, "val": 0}
    for label in range(10):
        members = rng.permutation(np.flatnonzero(bunch.target == label))
        cut = int(round(len(members) * val_share))
        for split, chosen in (("val", members[:cut]), ("train", members[cut:])):
            folder = root / split / f"digit_{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in chosen:
                image = Image.fromarray(images[i], mode="L").resize((size, size), Image.BILINEAR)
                image.save(folder / f"{i}.jpg", quality=95)
                counts[split] += 1
    return counts


def checked(command: list[str]) -> subprocess.CompletedProcess[str]:
    """Run `command`; on failure stop with its last lines of stderr (the benchmark's own error)."""
    out = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        tail = "\n".join(out.stderr.strip().splitlines()[-5:])
        sys.exit(f"failed (exit {out.returncode}): {' '.join(command)}\n{tail}")
    return out


def run_reference(root: Path, epochs: int, workers: int, crop: int = 32, seed: int = 0) -> dict[str, Any]:
    started = time.perf_counter()
    out = checked([sys.executable, str(REPO / "benchmarks" / "reference_classification.py"), str(root),
                   "--epochs", str(epochs), "--batch-size", "64", "--crop", str(crop), "--workers", str(workers),
                   "--seed", str(seed)])
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {"epochs": [line for line in lines if "epoch" in line and "final" not in line], "final": lines[-1],
            "process_s": time.perf_counter() - started}


def run_ours(root: Path, target: float, run_dir: Path, extra: list[str], seed: int = 0) -> dict[str, Any]:
    started = time.perf_counter()
    checked([sys.executable, str(REPO / "train.py"), "+recipe=small_images", f"data.root={root}",
             "target.metric=val/acc", f"target.value={target}", f"hydra.run.dir={run_dir}", "progress=off",
             f"seed={seed}", *extra])
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"target": summary["target"], "fit_s": summary["fit_time_s"], "val_acc": summary["metrics"]["val"]["acc"],
            "epochs": summary["epochs"], "process_s": time.perf_counter() - started}


def table(rounds: list[dict[str, Any]], args: argparse.Namespace, counts: dict[str, int]) -> str:
    ref_s = [r["reference"]["final"]["train_s"] for r in rounds]
    ref_acc = [r["reference"]["final"]["val_acc"] for r in rounds]
    reached = [r for r in rounds if r["ours"]["target"]["reached"]]
    ours_s = [r["ours"]["target"]["wall_s"] for r in reached]
    ratios = [r["ours"]["target"]["wall_s"] / r["reference"]["final"]["train_s"] for r in reached]
    missed = len(rounds) - len(reached)
    ratio_text = (f"**Ratio (ours / reference): {statistics.median(ratios):.2f}x** (median of the rounds that reached "
                  f"it; rounds: {', '.join(f'{x:.2f}' for x in ratios)})" if ratios else "**Never reached**")
    if missed:
        ratio_text += f"; {missed} of {len(rounds)} rounds never reached the reference's accuracy"
    lines = [
        f"# Time to accuracy: a small JPEG folder ({cpu_name()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')})",
        "",
        f"`python benchmarks/time_to_accuracy.py --rounds {args.rounds} --epochs {args.epochs}`: the bundled digits as "
        f"32 px JPEGs ({counts['train']} train, {counts['val']} val), batch 64, interleaved rounds.",
        "",
        "| | time to the reference's accuracy (training s) | val accuracy | whole process (s) |",
        "|---|---|---|---|",
        f"| torchvision reference, {args.epochs} epochs | {statistics.median(ref_s):.1f} | "
        f"{statistics.median(ref_acc):.3f} ({min(ref_acc):.3f}-{max(ref_acc):.3f}) | {statistics.median(r['reference']['process_s'] for r in rounds):.1f} |",
        f"| `+recipe=small_images`, first validation at that accuracy | "
        f"{statistics.median(ours_s) if ours_s else float('nan'):.1f} | "
        f"{statistics.median(r['ours']['target']['value_reached'] or 0 for r in reached) if reached else 0:.3f} "
        "(at the target), "
        f"{statistics.median(r['ours']['val_acc'] for r in rounds):.3f} (best, end) | "
        f"{statistics.median(r['ours']['process_s'] for r in rounds):.1f} |",
        "",
        f"{ratio_text}. Target: at most 0.60x. Round i seeds both sides with i, so "
        "the rounds vary the initialization, the data order and the augmentation as well as the timing; each "
        "round's target is that round's reference accuracy.",
        "",
        "| round | reference s | reference acc | ours: target s (epochs trained) | ours: fit s, epochs |",
        "|---|---|---|---|---|",
    ]
    for i, r in enumerate(rounds, 1):
        t = r["ours"]["target"]
        cell = f"{t['wall_s']:.1f} ({t['epoch'] + 1})" if t["reached"] else f"not reached (best {t['best']:.3f})"
        lines.append(f"| {i} | {r['reference']['final']['train_s']:.1f} | {r['reference']['final']['val_acc']:.3f} | "
                     f"{cell} | {r['ours']['fit_s']:.1f}, {r['ours']['epochs']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--workers", type=int, default=1, help="the reference's loader workers (ours: auto)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "time_to_accuracy_cpu.md")
    parser.add_argument("--write-folder", type=Path, help="only write the JPEG folder there (for the accuracy ladder)")
    parser.add_argument("ours", nargs="*", help="extra overrides for our run")
    args = parser.parse_args()
    if args.write_folder:
        print(write_digits_folder(args.write_folder))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "digits_jpeg"
        counts = write_digits_folder(root)
        rounds = []
        for i in range(args.rounds):
            reference = run_reference(root, args.epochs, args.workers, seed=i)
            target = round(reference["final"]["val_acc"], 4)
            ours = run_ours(root, target, Path(tmp) / f"ours{i}", args.ours, seed=i)
            rounds.append({"reference": reference, "ours": ours})
            print(json.dumps({"round": i + 1, "reference_s": reference["final"]["train_s"], "reference_acc": target,
                              "ours_target": ours["target"]}), flush=True)
    text = table(rounds, args, counts)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(rounds, indent=1))
    print(text)


if __name__ == "__main__":
    main()
