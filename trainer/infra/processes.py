"""This machine's processes and ports, as the benchmarks, the load test and the tests need them (Linux).

CPU time is read from /proc rather than measured by the wall clock, so what another program or a
VM's steal takes is not counted."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command's name (which may hold spaces and parentheses): the state is
    [0], utime and stime [11] and [12], the start time in clock ticks [19]. OSError once it is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process so far, from /proc/PID/stat."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_bytes(pid: int) -> tuple[int, int, int]:
    """(RSS, PSS, USS) of a process from /proc/PID/smaps_rollup. PSS divides each shared page among
    the processes sharing it: forked processes share most of their parent's pages, so RSS summed over
    them counts those pages several times, PSS summed once. USS, its private pages, is what ending it frees."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, _, value = line.partition(":")
        fields[name] = int(value.split()[0]) * 1024 if value.split() else 0
    return fields.get("Rss", 0), fields.get("Pss", 0), fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)


def descendants(pid: int) -> list[int]:
    """The pids of a process's children, their children and so on (from /proc/PID/task/*/children)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def running(pids: "list[int] | set[int]") -> list[int]:
    """Those of `pids` still running: a zombie has exited (only its parent's wait is missing) and a
    pid no longer in /proc is gone."""
    alive = []
    for pid in pids:
        try:
            state = stat_fields(pid)[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
