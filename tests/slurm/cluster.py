"""A real one-node SLURM for the tests: Debian's slurm-wlm (munged, slurmctld, slurmd) started in a
folder of its own and stopped by pid.

Everything the daemons write (keys, sockets, state, spool, logs, pid files) lies in that folder, on
ports picked free, so it neither needs nor touches a system-wide SLURM; clients (sbatch, squeue,
scontrol, and so submitit) find it through ``SLURM_CONF``. No accounting: submitit then polls the
job states with squeue. The packages are installed with apt-get when missing, as root (CI runs as
root on Debian); elsewhere the caller is told what is missing.

From a shell, for trying the SLURM launcher by hand::

    python -m tests.slurm.cluster up /tmp/slurm     # prints the SLURM_CONF to export
    python -m tests.slurm.cluster down /tmp/slurm
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainer.infra.processes import free_port

PACKAGES = ("slurm-wlm",)
DAEMONS = ("munged", "slurmctld", "slurmd")
PARTITION = "debug"


class Unavailable(Exception):
    """SLURM cannot be installed or started here (the reason is the message)."""


def ensure_installed() -> None:
    """Install slurm-wlm with apt-get when a daemon or client is missing (root only)."""
    missing = [tool for tool in (*DAEMONS, "sbatch", "squeue", "scontrol", "sinfo") if not _which(tool)]
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise Unavailable(f"{', '.join(missing)} not installed, and apt-get as root is not available to install "
                          f"{' '.join(PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise Unavailable(f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}")


def _which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin")


@dataclass
class Cluster:
    """A started one-node SLURM: its folder, the slurm.conf clients need, and the daemons' pids."""

    folder: Path
    conf: Path
    node: str
    cpus: int
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """The environment for SLURM clients: this cluster's slurm.conf."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def command(self, *args: str, timeout: float = 30) -> str:
        done = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def node_state(self) -> str:
        return self.command("sinfo", "-h", "-N", "-o", "%T").strip()

    def log_tail(self, lines: int = 30) -> str:
        parts = []
        for name in ("slurmctld", "slurmd"):
            path = self.folder / "log" / f"{name}.log"
            if path.exists():
                parts.append(f"--- {path}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(parts)


def write_config(folder: Path, cpus: int | None = None) -> Cluster:
    """slurm.conf (and the munge key) for a one-node cluster on this host, all paths under `folder`."""
    folder = folder.resolve()
    for sub in ("munge", "state", "spool", "log", "run"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(folder / "munge", 0o700)
    key = folder / "munge" / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(128))
        os.chmod(key, 0o600)
    node = socket.gethostname().split(".")[0]
    cpus = cpus or os.cpu_count() or 1
    memory_mib = max(1024, int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.8))
    user = "root" if os.geteuid() == 0 else os.environ.get("USER", "root")
    lines = {
        "ClusterName": "trainertest",
        "SlurmctldHost": f"{node}(127.0.0.1)",
        "SlurmctldPort": free_port(),
        "SlurmdPort": free_port(),
        "SlurmUser": user,
        "SlurmdUser": user,
        "AuthType": "auth/munge",
        "CredType": "cred/munge",
        # cred_expire: a requeued job may start again only after its credentials expire (120 s
        # by default); 10 s keeps the tests' requeues short. Said in docs/scale-out.md.
        "AuthInfo": f"socket={folder / 'munge' / 'munge.socket'},cred_expire=10",
        "StateSaveLocation": folder / "state",
        "SlurmdSpoolDir": folder / "spool",
        "SlurmctldPidFile": folder / "run" / "slurmctld.pid",
        "SlurmdPidFile": folder / "run" / "slurmd.pid",
        "SlurmctldLogFile": folder / "log" / "slurmctld.log",
        "SlurmdLogFile": folder / "log" / "slurmd.log",
        "ProctrackType": "proctrack/linuxproc",
        "TaskPlugin": "task/none",
        "MpiDefault": "none",
        "SwitchType": "switch/none",
        "JobAcctGatherType": "jobacct_gather/none",
        "AccountingStorageType": "accounting_storage/none",
        "JobCompType": "jobcomp/none",
        "SchedulerType": "sched/backfill",
        # The scheduler looks at pending jobs (a requeued one whose begin time has come) every few
        # seconds instead of every minute.
        "SchedulerParameters": "sched_interval=2,bf_interval=2",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_CPU",
        "ReturnToService": 2,
        "JobRequeue": 1,
        # Seconds between a job's time-limit SIGTERM and its SIGKILL.
        "KillWait": 30,
        "InactiveLimit": 0,
        "MinJobAge": 300,
        "SlurmctldTimeout": 30,
        "SlurmdTimeout": 30,
        "SlurmctldDebug": "info",
        "SlurmdDebug": "info",
    }
    text = "\n".join(f"{key}={value}" for key, value in lines.items())
    text += (f"\nNodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mib} State=UNKNOWN"
             f"\nPartitionName={PARTITION} Nodes={node} Default=YES MaxTime=INFINITE State=UP"
             # Two jobs may share a CPU: a test module's jobs run side by side (test_requeue's paced
             # job, which mostly sleeps, while the module's other jobs run) instead of queueing.
             " OverSubscribe=FORCE:2\n")
    conf = folder / "slurm.conf"
    conf.write_text(text)
    return Cluster(folder, conf, node, cpus)


def start(folder: Path, cpus: int | None = None, timeout: float = 60) -> Cluster:
    """Write the config, start the three daemons (in the foreground of their own processes, so the
    pid is theirs) and wait until the node is idle."""
    ensure_installed()
    cluster = write_config(folder, cpus)
    munge = cluster.folder / "munge"
    log = cluster.folder / "log"
    commands = {
        "munged": [_which("munged"), "--foreground", "--force", f"--key-file={munge / 'munge.key'}",
                   f"--socket={munge / 'munge.socket'}", f"--pid-file={munge / 'munged.pid'}",
                   f"--log-file={log / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"],
        "slurmctld": [_which("slurmctld"), "-D", "-i", "-f", str(cluster.conf)],
        "slurmd": [_which("slurmd"), "-D", "-f", str(cluster.conf), "-N", cluster.node],
    }
    try:
        for name, command in commands.items():
            out = open(log / f"{name}.out", "ab")  # noqa: SIM115 - the daemon keeps it
            process = subprocess.Popen([str(c) for c in command], env=cluster.env, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
            cluster.pids[name] = process.pid
            if name == "munged":
                _wait_for(lambda: (munge / "munge.socket").exists(), 10, "munged's socket", cluster)
        _wait_for(lambda: _idle(cluster), timeout, "the node to be idle in sinfo", cluster)
    except BaseException:
        stop(cluster)
        raise
    (cluster.folder / "pids.json").write_text(json.dumps(cluster.pids))
    return cluster


def _idle(cluster: Cluster) -> bool:
    try:
        return cluster.node_state() == "idle"
    except (RuntimeError, subprocess.TimeoutExpired):
        return False


def _wait_for(ready, timeout: float, what: str, cluster: Cluster) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        for name, pid in cluster.pids.items():
            if not _alive(pid):
                raise Unavailable(f"{name} exited while waiting for {what}\n{cluster.log_tail()}")
        time.sleep(0.5)
    raise Unavailable(f"timed out after {timeout:.0f} s waiting for {what}\n{cluster.log_tail()}")


def _alive(pid: int) -> bool:
    try:
        finished, _ = os.waitpid(pid, os.WNOHANG)
        return finished == 0
    except ChildProcessError:  # not our child (stopped from another process): ask the kernel
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def stop(cluster: Cluster, timeout: float = 20) -> None:
    """Cancel what is still queued, then stop the daemons by pid (slurmd first, munged last); the
    job steps slurmd started go with their process groups."""
    if cluster.pids.get("slurmctld") and _alive(cluster.pids["slurmctld"]):
        try:
            cluster.command("scancel", "--full", "--user", os.environ.get("USER", "root"), timeout=10)
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
    steps = _job_steps_of(cluster)
    for name in ("slurmd", "slurmctld", "munged"):
        pid = cluster.pids.get(name)
        if pid is None or not _alive(pid):
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            _alive(pid)
    for pid in steps:  # a job step still winding down (slurmstepd outlives slurmd)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _job_steps_of(cluster: Cluster) -> list[int]:
    """The slurmstepd processes of this cluster: started by its slurmd, they carry its SLURM_CONF."""
    mine = f"SLURM_CONF={cluster.conf}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"slurmstepd" in (entry / "cmdline").read_bytes() and mine in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print("usage: python -m tests.slurm.cluster up|down FOLDER", file=sys.stderr)
        return 2
    folder = Path(argv[1])
    if argv[0] == "up":
        cluster = start(folder)
        print(f"export SLURM_CONF={cluster.conf}   # node {cluster.node}, {cluster.cpus} CPUs, pids {cluster.pids}")
        return 0
    pids = json.loads((folder / "pids.json").read_text())
    conf = folder.resolve() / "slurm.conf"
    stop(Cluster(folder.resolve(), conf, "", 0, pids))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
