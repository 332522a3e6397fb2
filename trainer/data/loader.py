"""DataLoader settings for this machine, each with the reason it was chosen; what loader workers do
with stop signals (`WorkerStart`); failures inside loader workers turned into one actionable line
(`loader_failure`)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
from dataclasses import dataclass
from typing import Any, Literal, Union

from lightning.fabric.utilities.seed import pl_worker_init_function

from trainer.infra.devices import usable_cpus
from trainer.infra.errors import UserError
from trainer.infra.fingerprint import proc_kib
from trainer.infra.signals import preemption_signal

Auto = Literal["auto"]


@dataclass(frozen=True)
class LoaderSettings:
    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    reasons: dict[str, str]
    #: Batches copied to the GPU on a side stream (trainer/data/transfer.py), not on the compute stream.
    copy_overlap: bool = False

    def dataloader_kwargs(self, rank: int = 0) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"num_workers": self.num_workers, "pin_memory": self.pin_memory,
                                  "persistent_workers": self.persistent_workers}
        if self.num_workers > 0:
            kwargs["worker_init_fn"] = WorkerStart(rank)
            if self.prefetch_factor is not None:
                kwargs["prefetch_factor"] = self.prefetch_factor
        return kwargs


class WorkerStart:
    """A loader worker's `worker_init_fn`. SLURM signals every process of a job step: USR2's default
    action would kill a worker mid-epoch, and the training process would fail on it before writing its
    checkpoint. Workers ignore the scheduler's signals and leave them to the training process.
    Lightning's own worker_init_fn (``seed_everything(workers=True)``) is called here."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self, worker_id: int) -> None:
        for signum in (signal.SIGTERM, preemption_signal()):
            signal.signal(signum, signal.SIG_IGN)
        if os.environ.get("PL_SEED_WORKERS") == "1":
            pl_worker_init_function(worker_id, rank=self.rank)


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
    copy_overlap: Union[bool, Auto] = "auto",
) -> LoaderSettings:
    """Turn ``auto`` into concrete values.
    Workers: none for data already in memory (they would only add inter-process copies); else one
    per usable CPU minus one for the training process, at most 8 (past that the gains are rarely
    worth the memory, and too many workers hurt). Prefetch: PyTorch's 2 batches per worker, fewer
    when the batches in flight would take more than `PREFETCH_MEMORY_SHARE` of the available memory.
    Copy overlap: with CUDA and pinned batches (from pageable memory the copy is synchronous, so a
    side stream would only add an event per batch)."""
    cpus = cpus or usable_cpus()
    reasons: dict[str, str] = {}
    if num_workers != "auto":
        workers = int(num_workers)
        reasons["num_workers"] = f"{workers} (as configured)"
    elif in_memory:
        workers, reasons["num_workers"] = 0, "auto -> 0 (data set held in memory: workers would only add copies)"
    else:
        workers = max(0, min(8, cpus - 1))
        reasons["num_workers"] = f"auto -> {workers} ({cpus} usable CPUs, one left for the training loop, at most 8)"
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
        prefetch, reasons["prefetch_factor"] = None, "none (no workers)"
    elif prefetch_factor == "auto" or prefetch_factor is None:
        prefetch, reasons["prefetch_factor"] = _bounded_prefetch(workers, batch_bytes, available_bytes)
    else:
        prefetch = int(prefetch_factor)
        reasons["prefetch_factor"] = f"{prefetch} (as configured)"
    overlap, reasons["copy_overlap"] = _copy_overlap(copy_overlap, cuda, pin)
    return LoaderSettings(workers, pin, persistent, prefetch, reasons, overlap)


def _copy_overlap(requested: Union[bool, Auto], cuda: bool, pinned: bool) -> tuple[bool, str]:
    """Whether batches are copied on a side stream, and why; on without CUDA it steps aside (the
    copy then is Lightning's move, which is what a CPU run does anyway)."""
    if requested == "auto":
        overlap = cuda and pinned
        why = ("CUDA, pinned batches: the copy of the next batch overlaps this step's compute" if overlap
               else "no CUDA" if not cuda else "batches not pinned: the copy cannot be asynchronous")
        return overlap, f"auto -> {str(overlap).lower()} ({why})"
    if requested and not cuda:
        return False, "false (true as configured; no CUDA: nothing to overlap)"
    return bool(requested), f"{str(bool(requested)).lower()} (as configured" + (
        "; batches not pinned: each is moved as Lightning does" if requested and not pinned else "") + ")"


PREFETCH_TARGET = 2  # PyTorch's default: enough to hide jitter in per-batch loading time
PREFETCH_MEMORY_SHARE = 0.1  # of the available memory, for the batches in flight


