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


def run_command(command: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """The one place a study starts a job's process, from the repository root, its output captured
    (the suite's tests put a forked child of the pytest worker here: same command, no import cost)."""
    return subprocess.run(list(command), cwd=REPO, capture_output=True, text=True)


def run_multirun(overrides: Sequence[str], folder: Path, label: str, accelerator: str = "cpu",
                 quiet: bool = True) -> float:
    """`python train.py -m OVERRIDES` with its runs and comparison in `folder` (without checkpoints
    or a progress bar where `quiet`); its wall time in s."""
    command = [sys.executable, str(REPO / "train.py"), "-m", *overrides, *(QUIET if quiet else ()),
               f"trainer.accelerator={accelerator}", f"run.root={folder}", f"hydra.sweep.dir={folder}"]
    started = time.monotonic()
    done = run_command(command)
    if done.returncode != 0:
        raise SystemExit(f"the sweep {label} failed:\n{done.stderr[-3000:]}")
    return time.monotonic() - started


def summaries(folder: Path) -> Iterator[dict[str, Any]]:
    """The summary.json of each job of a sweep folder, in job order (jobs without one are left out)."""
    if not folder.is_dir():
        return
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


#: The 1-minute load average above which a job counts as timed beside other load: the job's own
#: process keeps about one unit busy per CPU (its threads), so anything past the CPUs plus a half is
#: someone else's work. Such a job's accuracy stands; its times are left out of time figures.
LOAD_MARGIN = 0.5


def provenance_of(summary: dict[str, Any]) -> dict[str, Any]:
    """Where, when and beside what a job ran (summary.json `host`, `command`, `wall_time_s`): the
    command that reruns it alone, start and end, the duration, the machine, the load averages at
    start and end, and whether it ran beside other load (`beside_load`)."""
    host = summary.get("host") or {}
    loads = [load[0] for load in (host.get("load_at_start"), host.get("load_at_end")) if load]
    cpus = host.get("cpus")
    return {"command": "python " + (summary.get("command") or "train.py " + " ".join(summary.get("overrides", []))),
            "started": host.get("started"), "ended": host.get("ended"),
            "duration_s": round(summary["wall_time_s"], 1) if summary.get("wall_time_s") is not None else None,
            "machine": machine_of(summary), "host": host.get("name"), "cpus": cpus,
            "load_1min": {"start": loads[0] if loads else None, "end": loads[-1] if loads else None},
            "beside_load": (None if not loads or not cpus else max(loads) > cpus + LOAD_MARGIN)}


def design_of(files: Sequence[str]) -> dict[str, Any]:
    """The pre-registration a job records: the last commit that touched the study's design `files`
    (its rule and its script, paths from the repository root), when it was committed, and whether
    those files were unchanged from it when the job ran (`clean`): a reader checks that the commit
    precedes the job's start. Read from git; {"commit": None} outside a checkout."""
    def git(*words: str) -> str:
        done = subprocess.run(["git", "-C", str(REPO), *words], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""
    found = git("log", "-1", "--format=%H %cI", "--", *files).split()
    if len(found) != 2:
        return {"commit": None, "committed": None, "files": list(files), "clean": False}
    return {"commit": found[0], "committed": found[1], "files": list(files),
            "clean": not git("status", "--porcelain", "--", *files)}


def preregistered(job: dict[str, Any]) -> bool | None:
    """Whether a job ran under a design committed before it started and unchanged since (None: the
    job records no design, as every job before issue 51)."""
    design = job.get("design")
    if not design:
        return None
    if not design.get("commit") or not design.get("clean") or not job.get("started"):
        return False
    from datetime import datetime
    return datetime.fromisoformat(design["committed"]) <= datetime.fromisoformat(job["started"])


def timed_alone(job: dict[str, Any]) -> bool:
    """Whether a job's times may enter a time figure: it recorded its load, and nothing else ran."""
    return job.get("beside_load") is False


def load_jobs(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text()) if path.is_file() else []


def add_jobs(path: Path, new: list[dict[str, Any]], key: Callable[[dict[str, Any]], tuple]) -> list[dict[str, Any]]:
    """The jobs file with `new` added, saved: a new job's fields replace a known one's of the same
    key, and what only the known one records (the study command that ran it) stays."""
    by_key = {key(j): j for j in load_jobs(path)}
    for job in new:
        by_key[key(job)] = {**by_key.get(key(job), {}), **job}
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
