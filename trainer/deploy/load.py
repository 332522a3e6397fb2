"""``python -m trainer.deploy load RUN_DIR|CKPT``: the batching server under load, batching on and off.

Two servers of the same export (``serve`` on free loopback ports), one batching and one serving each
request alone, measured by a real HTTP client sending the run's own test images; docs/deploy.md
("load") gives what is reported. The two servers take turns per concurrency and round, so a busy
machine slows both alike. QPS is completed requests over the measurement's wall time; latency is
from request sent to answer read."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from trainer.infra.atomic import write_json_atomic, write_text_atomic
from trainer.deploy import DEFAULT_BATCH_TIMEOUT_MS, DEFAULT_MAX_BATCH_SIZE
from trainer.deploy.bench import percentile
from trainer.infra.errors import UserError
from trainer.infra.processes import cpu_seconds, descendants, free_port

DEFAULT_CONCURRENCIES = (1, 8, 32)


@dataclass(frozen=True)
class Sample:
    body: bytes
    content_type: str
    label: int


@dataclass(frozen=True)
class LoadResult:
    server: str
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    p50_ms: float
    p99_ms: float
    mean_batch: float
    correct: float
    #: CPU milliseconds per answered request: the inference worker, the server's other processes (HTTP,
    #: queue manager), and this client; from /proc, so what the VM steals is not counted
    cpu_ms: dict[str, float] = field(default_factory=dict)

    @property
    def qps(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0


# -- what the client sends -------------------------------------------------------------------------------
def client_samples(run_dir: Path, count: int = 256) -> list[Sample]:
    """Up to `count` of the run's test images as a client would send them: an image folder's own files;
    for data held as tensors (digits, CIFAR-10), the images as PNGs at their size, recovered from the
    normalized tensors with the model card's mean, std and scale."""
    from trainer.deploy.export import load_network, locate

    run_dir, checkpoint = locate(run_dir)
    with tempfile.TemporaryDirectory(prefix="load-data-") as scratch:
        _, _, datamodule, _ = load_network(run_dir, checkpoint, Path(scratch))
        datamodule.setup("test")
        preprocessing = datamodule.inference_preprocessing()
        if not preprocessing:
            raise UserError(str(run_dir), "has data that are not images a client could send",
                            "a run trained on digits, CIFAR-10 or an image folder")
        files = getattr(datamodule.test_set, "samples", None)
        if files is not None:
            return [_file_sample(path, label) for path, label in files[:count]]
        return [_png_sample(image, int(label), preprocessing)
                for image, label in (datamodule.test_set[i] for i in range(min(count, len(datamodule.test_set))))]


def _file_sample(path: str, label: int) -> Sample:
    kind = "image/png" if path.lower().endswith(".png") else "image/jpeg"
    return Sample(Path(path).read_bytes(), kind, int(label))


def _png_sample(image: Any, label: int, preprocessing: dict[str, Any]) -> Sample:
    from PIL import Image

    mean = np.asarray(preprocessing["mean"], np.float32).reshape(-1, 1, 1)
    std = np.asarray(preprocessing["std"], np.float32).reshape(-1, 1, 1)
    pixels = (np.asarray(image, np.float32) * std + mean) / preprocessing["scale"]
    pixels = pixels.round().clip(0, 255).astype(np.uint8)
    picture = Image.fromarray(pixels[0], "L") if pixels.shape[0] == 1 else Image.fromarray(pixels.transpose(1, 2, 0))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return Sample(buffer.getvalue(), "image/png", label)


# -- the client --------------------------------------------------------------------------------------------
async def _measure(url: str, samples: Sequence[Sample], concurrency: int, requests: int, budget_s: float,
                   server: str) -> LoadResult:
    """QPS and latency of `url` at `concurrency` callers, bounded by `requests` and `budget_s`."""
    import aiohttp

    latencies: list[float] = []
    batches: list[int] = []
    hits, errors = 0, 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency, force_close=False),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        # one untimed request per connection first: connections open, the server's first calls done
        await asyncio.gather(*(_post(session, url, samples[i % len(samples)]) for i in range(concurrency)))

        async def call(i: int) -> None:
            nonlocal hits, errors
            sample = samples[i % len(samples)]
            sent = time.perf_counter()
            status, answer = await _post(session, url, sample)
            if status != 200:
                errors += 1
                return
            latencies.append((time.perf_counter() - sent) * 1000)
            batches.append(int(answer.get("batch", 1)))
            hits += answer["top_k"][0]["index"] == sample.label

        wall = await run_callers(concurrency, requests, budget_s, call)
    if not latencies:
        raise nothing_answered(url, errors)
    return LoadResult(server, concurrency, len(latencies), errors, wall, percentile(latencies, 50),
                      percentile(latencies, 99), float(np.mean(batches)), hits / len(latencies))