def _bounded_prefetch(workers: int, batch_bytes: int | None, available_bytes: int | None) -> tuple[int, str]:
    """Batches in flight (workers x prefetch) must fit in `PREFETCH_MEMORY_SHARE` of available memory."""
    available_bytes = available_bytes if available_bytes is not None else available_memory()
    if not batch_bytes or not available_bytes:
        return PREFETCH_TARGET, f"auto -> {PREFETCH_TARGET} batches per worker (batch size in bytes unknown)"
    budget = int(available_bytes * PREFETCH_MEMORY_SHARE)
    fits = budget // (workers * batch_bytes)
    prefetch = max(1, min(PREFETCH_TARGET, fits))
    return prefetch, (f"auto -> {prefetch} batches per worker ({workers} x {prefetch} x {batch_bytes / 2**20:.1f} MiB "
                      f"in flight, budget {PREFETCH_MEMORY_SHARE:.0%} of {available_bytes / 2**30:.1f} GiB available)")


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else free physical pages; None if unknown."""
    available = proc_kib("/proc/meminfo", "MemAvailable")
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


_WORKER_RAISED = re.compile(r"Caught (?P<name>\w+) in DataLoader worker process (?P<worker>\d+)")
_WORKER_DIED = re.compile(r"DataLoader worker \(pids?(?:\(s\))? (?P<pids>[\d, ]+)\) "
                          r"(?:is killed by signal: (?P<signal>[^.]+)"
                          r"|exited unexpectedly(?: with exit code (?P<code>-?\d+))?)")


def loader_failure(ex: BaseException) -> UserError | None:
    """One actionable line for a failure inside a DataLoader worker, or None if `ex` is not one:
    a `UserError` of the data set as it is; another worker exception as its last line and the hint
    ``data.num_workers=0``; a dead worker (the OOM killer, SIGBUS when /dev/shm is full) with its
    signal or exit code, the likely causes and what to try."""
    for cause in _chain(ex):
        if isinstance(cause, UserError):
            return cause
        text = str(cause)
        raised = _WORKER_RAISED.search(text)
        if raised:
            line = _exception_line(text, raised["name"])
            original = _user_error_class(line)
            if original is not None:
                where, _, problem = line.split(": ", 1)[1].partition(": ")
                return UserError(where, problem) if problem else UserError("data", where)
            return UserError("data.num_workers", f"loader worker process {raised['worker']} raised {line}",
                             "rerun with data.num_workers=0 to see the full traceback in the main process")
        died = _WORKER_DIED.search(text)
        if died:
            code = int(died["code"]) if died["code"] else _exit_code_of_dead_worker(cause)
            how = (f"was killed by {_signal_name(died['signal'].strip())}" if died["signal"]
                   else f"was killed by {_signal_name(-code)}" if code is not None and code < 0
                   else f"exited with code {code}" if code is not None else "exited unexpectedly")
            return UserError("data.num_workers", f"a loader worker process (pid {died['pids'].strip()}) {how}, "
                             f"most likely out of host memory (the kernel's OOM killer sends SIGKILL) or out of "
                             f"shared memory for batches in flight (SIGBUS; {_shm_text()})",
                             "fewer workers (data.num_workers), a smaller data.batch_size or data.prefetch_factor, "
                             "a larger /dev/shm (docker run --shm-size=8g), or data.num_workers=0 to see the error "
                             "in the main process")
    return None


def _chain(ex: BaseException) -> list[BaseException]:
    """`ex` and the exceptions it was raised from or during, outermost first."""
    seen: list[BaseException] = []
    current: BaseException | None = ex
    while current is not None and current not in seen and len(seen) < 8:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _exception_line(text: str, name: str) -> str:
    """``Name: message`` from the end of a formatted traceback, a message of several lines joined."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    pattern = re.compile(rf"^(?:[A-Za-z_]\w*\.)*{re.escape(name)}(?::|$)")
    for i in range(len(lines) - 1, 0, -1):
        if pattern.match(lines[i]):
            return " ".join(lines[i:])
    return lines[-1] if lines else text


def _exit_code_of_dead_worker(ex: BaseException) -> int | None:
    """The exit code (negative: the signal) of the worker PyTorch found dead.
    Its "exited unexpectedly" message names only the pid; the process objects are still in the
    frame that raised it (``_try_get_data``'s ``failed_workers``). Best effort: None if not found."""
    tb = ex.__traceback__
    while tb is not None:
        workers = tb.tb_frame.f_locals.get("failed_workers")
        if isinstance(workers, list):
            codes = [getattr(w, "exitcode", None) for w in workers]
            return next((c for c in codes if c is not None), None)
        tb = tb.tb_next
    return None


def _user_error_class(line: str) -> type | None:
    """The class named at the start of a traceback's last line (``pkg.mod.Name: message``), if it is
    a `UserError`: those already say what to do in one line."""
    match = re.match(r"^((?:[A-Za-z_]\w*\.)+)([A-Za-z_]\w*): ", line)
    if not match:
        return None
    # The worker pickled the class by reference, so its module is imported here too: look, never import.
    cls = getattr(sys.modules.get(match.group(1).rstrip(".")), match.group(2), None)
    return cls if isinstance(cls, type) and issubclass(cls, UserError) else None


def _signal_name(description: str | int) -> str:
    """``SIGKILL (Killed)`` from a signal number or the description PyTorch prints (``strsignal``'s text)."""
    for sig in signal.Signals:
        if description in (sig.value, signal.strsignal(sig)):
            return f"{sig.name} ({signal.strsignal(sig)})"
    return f"signal {description}"


def _shm_text() -> str:
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError:
        return "/dev/shm not found"
    return f"/dev/shm has {usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.1f} GiB"
