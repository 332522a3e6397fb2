"""Shared test helpers: composing the real config, running train.py, writing small data sets."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Callable, ClassVar, Mapping, Sequence

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.models.small_cnn import SmallCNN
from trainer.tasks.protocol import TaskDefinition

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
RECIPES = REPO / "recipes"


def compose(overrides: Sequence[str] = ()) -> Any:
    """The composed config exactly as `train.py` would see it (minus the hydra node)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from trainer.configuration.hydra_setup import install as install_hydra_setup

    install_hydra_setup()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=list(overrides))


def run_in_process(overrides: Sequence[str], run_dir: Path) -> dict[str, Any] | None:
    """Compose as `train.py` does and run in this process (no interpreter start, no import cost);
    returns summary.json, or None when the run wrote none (diagnose)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from trainer.configuration.hydra_setup import install as install_hydra_setup
    from trainer.run import run

    install_hydra_setup()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hydra_compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
        choices = {k: str(v) for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra") and v is not None}
        run(cfg, run_dir=run_dir, group_choices=choices, overrides=list(overrides))
    summary = run_dir / "summary.json"
    return json.loads(summary.read_text()) if summary.exists() else None


def prepared_run(config: Any, run_dir: Path, choices: dict[str, str] | None = None) -> Any:
    """A `Run` as trainer/run.py has it after the build of its parts (validated, devices decided,
    identified, data module and network made), from a composed config or its plain values."""
    from trainer.callbacks.graceful import SignalLatch
    from trainer.phases.build import build_parts
    from trainer.phases.compose import Job
    from trainer.phases.identify import check_job, identify
    from trainer.phases.state import Run

    run = Run(Job(config, Path(run_dir), dict(choices or {}), []), SignalLatch())
    check_job(run)
    identify(run)
    build_parts(run)
    return run


def planned_run(config: Any, run_dir: Path, choices: dict[str, str] | None = None) -> Any:
    """`prepared_run`, then the resolve phase: `run.plan` as a run resolves it (no finder runs)."""
    from trainer.phases.plan import decide_probe, resolve

    run = prepared_run(config, run_dir, choices)
    run.plan = resolve(run.spec, decide_probe(run.spec, run.devices, run.parts), run.parts)
    return run


#: Pins a run to the CPU. Every test must pass on a machine with a GPU as well as without one, so a
#: run that leaves `trainer.accelerator=auto` may land on CUDA (bf16-mixed, channels_last, TF32,
#: fused optimizer, pinned memory, MFU). A test whose claim only holds on the CPU (bit-identical
#: weights after resume, losses or accuracy bands measured on the CPU, gloo DDP, one-thread
#: determinism) adds these overrides and says why; no other test may assume CUDA is absent.
#: (`train_forked` adds them itself: see there.)
ON_CPU = ["trainer.accelerator=cpu"]


def _pins_accelerator(args: Sequence[str]) -> bool:
    return any(a.split("=", 1)[0].lstrip("+~") == "trainer.accelerator" for a in args)


#: Overrides that shrink any recipe to a two-step run on tiny device-generated images.
TINY = ["data=synthetic", "data.shape=[3,16,16]", "data.batch_size=4", "data.train_samples=8", "data.val_samples=4",
        "data.test_samples=4", "trainer.max_steps=2", "trainer.max_epochs=1", "trainer.num_sanity_val_steps=0",
        "trainer.limit_val_batches=1", "trainer.limit_test_batches=1", "checkpointing=off", "progress=off"]


class Result:
    def __init__(self, proc: subprocess.CompletedProcess[str], run_dir: Path | None) -> None:
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.run_dir = run_dir

    @property
    def summary(self) -> dict[str, Any]:
        assert self.run_dir is not None, "a run of train.py has a run folder; python_forked's commands do not"
        return json.loads((self.run_dir / "summary.json").read_text())

    def __repr__(self) -> str:
        return f"rc={self.returncode}\n--- stdout ---\n{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-4000:]}"


def train(args: Sequence[str], run_dir: Path, env: dict[str, str] | None = None, timeout: float = 600) -> Result:
    """Run `python train.py ARGS` as a person would, with its run folder at `run_dir`."""
    full_env = dict(os.environ)
    full_env.pop("HYDRA_FULL_ERROR", None)
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout,
    )
    return Result(proc, run_dir)


def train_forked(args: Sequence[str], run_dir: Path, timeout: float = 120,
                 setup: Callable[[], None] | None = None) -> Result:
    """`python train.py ARGS` in a forked child of this process: the same entry point, Hydra
    composition, error handling and exit code as a new interpreter, without paying the ~10 s
    import of torch and Lightning again. The child runs torch on one thread (OpenMP pools do not
    survive a fork), which suits the tests' short runs; loader worker processes work as usual.
    stdout and stderr are captured at the file descriptors, so anything Python or a library writes
    is seen. `setup` runs in the child first (fault injection); a child killed by a signal N
    returns -N.

    The child always trains on the CPU: CUDA cannot be used in a process forked from one that has
    touched it (the driver does not survive fork; torch raises "Cannot re-initialize CUDA in forked
    subprocess"), and on a GPU machine this pytest process has (asking `torch.cuda.is_available()`
    already counts, and in-process runs initialize it). So `trainer.accelerator=cpu` is added to
    `args` unless they name an accelerator themselves, and the child's torch reports no CUDA device,
    so that nothing in the run (the environment fingerprint, Lightning's device report) tries to
    initialize it. GPU behaviour is tested through `run_in_process`, `train` and tests/gpu/."""
    with ForkedRun(train_py_argv(args, run_dir), run_dir, setup) as child:
        return child.wait(timeout)


def ddp_forked(args: Sequence[str], root: Path, timeout: float = 300, setup: Callable[[], None] | None = None,
               env: dict[str, str] | None = None) -> Result:
    """`python train.py ARGS run.root=ROOT` for a run on several CPU processes started by Lightning
    (`trainer=ddp trainer.devices=2 trainer.accelerator=cpu`), rank 0 a forked child as in
    `train_forked`. Lightning's own launcher then starts every other rank as it always does (its
    command line, environment, working folder and `subprocess.Popen`), with one difference: the
    interpreter it names is `_RankServer`'s stand-in, which has the rank forked from this pytest
    process as well (see there), so no rank imports torch and Lightning again. One thread per
    process (OMP_NUM_THREADS=1 for every rank; the forked ones set it), the environment this
    process's, less HYDRA_FULL_ERROR, plus `env`. Rank 0 leads its own process group and the other
    ranks join it: killpg ends the whole job, as `start_new_session` did for a launched interpreter.
    `setup` runs first in every rank (what a `sitecustomize` on PYTHONPATH did in a new interpreter).
    A test whose claim is the launch itself (a new interpreter for each rank) starts it with
    `subprocess`."""
    full_env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    full_env.update(OMP_NUM_THREADS="1", **(env or {}))
    with _RankServer(setup) as ranks:
        def rank_zero() -> None:
            ranks.launch_ranks_here()
            if setup is not None:
                setup()

        with ForkedRun([str(REPO / "train.py"), *args, f"run.root={root}"], None, rank_zero, env=full_env) as child:
            return ranks.wait(child, timeout)


def launch_with_forked_ranks(commands: Sequence[Sequence[str]], env: Mapping[str, str], cwd: Path = REPO,
                             timeout: float = 300) -> list[subprocess.CompletedProcess[str]]:
    """Run launchers side by side, each `python COMMAND` (`-m torch.distributed.run ...`) in a forked
    child of this process as `python_forked` runs it, in a process group of its own (as
    `start_new_session` gave a new interpreter) with a new interpreter's signal dispositions, and with
    `PYTHON_EXEC` (the interpreter torchrun starts its ranks with) naming `_RankServer`'s stand-in:
    torchrun works as always (its rendezvous, its worker processes in sessions of their own, its
    signals to them, its report of how they ended and its exit status), but neither it nor any rank
    imports torch and Lightning again. Their results as `subprocess.run(..., capture_output=True,
    text=True)` gives them; past `timeout`, every launcher and rank is killed and the results say so
    (status -9)."""
    with _RankServer() as ranks, contextlib.ExitStack() as stack:
        launches = [stack.enter_context(ForkedRun(command, cwd=cwd, env={**env, "PYTHON_EXEC": str(ranks.python)},
                                                  setup=new_interpreter_signals)) for command in commands]
        if not ranks.serve(lambda: all(launch.done() for launch in launches), timeout):
            for launch in launches:
                launch.kill()
        results = [launch.wait(60) for launch in launches]
        return [subprocess.CompletedProcess(list(command), result.returncode, result.stdout, result.stderr)
                for command, result in zip(commands, results)]


#: The start of a stand-in for `python` (a template: `python`, `address`): it sends its arguments,
#: folder, environment, process group and stdio (the descriptors themselves) to its server, which
#: forks the command (`receive_command`, `take_the_callers_place`). Imports only the standard library.
STAND_IN_REQUEST = '''#!{python}
import json, os, signal, socket, sys

server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.connect({address!r})
request = json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ),
                      "pgid": os.getpgrp()}}).encode()
socket.send_fds(server, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
'''
#: Its end, once `status` holds the command's: it exits with it, or dies of the command's signal.
STAND_IN_EXIT = '''if status < 0:  # the command died of a signal: so does its stand-in
    if -status not in (signal.SIGKILL, signal.SIGSTOP):  # (those two have no handler to take away)
        signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
sys.exit(status)
'''
#: `_RankServer`'s stand-in: between the two, it learns its rank's pid and passes on the signals a
#: launcher sends it (Lightning's `kill`).
RANK_CLIENT = STAND_IN_REQUEST + '''reply = server.makefile("rb")
rank = int(reply.readline())

def forward(signum, frame):
    try:
        os.kill(rank, signum)
    except ProcessLookupError:
        pass

for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(signum, forward)
status = int(reply.read() or b"1")
''' + STAND_IN_EXIT


class _RankServer:
    """The ranks a launcher starts (Lightning's, torchrun), forked from this pytest process (which
    has imported torch and Lightning once) instead of new interpreters importing them again (~8 s of
    CPU each on two cores). The launcher is given `self.python`, a small stand-in script, as the
    interpreter (Lightning's: `launch_ranks_here` in rank 0; torchrun's: PYTHON_EXEC); the stand-in
    sends its request here and this process, while it waits for the launch (`serve`), forks a child
    that joins the stand-in's process group where it can (Lightning's launch: rank 0's; torchrun's
    stand-ins lead sessions of their own, and the rank leads a group of its own), takes its
    descriptors, environment and folder, and runs the command as `python_forked` does, with a new
    interpreter's signal dispositions and Lightning's rank-zero flag set from the environment as a
    new interpreter's import sets it. The stand-in passes on the signals it is sent and ends as its
    rank ends; a stand-in killed (SIGKILL cannot be passed on) takes its rank with it."""

    def __init__(self, setup: Callable[[], None] | None = None) -> None:
        self._setup = setup
        self._tmp, self.python, self._listener = open_stand_in(RANK_CLIENT, "ranks-")
        self._ranks: dict[int, Any] = {}  # forked rank -> its stand-in's connection
        self.served = 0

    def launch_ranks_here(self) -> None:
        """In rank 0: Lightning's launcher starts the other ranks through `self.python`."""
        import lightning.pytorch.strategies.launchers.subprocess_script as launcher

        self._listener.close()  # rank 0's copy: only this pytest process serves
        stand_in = str(self.python)

        def popen(command: Sequence[str], *args: Any, **kwargs: Any) -> subprocess.Popen:
            assert command[0] == sys.executable, command  # the launcher's interpreter, replaced
            return subprocess.Popen([stand_in, *command[1:]], *args, **kwargs)

        launcher.subprocess = SimpleNamespace(Popen=popen)  # type: ignore[assignment]

    def wait(self, child: ForkedRun, timeout: float) -> Result:
        """Serve the stand-ins while rank 0 (`child`) runs; its result. Past `timeout` the whole job
        is killed and TimeoutError raised."""
        if not self.serve(child.done, timeout):
            child.kill()
            child.wait(60)
            raise TimeoutError(f"{' '.join(child.args)} did not finish in {timeout} s")
        return child.wait(0)

    def serve(self, ended: Callable[[], bool], timeout: float, grace: float = 60) -> bool:
        """Serve the stand-ins until `ended()` (the launch has ended) and every rank forked here has
        ended; False, with the ranks killed, where that took longer than `timeout`. A rank still
        running `grace` seconds after the launch ended is killed (a rank started as a new interpreter
        would have been left behind)."""
        import time

        deadline = time.monotonic() + timeout
        launch_ended = False
        while not launch_ended or self._ranks:
            if not launch_ended and ended():
                launch_ended, deadline = True, min(deadline, time.monotonic() + grace)
            if time.monotonic() > deadline:
                self._kill_all()
                return launch_ended
            self._serve_once(0.02)
        return True

    def _serve_once(self, wait_s: float) -> None:
        import select

        readable = select.select([self._listener, *self._ranks.values()], [], [], wait_s)[0]
        for ready in readable:
            if ready is self._listener:
                self._serve(self._listener.accept()[0])
        for pid, connection in list(self._ranks.items()):
            if connection in readable and not connection.recv(1):  # its stand-in is gone
                self._kill(pid)
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                self._ranks.pop(pid)
                try:
                    connection.sendall(str(os.waitstatus_to_exitcode(status)).encode())
                except OSError:
                    pass  # the stand-in was killed: nobody waits for the status
                connection.close()

    def _serve(self, connection: Any) -> None:
        request, fds = receive_command(connection)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._become_rank(request, fds)
        for fd in fds:
            os.close(fd)
        connection.sendall(f"{pid}\n".encode())
        self._ranks[pid] = connection
        self.served += 1

    def _become_rank(self, request: dict[str, Any], fds: list[int]) -> None:
        """In the forked child: the stand-in's process group and descriptors, then its command."""
        def rank() -> int:
            take_the_callers_place(request, fds, [self._listener, *self._ranks.values()])

            def rank_setup() -> None:
                # Lightning sets its rank-zero flag from the environment when it is imported (here, in
                # pytest, with no rank): set it as this rank's new interpreter would have.
                from lightning.fabric.utilities import rank_zero
                from lightning_utilities.core.rank_zero import rank_zero_only

                rank_zero_only.rank = rank_zero.rank_zero_only.rank = rank_zero._get_rank() or 0
                if self._setup is not None:
                    self._setup()

            argv = request["argv"][1:] if request["argv"][:1] == ["-u"] else request["argv"]  # torchrun's -u
            return run_as_python(argv, Path(request["cwd"]), request["env"], rank_setup, script_path=True)

        exit_with(rank)

    def _kill(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _kill_all(self) -> None:
        for pid in list(self._ranks):
            self._kill(pid)
            os.waitpid(pid, 0)
            self._ranks.pop(pid).close()

    def __enter__(self) -> _RankServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._kill_all()
        self._listener.close()
        self._tmp.cleanup()


def open_stand_in(client: str, prefix: str) -> tuple[Any, Path, Any]:
    """A stand-in for `python` made from the template `client` (`STAND_IN_REQUEST` ...) in a new
    temporary folder named `prefix`..., and the Unix socket it calls, listening: (the folder, the
    stand-in's path, the socket)."""
    import socket
    import tempfile

    folder = tempfile.TemporaryDirectory(prefix=prefix)
    python = Path(folder.name) / "python"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(Path(folder.name) / "socket"))
    listener.listen(16)
    python.write_text(client.format(python=sys.executable, address=str(Path(folder.name) / "socket")))
    python.chmod(0o755)
    return folder, python, listener