def nothing_answered(url: str, errors: int) -> UserError:
    """The one line for a server that answered none of the `errors` requests a load test sent it."""
    return UserError(url, f"answered none of {errors} requests", "a server that is up")


async def run_callers(concurrency: int, requests: int, budget_s: float, call: Any) -> float:
    """`call(i)` from `concurrency` callers until `requests` are issued or `budget_s` is spent; the wall time."""
    issued = 0
    start = time.perf_counter()
    deadline = start + budget_s

    async def caller() -> None:
        nonlocal issued
        while issued < requests and time.perf_counter() < deadline:
            issued += 1
            await call(issued - 1)

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return time.perf_counter() - start


async def _post(session: Any, url: str, sample: Sample) -> tuple[int, dict[str, Any]]:
    async with session.post(url, data=sample.body, headers={"Content-Type": sample.content_type}) as response:
        return response.status, await response.json(content_type=None)


# -- the servers ------------------------------------------------------------------------------------------
class ServerProcess:
    """``python -m trainer.deploy serve`` in a child process on a free loopback port, stopped by
    SIGTERM (its graceful stop) and waited for."""

    def __init__(self, source: Path, max_batch_size: int, batch_timeout_ms: float, log: Path,
                 extra: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "trainer.deploy", "serve", str(source), "--port", str(self.port),
                   "--max-batch-size", str(max_batch_size), "--batch-timeout-ms", str(batch_timeout_ms), *extra]
        self._log = open(log, "wb")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        cwd=Path(__file__).resolve().parents[2])
        self.log = log

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise UserError("serve", f"stopped with exit code {self.process.returncode} before it was ready: "
                                f"{_last_line(self.log)}", f"see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise UserError("serve", f"not ready after {timeout_s:.0f} s", f"see {self.log}")

    def cpu_by_part(self) -> dict[str, float]:
        """utime + stime so far of the inference worker and of the server's other processes."""
        seconds = {"worker": 0.0, "server": 0.0}
        for pid in [self.process.pid, *descendants(self.process.pid)]:
            try:
                used = cpu_seconds(pid)
                inference = "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
            except OSError:  # gone meanwhile
                continue
            seconds["worker" if inference else "server"] += used
        return seconds

    def cpu_at_rest(self, seconds: float = 2.0) -> float:
        """% of a core the server's processes use while no request comes."""
        before = sum(self.cpu_by_part().values())
        time.sleep(seconds)
        return (sum(self.cpu_by_part().values()) - before) / seconds * 100

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def measure_server(server: ServerProcess, samples: Sequence[Sample], concurrency: int, requests: int,
                   budget_s: float, name: str) -> LoadResult:
    """`_measure` on a server this process started, with the CPU each side spent per request."""
    before, client = server.cpu_by_part(), time.process_time()
    result = asyncio.run(_measure(server.url + "/predict", samples, concurrency, requests, budget_s, name))
    after, client = server.cpu_by_part(), time.process_time() - client
    # the untimed first requests (one per connection) are in the CPU figures too
    answered = result.requests + concurrency
    cpu = {part: (after[part] - before[part]) * 1000 / answered for part in after}
    return replace(result, cpu_ms=cpu | {"client": client * 1000 / answered})


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


# -- the command -------------------------------------------------------------------------------------------
def load_run(source: Path, concurrencies: Sequence[int] = DEFAULT_CONCURRENCIES, requests: int = 2000,
             budget_s: float = 10.0, rounds: int = 2, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
             batch_timeout_ms: float = DEFAULT_BATCH_TIMEOUT_MS,
             device: Optional[str] = None) -> "LoadReport":
    """Both servers under the same load, taking turns (see the module's docstring). A text model's
    server is load_text.py's (the command picks it by the card's task)."""
    from trainer.deploy.export import export_folder, locate

    run_dir, _ = locate(Path(source))
    folder = export_folder(source)  # once, here, so that the two servers do not both export
    extra = ["--device", device] if device else []
    samples = client_samples(run_dir)
    logs = run_dir / "deploy_load_logs"
    logs.mkdir(exist_ok=True)
    results: list[LoadResult] = []
    with ServerProcess(folder, max_batch_size, batch_timeout_ms, logs / "batched.log", extra) as batched, \
            ServerProcess(folder, 1, 0.0, logs / "unbatched.log", extra) as alone:
        batched.wait_ready()
        alone.wait_ready()
        servers = {f"batched (max {max_batch_size}, {batch_timeout_ms:g} ms)": batched, "unbatched": alone}
        at_rest = {name: server.cpu_at_rest() for name, server in servers.items()}
        for _ in range(rounds):
            for concurrency in concurrencies:
                for name, server in servers.items():
                    results.append(measure_server(server, samples, concurrency, requests, budget_s, name))
    report = LoadReport(merge_rounds(results), results, at_rest, run_dir / "deploy_load.md")
    write_report(report, folder, len(samples))
    return report


@dataclass
class LoadReport:
    rows: list[LoadResult]  # per server and concurrency, the round with the median QPS
    rounds: list[LoadResult]
    at_rest: dict[str, float]  # per server, its processes' CPU with no request, in % of a core
    markdown: Path

    def lines(self) -> list[str]:
        return [*table(self.rows, self.rounds), *self.notes()]

    def notes(self) -> list[str]:
        rest = ", ".join(f"{name} {share:.0f}%" for name, share in self.at_rest.items())
        return [*ratios(self.rows), f"CPU at rest, % of a core: {rest}"]


def merge_rounds(results: Sequence[LoadResult]) -> list[LoadResult]:
    """One row per server and concurrency: the round with the median QPS (rounds are reported in the
    json, and their spread in the markdown)."""
    merged = []
    for key in dict.fromkeys((r.server, r.concurrency) for r in results):
        rows = sorted((r for r in results if (r.server, r.concurrency) == key), key=lambda r: r.qps)
        merged.append(rows[(len(rows) - 1) // 2])
    return merged


def table(rows: Sequence[LoadResult], all_rounds: Sequence[LoadResult] = ()) -> list[str]:
    lines = ["| concurrency | server | QPS | P50 ms | P99 ms | mean batch | CPU ms per request: worker / HTTP+queue "
             "/ client | top-1 = label | errors | QPS of rounds |", "|---:|---|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        spread = ", ".join(f"{x.qps:.0f}" for x in all_rounds if (x.server, x.concurrency) == (r.server, r.concurrency))
        cpu = " / ".join(f"{r.cpu_ms[part]:.2f}" for part in ("worker", "server", "client")) if r.cpu_ms else "-"
        lines.append(f"| {r.concurrency} | {r.server} | {r.qps:,.0f} | {r.p50_ms:.2f} | {r.p99_ms:.2f} | "
                     f"{r.mean_batch:.1f} | {cpu} | {r.correct:.1%} | {r.errors} | {spread} |")
    return lines


def ratios(rows: Sequence[LoadResult]) -> list[str]:
    lines = []
    for concurrency in dict.fromkeys(r.concurrency for r in rows):
        at = [r for r in rows if r.concurrency == concurrency]
        batched = next((r for r in at if r.server.startswith("batched")), None)
        alone = next((r for r in at if r.server == "unbatched"), None)
        if batched and alone:
            lines.append(f"concurrency {concurrency}: batched {batched.qps / alone.qps:.2f}x the QPS of unbatched, "
                         f"P99 {batched.p99_ms:.1f} ms vs {alone.p99_ms:.1f} ms")
    return lines


def write_report(report: LoadReport, folder: Path, images: int) -> None:
    import torch

    from trainer.infra.fingerprint import cpu_name

    where = f"{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    lines = [f"# Serving under load: {folder}", "",
             f"{images} test images sent by {len(set(r.concurrency for r in report.rows))} concurrencies of callers; "
             f"{where}. Row = the round with the median QPS.", "", *table(report.rows, report.rounds), "",
             *(f"- {line}" for line in report.notes())]
    write_text_atomic(report.markdown, "\n".join(lines) + "\n")
    write_json_atomic(report.markdown.with_suffix(".json"), {
        "export": str(folder), "machine": where, "cpu_at_rest_percent": report.at_rest,
        "rounds": [asdict(r) | {"qps": r.qps} for r in report.rounds]})
