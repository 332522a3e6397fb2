"""The memory of `python -m trainer.deploy serve`, process by process: after it is ready (warmed up)
and after some requests, RSS and PSS from /proc/PID/smaps_rollup.

RSS counts every page a process maps, shared or not: the HTTP server and the queue manager are forked
from the main process and share most of its pages (Python, torch), so RSS summed over the processes
counts those pages several times. PSS divides each shared page among its sharers: summed, it is the
server's memory. Written as markdown (and .json beside it).

    python benchmarks/serve_memory.py EXPORT_DIR|RUN_DIR                 # the defaults, 200 requests
    python benchmarks/serve_memory.py EXPORT_DIR --variant "--max-batch-size 1" --out /tmp/mem.md
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shlex
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.deploy.load import ServerProcess  # noqa: E402
from trainer.deploy.serve import server_processes  # noqa: E402
from trainer.infra.processes import memory_bytes  # noqa: E402

ROLES = ("main", "queue_manager", "inference_worker", "http", "resource_tracker")


def snapshot(main_pid: int) -> dict[str, dict[str, float]]:
    """MiB of RSS and PSS by role."""
    found: dict[str, dict[str, float]] = {}
    for pid, role in server_processes(main_pid).items():
        rss, pss, uss = memory_bytes(pid)
        entry = found.setdefault(role, {"processes": 0, "rss_mib": 0.0, "pss_mib": 0.0, "uss_mib": 0.0})
        entry["processes"] += 1
        entry["rss_mib"] += rss / 2**20
        entry["pss_mib"] += pss / 2**20
        entry["uss_mib"] += uss / 2**20
    return found


def post_png(url: str, count: int) -> None:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64), dtype=np.uint8)).save(buffer, "PNG")
    for _ in range(count):
        request = urllib.request.Request(url + "/predict", data=buffer.getvalue(),
                                         headers={"Content-Type": "image/png"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            answer.read()


def measure(source: Path, extra: list[str], requests: int, log: Path) -> dict[str, object]:
    with ServerProcess(source, max_batch_size=32, batch_timeout_ms=0, log=log, extra=extra) as server:
        server.wait_ready()
        time.sleep(1.0)  # the worker's warm-up is done once /health is 200; let allocations settle
        ready = snapshot(server.process.pid)
        post_png(server.url, requests)
        time.sleep(0.5)
        served = snapshot(server.process.pid)
    return {"options": extra, "ready": ready, "after_requests": served}


def markdown(runs: list[dict[str, object]], command: str, requests: int) -> str:
    cpus = os.cpu_count()
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    lines = [f"# serve: memory by process\n\n`{command}` on {cpus} CPUs ({model}), no GPU, Python "
             f"{platform.python_version()}. MiB from /proc/PID/smaps_rollup; PSS shares each shared page "
             f"among its processes (its sum is the server's memory), RSS counts it in each, USS (private pages) "
             f"is what ending the process would free.\n"]
    for run in runs:
        options = " ".join(run["options"]) or "(defaults)"  # type: ignore[arg-type]
        lines += [f"\n## serve {options}\n", "| process | count | RSS ready | PSS ready | USS ready | RSS after "
                  f"{requests} requests | PSS after | USS after |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        ready, after = run["ready"], run["after_requests"]
        assert isinstance(ready, dict) and isinstance(after, dict)
        for role in [r for r in ROLES if r in ready or r in after]:
            a, b = ready.get(role, {}), after.get(role, {})
            lines.append(f"| {role} | {a.get('processes', b.get('processes', 0))} | "
                         + " | ".join(f"{part.get(key, 0):.0f}" for part in (a, b)
                                      for key in ("rss_mib", "pss_mib", "uss_mib")) + " |")
        total = [sum(v[key] for v in part.values()) for part in (ready, after) for key in ("rss_mib", "pss_mib", "uss_mib")]
        lines.append(f"| **total** | {sum(v['processes'] for v in ready.values())} | "
                     + " | ".join(f"{value:.0f}" for value in total) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="an export folder, or a run folder with one")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--variant", action="append", default=[],
                        help="serve options to measure too, beside the defaults (repeatable)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "serve_memory_digits_cpu.md")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    for extra in [[], *(shlex.split(v) for v in args.variant)]:
        runs.append(measure(args.source, extra, args.requests, args.out.with_suffix(".log")))
    command = "python benchmarks/serve_memory.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    args.out.write_text(markdown(runs, command, args.requests))
    args.out.with_suffix(".json").write_text(json.dumps({"command": command, "runs": runs}, indent=1) + "\n")
    args.out.with_suffix(".log").unlink(missing_ok=True)
    print(args.out.read_text())


if __name__ == "__main__":
    main()
