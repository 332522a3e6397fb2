"""Seconds from the start of `python train.py ARGS` to the first line on its stderr (a bad input's
one-line error) and to its exit, for several argument lists taken in turn, median of N rounds.

    python benchmarks/first_line.py --rounds 7 "optimizer.lr=-1" "optimizer.lrr=1" "model=nonexistent"

Each job runs in a scratch run folder (removed after); the lines printed say the machine, its load
before and after, and the first line each variant printed, so that a figure is read with its error.
docs/measured.md ("Time to a bad input's error") quotes them."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def first_line(args: list[str], run_dir: Path) -> tuple[float, float, str]:
    """(seconds to the first stderr line, seconds to exit, that line) of one `python train.py ARGS`."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args, f"hydra.run.dir={run_dir}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=run_dir.parent)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    first = time.perf_counter() - start
    proc.stderr.read()
    proc.wait()
    return first, time.perf_counter() - start, line.strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", help="argument lists, each one quoted string")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    variants = [shlex.split(text) for text in args.variants]
    times: dict[int, list[tuple[float, float, str]]] = {i: [] for i in range(len(variants))}
    load_before = os.getloadavg()[0]
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for i, variant in enumerate(variants):
                times[i].append(first_line(variant, Path(scratch) / f"run{round_}-{i}"))
    print(f"# {started}, {platform.node()}, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
          f"python {platform.python_version()}, load {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; "
          f"{args.rounds} rounds interleaved")
    for i, variant in enumerate(variants):
        firsts = sorted(t[0] for t in times[i])
        print(f"{shlex.join(variant)}: first line {statistics.median(firsts):.2f} s ({firsts[0]:.2f}-{firsts[-1]:.2f}), "
              f"exit {statistics.median(t[1] for t in times[i]):.2f} s: {times[i][0][2][:100]}")


if __name__ == "__main__":
    main()