def receive_command(connection: Any) -> tuple[dict[str, Any], list[int]]:
    """What a stand-in interpreter sent (tests/fork_server.py's CLIENT, `_RankServer`'s): its request
    (argv, cwd, env, pgid; JSON after an 8-byte length) and the descriptors it passed (0, 1, 2)."""
    import socket

    header, fds, _, _ = socket.recv_fds(connection, 8 + 65536, 3)
    size = int.from_bytes(header[:8], "big")
    body = header[8:]
    while len(body) < size:
        body += connection.recv(size - len(body))
    return json.loads(body), list(fds)


def take_the_callers_place(request: dict[str, Any], fds: Sequence[int], sockets: Sequence[Any]) -> None:
    """In a child forked for a stand-in: the server's sockets closed, the stand-in's process group
    joined (a group of its own where that one is in another session), its descriptors as 0, 1 and 2,
    and a new interpreter's signal dispositions."""
    for connection in sockets:
        connection.close()
    try:
        os.setpgid(0, request["pgid"])
    except OSError:
        os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    new_interpreter_signals()


def exit_with(command: Callable[[], int]) -> None:
    """In a forked child: run `command` and leave with its status (1 where it raised), output flushed
    and nothing of the parent's (pytest's atexit, its fixtures) run."""
    code = 1
    try:
        code = command()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def new_interpreter_signals() -> None:
    """In a forked child: the signal dispositions of a new interpreter (SIGINT raising
    KeyboardInterrupt, the others their defaults), not those this pytest process has."""
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def train_py_argv(args: Sequence[str], run_dir: Path) -> list[str]:
    """What follows `python` for `train_forked`'s run: train.py, `args` pinned to the CPU unless they
    name an accelerator, and the run folder."""
    pinned = list(args) if _pins_accelerator(args) else [*args, *ON_CPU]
    return [str(REPO / "train.py"), *pinned, f"hydra.run.dir={run_dir}"]


