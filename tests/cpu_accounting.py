"""Where the suite's CPU goes, per test file: opt-in with ``TEST_CPU_LOG=FILE`` (off by default).

Wall time says nothing on a shared machine; CPU seconds do. For each test file this logs, as one JSON
line appended to FILE (safe from several xdist workers):

- ``cpu_s``: CPU seconds (user + system) of the pytest process and of the children it waited for
  (`resource.getrusage` SELF + CHILDREN: forked runs, subprocesses, servers; a grandchild killed with
  its group and reaped by init is not counted there), over the file's setup, calls and teardown;
- ``interpreters``: the fresh Python interpreters started while the file ran (a forked child is not
  one), and how many of them imported Lightning, with their own CPU seconds (``interpreter_cpu_s``).

The interpreters are counted by a ``sitecustomize`` put first on PYTHONPATH for the session: each
interpreter appends a line when it starts and one, with its CPU and whether it imported Lightning,
when it exits normally. A command given an environment of its own without PYTHONPATH, or with a
``sitecustomize`` of its own (test_ddp_measuring's audit hook), is not seen. Summarise with
``python -m tests.cpu_accounting FILE``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import pytest

LOG_VARIABLE = "TEST_CPU_LOG"
#: The test file running now, inherited by every process it starts (read by the sitecustomize).
FILE_VARIABLE = "TEST_CPU_FILE"

SITECUSTOMIZE = '''
import atexit, json, os, resource, sys

def _line(event, **fields):
    log = os.environ.get("TEST_CPU_LOG")
    if not log:
        return
    with open(log, "a") as out:
        out.write(json.dumps({"event": event, "pid": os.getpid(), "file": os.environ.get("TEST_CPU_FILE"), **fields}) + "\\n")

_pid = os.getpid()
try:
    _argv = open("/proc/self/cmdline", "rb").read().split(b"\\0")[:4]
    _argv = [a.decode(errors="replace")[-80:] for a in _argv]
except OSError:
    _argv = []
_line("start", argv=_argv)

def _at_exit():
    if os.getpid() != _pid:
        return  # a forked child of this interpreter
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _line("exit", cpu_s=usage.ru_utime + usage.ru_stime, lightning="lightning" in sys.modules)

atexit.register(_at_exit)
'''


def _cpu_now() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get(LOG_VARIABLE):
        return
    os.environ[LOG_VARIABLE] = str(Path(os.environ[LOG_VARIABLE]).resolve())
    if "TEST_CPU_SITE" not in os.environ:  # made once, by the controller; its xdist workers inherit it
        site = Path(tempfile.mkdtemp(prefix="test-cpu-site-"))
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        os.environ["TEST_CPU_SITE"] = str(site)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    log = os.environ.get(LOG_VARIABLE)
    if not log:
        yield
        return
    name = str(Path(item.path).relative_to(Path(str(item.config.rootpath))))
    os.environ[FILE_VARIABLE] = name
    before = _cpu_now()
    yield
    with open(log, "a") as out:
        out.write(json.dumps({"event": "test", "file": name, "test": item.name, "cpu_s": _cpu_now() - before,
                              "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}) + "\n")


def summarise(log: Path) -> list[dict[str, Any]]:
    """Per test file: CPU seconds of its tests, fresh interpreters (with Lightning), their CPU."""
    files: dict[str, dict[str, Any]] = defaultdict(lambda: {"cpu_s": 0.0, "tests": 0, "interpreters": 0,
                                                            "with_lightning": 0, "interpreter_cpu_s": 0.0})
    started_in: dict[int, str | None] = {}  # an interpreter's exit counts where it started (an xdist
    # worker's environment names the last file it ran when it exits)
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        if entry["event"] == "start":
            started_in[entry["pid"]] = entry.get("file")
        where = started_in.get(entry["pid"], entry.get("file")) if entry["event"] == "exit" else entry.get("file")
        row = files[where or "(outside a test)"]
        if entry["event"] == "test":
            row["cpu_s"] += entry["cpu_s"]
            row["tests"] += 1
        elif entry["event"] == "start":
            row["interpreters"] += 1
        elif entry["event"] == "exit":
            row["interpreter_cpu_s"] += entry["cpu_s"]
            row["with_lightning"] += bool(entry["lightning"])
    return sorted(({"file": name, **row} for name, row in files.items()), key=lambda r: -r["cpu_s"])


def main(argv: list[str]) -> None:
    rows = summarise(Path(argv[0]))
    print(f"{'file':60} {'tests':>5} {'cpu_s':>8} {'interp':>6} {'w/ L':>5} {'interp_cpu_s':>12}")
    for r in rows:
        print(f"{r['file']:60} {r['tests']:5d} {r['cpu_s']:8.1f} {r['interpreters']:6d} {r['with_lightning']:5d} "
              f"{r['interpreter_cpu_s']:12.1f}")
    print(f"{'total':60} {sum(r['tests'] for r in rows):5d} {sum(r['cpu_s'] for r in rows):8.1f} "
          f"{sum(r['interpreters'] for r in rows):6d} {sum(r['with_lightning'] for r in rows):5d} "
          f"{sum(r['interpreter_cpu_s'] for r in rows):12.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
