"""DataLoader settings for this machine, each with the reason it was chosen."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Union

Auto = Literal["auto"]


@dataclass(frozen=True)
class LoaderSettings:
    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    reasons: dict[str, str]

    def dataloader_kwargs(self) -> dict[str, object]:
        kwargs: dict[str, object] = {
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.persistent_workers,
        }
        if self.num_workers > 0 and self.prefetch_factor is not None:
            kwargs["prefetch_factor"] = self.prefetch_factor
        return kwargs


def usable_cpus() -> int:
    """CPUs this process may run on (affinity and cgroup-limited containers included)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def resolve_loader(
    num_workers: Union[int, Auto],
    pin_memory: Union[bool, Auto],
    persistent_workers: Union[bool, Auto],
    prefetch_factor: Union[int, Auto, None],
    *,
    in_memory: bool,
    cuda: bool,
    cpus: int | None = None,
    batch_bytes: int | None = None,
    available_bytes: int | None = None,
    memory_fraction: float = 0.1,
) -> LoaderSettings:
    """Turn ``auto`` into concrete values.

    Workers: none for data already in memory (they would only add inter-process copies); else one
    per usable CPU minus one for the training process, at most 8 (past that the gains are rarely
    worth the memory, and too many workers hurt). Prefetch: PyTorch's 2 batches per worker, fewer
    when the batches in flight would take more than `memory_fraction` of the available memory.
    """
    cpus = cpus or usable_cpus()
    reasons: dict[str, str] = {}
    if num_workers == "auto":
        if in_memory:
            workers, reasons["num_workers"] = 0, "auto -> 0 (data set held in memory: workers would only add copies)"
        else:
            workers = max(0, min(8, cpus - 1))
            reasons["num_workers"] = f"auto -> {workers} ({cpus} usable CPUs, one left for the training loop, at most 8)"
    else:
        workers = int(num_workers)
        reasons["num_workers"] = f"{workers} (as configured)"
    if pin_memory == "auto":
        pin = cuda and not in_memory
        reasons["pin_memory"] = f"auto -> {str(pin).lower()} ({'CUDA in use' if cuda else 'no CUDA'}" + (
            ", in-memory data" if in_memory and cuda else "") + ")"
    else:
        pin = bool(pin_memory)
        reasons["pin_memory"] = f"{str(pin).lower()} (as configured)"
    if persistent_workers == "auto":
        persistent = workers > 0
        reasons["persistent_workers"] = f"auto -> {str(persistent).lower()} ({workers} workers)"
    else:
        persistent = bool(persistent_workers) and workers > 0
        reasons["persistent_workers"] = f"{str(persistent).lower()} (as configured" + (
            "; needs workers > 0)" if persistent_workers and workers == 0 else ")")
    if workers == 0:
        prefetch = None
        reasons["prefetch_factor"] = "none (no workers)"
    elif prefetch_factor == "auto" or prefetch_factor is None:
        prefetch, reasons["prefetch_factor"] = _bounded_prefetch(workers, batch_bytes, available_bytes, memory_fraction)
    else:
        prefetch = int(prefetch_factor)
        reasons["prefetch_factor"] = f"{prefetch} (as configured)"
    return LoaderSettings(workers, pin, persistent, prefetch, reasons)


PREFETCH_TARGET = 2  # PyTorch's default: enough to hide jitter in per-batch loading time


def _bounded_prefetch(workers: int, batch_bytes: int | None, available_bytes: int | None,
                      memory_fraction: float) -> tuple[int, str]:
    """Batches in flight (workers x prefetch) must fit in `memory_fraction` of available memory."""
    available_bytes = available_bytes if available_bytes is not None else available_memory()
    if not batch_bytes or not available_bytes:
        return PREFETCH_TARGET, f"auto -> {PREFETCH_TARGET} batches per worker (batch size in bytes unknown)"
    budget = int(available_bytes * memory_fraction)
    fits = budget // (workers * batch_bytes)
    prefetch = max(1, min(PREFETCH_TARGET, fits))
    return prefetch, (f"auto -> {prefetch} batches per worker ({workers} x {prefetch} x {batch_bytes / 2**20:.1f} MiB "
                      f"in flight, budget {memory_fraction:.0%} of {available_bytes / 2**30:.1f} GiB available)")


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else free physical pages; None if unknown."""
    from trainer.env import proc_kib

    available = proc_kib("/proc/meminfo", "MemAvailable")
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