def python_forked(python_args: Sequence[str], cwd: Path = REPO, env: dict[str, str] | None = None,
                  timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python PYTHON_ARGS` (a script and its arguments, or `-m MODULE ...`) run as `train_forked`
    runs train.py: in a forked child, in `cwd`, with `env` as its whole environment (this process's,
    less HYDRA_FULL_ERROR, by default), on the CPU; returns what `subprocess.run(...,
    capture_output=True, text=True)` would. For commands whose claim is not about a fresh
    interpreter: what the environment does at interpreter start (PYTHONPATH, PYTHONWARNINGS, an
    extra hidden from imports) needs `subprocess`."""
    with ForkedRun(python_args, cwd=cwd, env=env) as child:
        done = child.wait(timeout)
    return subprocess.CompletedProcess(list(python_args), done.returncode, done.stdout, done.stderr)


def run_as_python(python_args: Sequence[str], cwd: Path, env: dict[str, str] | None,
                  setup: Callable[[], None] | None = None, script_path: bool = False) -> int:
    """In a forked child whose fds 1 and 2 are already where its output goes: behave as `python
    PYTHON_ARGS` (a script and its arguments, or `-m MODULE ...`) and return its exit status. `env`
    replaces the environment (None: keep it). `script_path`: put the script's folder (or, for `-m`,
    the working folder) first on sys.path, as a new interpreter does (ForkedRun's callers never
    needed it; tests/fork_server.py's do)."""
    import runpy
    import warnings

    # pytest's capture replaced sys.stdin/out/err with its own files: point them at the fds.
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    os.environ.pop("HYDRA_FULL_ERROR", None)
    os.chdir(cwd)
    # The parent's OpenMP threads do not survive a fork; one thread is safe (as in
    # DataLoader workers) and enough for a run that is meant to stop early.
    torch.set_num_threads(1)
    # No CUDA in a forked child (see train_forked): report none, so nothing touches it.
    torch.cuda.is_available = lambda: False  # type: ignore[assignment]
    torch.cuda.device_count = lambda: 0  # type: ignore[assignment]
    # runpy's note that the module ran is already imported here (this process's tests import it).
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package",
                            category=RuntimeWarning)
    if script_path:
        first = os.getcwd() if python_args[0] == "-m" else str(Path(python_args[0]).resolve().parent)
        sys.path.insert(0, first)
    if setup is not None:
        setup()
    try:
        if python_args[0] == "-m":
            sys.argv = [python_args[1], *python_args[2:]]
            runpy.run_module(python_args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(python_args)
            runpy.run_path(python_args[0], run_name="__main__")
        return 0
    except SystemExit as ex:
        if ex.code is not None and not isinstance(ex.code, int):
            print(ex.code, file=sys.stderr)  # as Python prints sys.exit("message")
        return ex.code if isinstance(ex.code, int) else (0 if ex.code is None else 1)
    except BaseException:  # noqa: BLE001 - an uncaught error prints its traceback, as Python would
        import traceback

        traceback.print_exc()
        return 1


class ForkedRun:
    """`python_forked` (for train.py: `train_py_argv` and its `run_dir`, as `train_forked`) started
    without waiting for it: the child leads a process group of its own (with its loader workers), so
    `kill` ends all of it at once, as a lost node would."""

    def __init__(self, python_args: Sequence[str], run_dir: Path | None = None,
                 setup: Callable[[], None] | None = None, cwd: Path = REPO, env: dict[str, str] | None = None) -> None:
        import tempfile

        import hydra  # noqa: F401
        import lightning  # noqa: F401 - imported once here, inherited by every child

        self.args = list(python_args)
        self.run_dir = run_dir
        self._tmp = tempfile.TemporaryDirectory()
        self._out, self._err = Path(self._tmp.name) / "stdout", Path(self._tmp.name) / "stderr"
        self._status: int | None = None
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            self._become_python(self.args, cwd, env, setup)

    def _become_python(self, python_args: list[str], cwd: Path, env: dict[str, str] | None,
                       setup: Callable[[], None] | None) -> None:
        """In the child: stdout and stderr into this run's files, then `python PYTHON_ARGS`
        (train.py's, or another script or module), then exit with its status."""
        code = 1
        try:
            os.setpgid(0, 0)
            for fd, path in ((1, self._out), (2, self._err)):
                target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(target, fd)
                os.close(target)
            code = run_as_python(python_args, cwd, env, setup)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def done(self) -> bool:
        if self._status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._status = status
        return self._status is not None

    def output(self) -> str:
        """What the child has written to its stdout so far (nothing before it has opened the file)."""
        return self._out.read_text(errors="replace") if self._out.exists() else ""

    def send_signal(self, signum: int) -> None:
        """`signum` to the child alone (not its group), as `subprocess.Popen.send_signal` sends it."""
        if not self.done():
            os.kill(self.pid, signum)

    def kill(self) -> None:
        """SIGKILL the child and everything in its process group; no handler runs, nothing is flushed."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it had ended, and its group with it

    def wait(self, timeout: float = 120) -> Result:
        import time

        deadline = time.monotonic() + timeout
        while not self.done():
            if time.monotonic() > deadline:
                self.kill()
                os.waitpid(self.pid, 0)
                raise TimeoutError(f"{' '.join(self.args)} did not finish in {timeout} s")
            time.sleep(0.02)
        assert self._status is not None
        proc = subprocess.CompletedProcess(self.args, os.waitstatus_to_exitcode(self._status),
                                           self._out.read_text(), self._err.read_text())
        return Result(proc, self.run_dir)

    def __enter__(self) -> ForkedRun:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.done():
            self.kill()
            os.waitpid(self.pid, 0)
        self._tmp.cleanup()


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return (bunch.images * (255.0 / 16.0)).round().astype(np.uint8), bunch.target


def write_digit_pngs(root: Path, per_class: dict[str, int], classes: Sequence[int] = range(10), size: int = 16,
                     suffix: str = ".png") -> None:
    """An ImageFolder tree of real digit images, upscaled to `size` px, as grayscale PNGs (or JPEGs
    at quality 95 with ``suffix=".jpg"``)."""
    from PIL import Image

    images, labels = digits_arrays()
    rng = np.random.default_rng(0)
    used: set[int] = set()
    for split, count in per_class.items():
        for c in classes:
            folder = root / split / f"digit_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            candidates = [i for i in np.flatnonzero(labels == c) if i not in used]
            for i in rng.choice(candidates, size=count, replace=False):
                used.add(int(i))
                digit = Image.fromarray(images[i], mode="L").resize((size, size), Image.NEAREST)
                digit.save(folder / f"{i}{suffix}", **({"quality": 95} if suffix == ".jpg" else {}))


def write_photo_jpegs(root: Path, per_class: dict[str, int], classes: int = 2, size: tuple[int, int] = (160, 120),
                      seed: int = 0) -> None:
    """An ImageFolder tree of real photos (scikit-learn's bundled two, cut at random places and
    scales, alternately landscape and portrait), as RGB JPEGs at quality 90."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    rng = np.random.default_rng(seed)
    photos = [Image.fromarray(a) for a in load_sample_images().images]
    n = 0
    for split, count in per_class.items():
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for _ in range(count):
                photo = photos[n % len(photos)]
                width, height = size if n % 2 == 0 else size[::-1]
                least = max(width / photo.width, height / photo.height)
                scale = rng.uniform(least, max(least, 1.0))
                big = photo.resize((max(width, int(photo.width * scale)), max(height, int(photo.height * scale))))
                left, top = int(rng.integers(0, big.width - width + 1)), int(rng.integers(0, big.height - height + 1))
                big.crop((left, top, left + width, top + height)).save(folder / f"{n:04d}.jpg", quality=90)
                n += 1


def write_cifar_copy(root: Path, train_per_batch: int = 200, test: int = 200, batches: int = 2) -> Path:
    """A tiny CIFAR-10 in torchvision's on-disk format. Each class is a distinct colour pattern under
    noise, so a model can learn it; the files are pickled dicts of numpy arrays as in the original."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    # Each class: its own coarse 4x4 colour mosaic, upscaled to 32x32.
    patterns = np.kron(rng.integers(0, 256, size=(10, 3, 4, 4)), np.ones((1, 1, 8, 8))).astype(np.float64)

    def make(n: int) -> dict[bytes, Any]:
        labels = np.arange(n) % 10
        rng.shuffle(labels)
        noise = rng.normal(0, 25, size=(n, 3, 32, 32))
        images = np.clip(patterns[labels] + noise, 0, 255).astype(np.uint8)
        return {b"batch_label": b"tiny", b"labels": labels.tolist(), b"data": images.reshape(n, -1),
                b"filenames": [f"{i}.png".encode() for i in range(n)]}

    for b in range(1, batches + 1):
        (folder / f"data_batch_{b}").write_bytes(pickle.dumps(make(train_per_batch)))
    (folder / "test_batch").write_bytes(pickle.dumps(make(test)))
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": [b"c%d" % i for i in range(10)]}))
    return folder


class TinyMLP(nn.Module):
    """A team's own model, plugged in by `_target_` in the tests."""

    def __init__(self, num_classes: int, in_channels: int, image_size: Sequence[int], hidden: int = 64) -> None:
        super().__init__()
        features = in_channels * image_size[0] * image_size[1]
        self.net = nn.Sequential(nn.Flatten(1), nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CrashesAt:
    """Mixed into a model: raises `failure()` inside training forward call number `fail_at`."""

    fail_at: int
    calls: int
    training: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.fail_at:
                raise self.failure()
        return super().forward(x)  # type: ignore[misc]

    def failure(self) -> BaseException:
        return RuntimeError("simulated crash in the forward pass")


class ExplodingMLP(CrashesAt, TinyMLP):
    """Raises inside the training forward pass on call number `fail_at` (a crash mid-run)."""

    def __init__(self, num_classes: int, in_channels: int, image_size: Sequence[int], fail_at: int = 25) -> None:
        super().__init__(num_classes, in_channels, image_size)
        self.fail_at = fail_at
        self.calls = 0


class NaNMLP(TinyMLP):
    """Outputs NaN on the training forward calls listed in `nan_at` (1-based), or on every call from
    `nan_from` on."""

    def __init__(self, num_classes: int, in_channels: int, image_size: Sequence[int],
                 nan_at: Sequence[int] = (), nan_from: int = 0) -> None:
        super().__init__(num_classes, in_channels, image_size)
        self.nan_at = set(nan_at)
        self.nan_from = nan_from
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.training:
            self.calls += 1
            if self.calls in self.nan_at or (self.nan_from and self.calls >= self.nan_from):
                return out * float("nan")
        return out


class MemoryHungryMLP(ExplodingMLP):
    """Raises CUDA's out-of-memory error on training forward call `fail_at` (injected: no GPU needed)."""

    def failure(self) -> BaseException:
        return torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")


class PreemptedCNN(SmallCNN):
    """The default model (same weights, names and initialization) whose process `rank` sends
    itself submitit's preemption signal (USR2) inside training forward call number `signal_at`:
    a scheduler's signal that reaches one process of a multi-process run before the others."""

    def __init__(self, num_classes: int, in_channels: int = 3, widths: Sequence[int] = (32, 64, 128),
                 dropout: float = 0.1, norm: str = "batch", signal_at: int = 25, rank: int = 1) -> None:
        super().__init__(num_classes, in_channels, widths, dropout, norm)
        self.signal_at, self.rank, self.calls = signal_at, rank, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.signal_at and int(os.environ.get("RANK", 0)) == self.rank:
                os.kill(os.getpid(), signal.SIGUSR2)
        return super().forward(x)


class ExplodingCNN(CrashesAt, SmallCNN):
    """The default model (same weights, names and initialization), raising inside training forward
    call number `fail_at`: a crash mid-run of the default configuration."""

    def __init__(self, num_classes: int, in_channels: int = 3, widths: Sequence[int] = (32, 64, 128),
                 dropout: float = 0.1, norm: str = "batch", fail_at: int = 25) -> None:
        super().__init__(num_classes, in_channels, widths, dropout, norm)
        self.fail_at = fail_at
        self.calls = 0


def kill_job() -> None:
    """SIGKILL every process of this process's group: no handler runs, nothing is flushed."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


def kill_during_save(number: int) -> Callable[[], None]:
    """A `setup` for `train_forked`: SIGKILL the job halfway through writing its `number`-th
    checkpoint file (written straight to the file, as a writer without the atomic rename would)."""
    def setup() -> None:
        import io

        import trainer.infra.checkpoint_files

        real_save = torch.save
        calls = {"n": 0}

        def torn_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(f, (str, Path)):
                calls["n"] += 1
                if calls["n"] == number:
                    buffer = io.BytesIO()
                    real_save(obj, buffer, *args, **kwargs)
                    with open(f, "wb") as out:
                        out.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
                        out.flush()
                        os.fsync(out.fileno())
                    kill_job()
            return real_save(obj, f, *args, **kwargs)

        trainer.infra.checkpoint_files.torch.save = torn_save  # type: ignore[attr-defined]
    return setup


def kill_writing_completed_summary() -> None:
    """From now on, writing the summary that says the run completed kills the job halfway through
    (the atomic write's temporary file is half written)."""
    import trainer.infra.atomic
    from trainer.infra.atomic import replace_atomic

    # summary.json goes through write_json_atomic, which looks write_text_atomic up in its module
    real_write = trainer.infra.atomic.write_text_atomic

    def torn_write(path: Path, text: str) -> None:
        if Path(path).name == "summary.json" and '"status": "completed"' in text:
            def half(tmp: Path) -> None:
                tmp.write_text(text[: len(text) // 2])
                kill_job()
            replace_atomic(Path(path), half)
        real_write(path, text)

    trainer.infra.atomic.write_text_atomic = torn_write  # type: ignore[assignment]


class KillJobAt(Callback):
    """A callback (``+callbacks.kill._target_=tests.helpers.KillJobAt``) that SIGKILLs the whole
    job at one moment, from rank 0: every process of its process group (all ranks and their loader
    workers), as a lost node would; start the job in a session of its own. `moment`: ``step``
    (as training step `number` ends), ``test_batch`` (as test batch `number` ends) or ``summary``
    (halfway through writing the summary that says the run completed)."""

    MOMENTS = ("step", "test_batch", "summary")

    def __init__(self, moment: str, number: int = 0) -> None:
        assert moment in self.MOMENTS, moment
        self.moment, self.number = moment, number
        self.rank_zero = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0))) == 0
        if moment == "summary" and self.rank_zero:
            kill_writing_completed_summary()

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self.moment == "step" and self.rank_zero and trainer.global_step == self.number:
            kill_job()

    def on_test_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None:
        if self.moment == "test_batch" and self.rank_zero and batch_idx + 1 == self.number:
            kill_job()


class RecordLr(Callback):
    """A callback (``+callbacks.lr._target_=tests.helpers.RecordLr +callbacks.lr.folder=DIR``) that
    writes the lr of each parameter group, as this process's first training step starts, to
    ``DIR/rank{global rank}.json``: what every process of a run trains with."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self.written = False

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if not self.written:
            self.folder.mkdir(parents=True, exist_ok=True)
            lrs = [group["lr"] for group in trainer.optimizers[0].param_groups]
            (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(lrs))
            self.written = True


class KillNodeAt(Callback):
    """A callback that SIGKILLs its own process group (the rank and its loader workers; under
    torchrun also the launcher when they share a group) as training step `step` ends, on whichever
    process has it: given to one node's launch only, it is a lost node."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            kill_job()


class StopProcessAt(Callback):
    """A callback that SIGKILLs another process (`pid`, e.g. a storage server) as training step
    `step` ends: a store that goes away mid-epoch."""

    def __init__(self, step: int, pid: int) -> None:
        self.step, self.pid = step, pid

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(self.pid, signal.SIGKILL)


def benchmark(name: str) -> ModuleType:
    """The script benchmarks/NAME.py as a module (it imports its neighbours, such as sweep_jobs)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def in_forked_child(check: Callable[[], None], timeout: float = 300) -> None:
    """Run `check` in a forked child of this process and raise its failure here, traceback and all.

    For checks that trace with Dynamo or torch.export: after such a trace, the next backward pass
    starts autograd's device threads, and every later fork of this pytest worker (`train_forked`)
    dies with "Unable to handle autograd's threading in combination with fork-based
    multiprocessing". In a child, the trace leaves the worker as it was."""
    import select
    import time
    import traceback

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, report, leave without running the parent's exit handlers
        os.close(read_end)
        try:
            # The parent's intra-op thread pool did not survive the fork: a child that used it hung
            # (Inductor's compile, after earlier tests of the same process had run ops in parallel).
            torch.set_num_threads(1)
            check()
            report = b""
        except BaseException:  # noqa: BLE001 - every failure goes back to the parent
            report = traceback.format_exc().encode()
        with os.fdopen(write_end, "wb") as out:
            out.write(report)
        os._exit(1 if report else 0)
    os.close(write_end)
    deadline = time.monotonic() + timeout

    def past_deadline() -> None:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise TimeoutError(f"the forked check ran past {timeout} s")

    # The report is read as it comes, the deadline checked between reads: a child that hangs
    # (holding the pipe open) fails this test instead of hanging the worker.
    chunks: list[bytes] = []
    with os.fdopen(read_end, "rb", buffering=0) as source:
        while True:
            past_deadline()
            if select.select([source], [], [], 0.5)[0]:
                chunk = source.read(65536)
                if not chunk:
                    break
                chunks.append(chunk)
    report = b"".join(chunks)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        past_deadline()
        time.sleep(0.01)
    if report or os.waitstatus_to_exitcode(status) != 0:
        raise AssertionError("in the forked child:\n" + (report.decode() or f"exit status {status}"))


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it. killpg is not enough for torchrun: its workers
    start sessions of their own, and one left alive keeps the test's pipes open for ever."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    doomed, queue = [], [pid]
    while queue:
        current = queue.pop()
        doomed.append(current)
        queue.extend(children.get(current, []))
    for victim in doomed:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stop_server(server: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM, as a service manager stops a server; killed if it has not ended within `timeout`."""
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


class LogSteps:
    """Lightning's logger connector as a fake trainer needs it (`trainer._logger_connector`, which
    `trainer.callbacks.steps.at_log_step` asks): its rule as it reads at a batch's end, the optimizer
    step taken: every `log_every_n_steps`-th global step is a log step."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    @property
    def should_update_logs(self) -> bool:
        every = int(self.trainer.log_every_n_steps)
        return every > 0 and int(self.trainer.global_step) % every == 0


def fake_trainer_with_log_steps(**fields: Any) -> Any:
    """A SimpleNamespace trainer with `fields` and Lightning's log-step rule (`LogSteps`); its state is
    no running stage (unless given), so `at_log_step` asks that rule rather than read a fit loop."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(**{"state": SimpleNamespace(stage=None), "log_every_n_steps": 0, **fields})
    trainer._logger_connector = LogSteps(trainer)
    return trainer


class RecordingLogger(Logger):
    """A Lightning logger that keeps what it is given: `logged` is [(step, metrics)]."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> str:
        return "0"

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((int(step or 0), dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class Ops(TorchDispatchMode):
    """The aten operations dispatched while active (forward, backward and optimizer alike), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


class DigitIsLarge(TaskDefinition):
    """A team's own task on the digits: is the digit 5 or more? One logit (the network's first
    output) under BCEWithLogitsLoss, validation and test AUROC: a metric the framework does not know."""

    unit: ClassVar[str] = "samples"
    data_kinds: ClassVar[tuple[str, ...]] = ("images",)
    model_inputs: ClassVar[tuple[str, ...]] = ("num_classes",)
    objective: ClassVar[str] = "val/auroc"

    def targets(self, batch: Any) -> Any:
        return (batch[1] >= 5).float()

    def loss(self, outputs: Any, targets: Any, training: bool) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(outputs[:, 0].float(), targets.float())

    def metrics(self, split: str) -> Mapping[str, Any]:
        from torchmetrics.classification import BinaryAUROC

        return {} if split == "train" else {"auroc": BinaryAUROC()}

    def update_metrics(self, metrics: Mapping[str, Any], outputs: Any, targets: Any) -> None:
        for metric in metrics.values():
            metric.update(outputs[:, 0].detach().float(), targets.long())

    def example_batch(self, size: int, device: torch.device) -> tuple[Any, Any]:
        return torch.randn(size, *self.info.input_shape(), device=device), torch.randint(0, 2, (size,), device=device)


def assert_resumes_mid_epoch(module: Callable[[], Any]) -> None:
    """A data module made by `module()` (set up, seeded), stopped after 2 batches of epoch 1: a new one
    given the sampler's position (the train_position of the base class's state_dict) yields that
    epoch's remaining batches, the same tensors; the next epoch's order differs from this one's."""
    def batches(loader: Any) -> list[tuple[Any, ...]]:
        return [tuple(batch) for batch in loader]

    first = module()
    loader = first.train_dataloader()
    loader.sampler.set_epoch(1)
    epoch = batches(loader)
    assert len(epoch) > 4
    first._train_sampler.taken = 2
    position = first._train_sampler.position(len(loader), first._items_per_batch)
    assert position["epoch"] == 1 and position["batches"] == 2
    resumed = module()
    resumed.load_state_dict({"train_position": position})
    rest = batches(resumed.train_dataloader())
    assert len(rest) == len(epoch) - 2
    for (a, b), (c, d) in zip(rest, epoch[2:]):
        assert torch.equal(a, c) and torch.equal(b, d)
    loader.sampler.set_epoch(2)
    assert not all(torch.equal(a, c) for (a, _), (c, _) in zip(batches(loader), epoch))
