"""A `python` for scripts that start many Python commands (benchmarks/gpu_check.sh's dry run): each
command runs in a forked child of this pytest process, which has imported torch and Lightning once,
instead of a new interpreter that imports them again (~8 s of CPU each on the 2-core CI machine).

    with ForkServer() as server:
        proc = server.run([script, ...], env={**os.environ, "PYTHON": str(server.python)}, ...)

`server.python` is a small executable (a Python script importing only the standard library) that
stands in for the interpreter: it sends its arguments, working folder, environment, process group
and its stdin/stdout/stderr (the descriptors themselves) over a Unix socket; this process forks a
child that joins the caller's process group (so `timeout` and killpg reach it as they reached the
interpreter), takes those descriptors as its own and runs the command as `python_forked` does
(tests.helpers.run_as_python: on the CPU, one thread, the script's folder first on sys.path); the
stand-in exits with the child's status (or dies of the child's signal). Commands whose claim is about
a new interpreter (what PYTHONPATH or the environment does at its start) must not use it. The
commands a forked command starts itself with `sys.executable` are new interpreters, as before.

The requests are served by the thread that waits in `run` for the script (whose output goes to files,
not pipes, so that nothing blocks), which forks as `ForkedRun` does: no thread is started for it.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

from tests.helpers import STAND_IN_EXIT, STAND_IN_REQUEST, exit_with, open_stand_in, receive_command, run_as_python, take_the_callers_place

#: The stand-in for `python`: its exit is the command's.
CLIENT = STAND_IN_REQUEST + '''reply = b""
while chunk := server.recv(64):
    reply += chunk
status = int(reply or b"1")
''' + STAND_IN_EXIT


class ForkServer:
    """Serves `self.python`'s requests while `run` waits for a command; see the module's doc."""

    def __init__(self) -> None:
        import lightning  # noqa: F401 - imported once here, inherited by every command

        self._tmp, self.python, self._listener = open_stand_in(CLIENT, "fork-server-")
        self._children: dict[int, socket.socket] = {}  # forked command -> its stand-in's connection
        self.served = 0

    def run(self, command: Sequence[str], timeout: float, **popen: Any) -> subprocess.CompletedProcess[str]:
        """`subprocess.run(command, capture_output=True, text=True, timeout=timeout, **popen)`,
        serving the stand-in's requests meanwhile."""
        folder = Path(self._tmp.name)
        with open(folder / "stdout", "w+") as out, open(folder / "stderr", "w+") as err:
            proc = subprocess.Popen(list(command), stdout=out, stderr=err, text=True, **popen)
            deadline = time.monotonic() + timeout
            while proc.poll() is None or self._children:
                if time.monotonic() > deadline:
                    proc.kill()
                    proc.wait()
                    raise subprocess.TimeoutExpired(list(command), timeout)
                if select.select([self._listener], [], [], 0.05)[0]:
                    self._serve(self._listener.accept()[0])
                self._reap()
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(list(command), proc.returncode, out.read(), err.read())

    def _serve(self, connection: socket.socket) -> None:
        request, fds = receive_command(connection)
        pid = os.fork()
        if pid == 0:
            self._become_command(request, fds)
        for fd in fds:
            os.close(fd)
        self._children[pid] = connection
        self.served += 1

    def _become_command(self, request: dict[str, Any], fds: list[int]) -> None:
        """In the forked child: the caller's process group and descriptors, then its command."""
        def command() -> int:
            take_the_callers_place(request, fds, [self._listener, *self._children.values()])
            return run_as_python(request["argv"], Path(request["cwd"]), request["env"], script_path=True)

        exit_with(command)

    def _reap(self) -> None:
        for pid in list(self._children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                connection = self._children.pop(pid)
                try:
                    connection.sendall(str(os.waitstatus_to_exitcode(status)).encode())
                except OSError:
                    pass  # the stand-in was killed (timeout): nobody waits for the status
                connection.close()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        for pid in list(self._children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            self._children.pop(pid).close()
        self._listener.close()
        self._tmp.cleanup()
