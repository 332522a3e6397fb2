"""Measure what each best practice buys on this machine: samples/s with and without, same session.

    .venv/bin/python benchmarks/practices.py                 # CPU-sized defaults, prints a Markdown table
    .venv/bin/python benchmarks/practices.py --repeats 3 --out benchmarks/results/practices_cpu.md
    .venv/bin/python benchmarks/practices.py --base data.shape=[3,224,224] model=resnet50   # on a GPU

Each row runs `train.py` twice (practice on, practice off) on the same base config, interleaved
when repeated, and reports the median of the runs' `throughput.samples_per_s` (itself the median
of timed windows after warm-up, device synchronized) and peak memory from summary.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The compute-bound base: a small CNN on device-generated images, so the input pipeline does not
# hide what the switches change. No checkpoints, no validation cost worth measuring.
BASE = ["data=synthetic", "data.shape=[3,32,32]", "data.train_samples=4096", "data.batch_size=64",
        "trainer.max_epochs=1", "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0",
        "checkpointing=off", "progress=off", "logger=csv"]

PRACTICES = [
    ("mixed precision (bf16 autocast)", "precision=bf16_mixed", "precision=fp32"),
    ("fused optimizer kernel", "optimizer.implementation=fused", "optimizer.implementation=foreach"),
    ("foreach vs per-tensor loop", "optimizer.implementation=foreach", "optimizer.implementation=for_loop"),
    ("channels_last memory format", "precision.channels_last=true", "precision.channels_last=false"),
    ("95th-percentile clipping (cost)", "clipping=percentile", "clipping=off"),
    ("activation checkpointing (cost)", "model.activation_checkpointing=[features.4,features.5]",
     "model.activation_checkpointing=[]"),
    ("non-finite guard (cost)", "nonfinite=skip", "nonfinite=off"),
]


def run(overrides: list[str], folder: Path) -> dict:
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides, f"hydra.run.dir={folder}"],
                          cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"train.py {' '.join(overrides)} failed:\n{proc.stderr[-2000:]}")
    return json.loads((folder / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1, help="runs per setting (median reported)")
    parser.add_argument("--base", nargs="*", default=[], help="overrides added to the base config")
    parser.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    parser.add_argument("--only", nargs="*", default=[], help="rows whose name contains one of these words")
    args = parser.parse_args()
    base = BASE + args.base
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        chosen = [p for p in PRACTICES if not args.only or any(word in p[0] for word in args.only)]
        for i, (name, on, off) in enumerate(chosen):
            rates: dict[str, list[float]] = {"on": [], "off": []}
            memory: dict[str, list[float]] = {"on": [], "off": []}
            device = ""
            for r in range(args.repeats):
                for label, switch in (("on", on), ("off", off)) if r % 2 == 0 else (("off", off), ("on", on)):
                    summary = run(base + [switch], Path(tmp) / f"{i}-{label}-{r}")
                    rates[label].append(summary["throughput"]["samples_per_s"])
                    memory[label].append(summary["peak_memory"]["bytes"] / 2**20)
                    device = summary["device"]["name"]
            on_rate, off_rate = statistics.median(rates["on"]), statistics.median(rates["off"])
            rows.append(f"| {name} | `{on}` vs `{off}` | {on_rate:,.0f} | {off_rate:,.0f} | {on_rate / off_rate:.2f}x "
                        f"| {statistics.median(memory['on']):,.0f} / {statistics.median(memory['off']):,.0f} |")
            print(rows[-1], flush=True)
    header = [f"Machine: {device} ({platform.machine()}), torch run via train.py; base: `{' '.join(base)}`; "
              f"median of {args.repeats} run(s) per setting.", "",
              "| practice | switch (on vs off) | on samples/s | off samples/s | on/off | peak MiB on / off |",
              "|---|---|---|---|---|---|"]
    table = "\n".join(header + rows)
    print("\n" + table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
