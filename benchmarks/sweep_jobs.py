"""What the accuracy studies (batch_scaling.py, clipping_study.py) share: run one Hydra multirun of
train.py into a folder, read its jobs' summaries back, and keep every job's numbers in a jobs file
(JSON) that a later run of the study adds to, so the report is always written from that file alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

REPO = Path(__file__).resolve().parent.parent
#: What every study job leaves out: checkpoints and the progress bar.
QUIET = ("checkpointing=off", "progress=off")


def run_multirun(overrides: Sequence[str], folder: Path, label: str, accelerator: str = "cpu") -> float:
    """`python train.py -m OVERRIDES` with its runs and comparison in `folder`; its wall time in s."""
    command = [sys.executable, str(REPO / "train.py"), "-m", *overrides, *QUIET, f"trainer.accelerator={accelerator}",
               f"run.root={folder}", f"hydra.sweep.dir={folder}"]
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the sweep {label} failed:\n{done.stderr[-3000:]}")
    return time.monotonic() - started


def summaries(folder: Path) -> Iterator[dict[str, Any]]:
    """The summary.json of each job of a sweep folder, in job order (jobs without one are left out)."""
    for job in sorted((p for p in folder.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        try:
            yield json.loads((job / "summary.json").read_text())
        except (OSError, ValueError):
            continue


def overrides_of(summary: dict[str, Any]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in summary.get("overrides", []) if "=" in o)


def machine_of(summary: dict[str, Any]) -> str:
    """The device the job ran on, by name (the CPU's on a CPU run)."""
    return (summary.get("device") or {}).get("name") or "unknown"


def load_jobs(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text()) if path.is_file() else []


def add_jobs(path: Path, new: list[dict[str, Any]], key: Callable[[dict[str, Any]], tuple]) -> list[dict[str, Any]]:
    """The jobs file with `new` added (a new job replaces a known one of the same key), saved."""
    by_key = {key(j): j for j in load_jobs(path)}
    by_key.update({key(j): j for j in new})
    jobs = [by_key[k] for k in sorted(by_key, key=lambda k: tuple((0, v) if isinstance(v, (int, float)) else (1, str(v))
                                                                 for v in k))]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jobs, indent=1) + "\n")
    return jobs


def keep_comparison(folder: Path, into: Path, label: str) -> None:
    """The sweep's own comparison.md (every job, grouped over seeds), kept as INTO/LABEL.md."""
    if (folder / "comparison.md").is_file():
        into.mkdir(parents=True, exist_ok=True)
        (into / f"{label}.md").write_text((folder / "comparison.md").read_text())


def write_report(out: Path, lines: list[str], draw: Callable[[Path], None]) -> None:
    """The report as OUT (markdown, also printed) and its plot beside it (OUT with .png)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    draw(out.with_suffix(".png"))
    print("\n".join(lines))
