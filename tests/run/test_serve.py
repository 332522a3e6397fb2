"""python -m trainer.deploy serve and load, end to end on loopback: a real server process on a free port
answers /health, classifies the run's own test digits sent as PNG files, refuses bad requests with a
one-line 4xx and keeps serving, forms batches from concurrent requests, and stops on SIGTERM with
nothing left running; a tiny load run measures both servers."""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, python_forked
from trainer.data.digits import DigitsDataModule
from trainer.deploy.export import onnx_logits
from trainer.deploy.load import ServerProcess, client_samples, load_run
from trainer.deploy.export import export_folder
from trainer.infra.processes import descendants, free_port, running

pytestmark = [pytest.mark.run, pytest.mark.slow]

MAX_BYTES = 200_000  # above the 140 KB decompression bomb, so that its pixels are what refuses it


@pytest.fixture(scope="module")
def samples(digits_run):
    run_dir, _ = digits_run
    return client_samples(run_dir, count=64)


@pytest.fixture(scope="module")
def server(digits_run, tmp_path_factory):
    """One batching server for the module (a long batch timeout, so that concurrent requests meet)."""
    run_dir, _ = digits_run
    folder = export_folder(run_dir)
    log = tmp_path_factory.mktemp("serve") / "server.log"
    process = ServerProcess(folder, max_batch_size=16, batch_timeout_ms=100, log=log,
                            extra=["--max-bytes", str(MAX_BYTES)])
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def _post(url: str, body: bytes, content_type: str | None) -> tuple[int, dict]:
    """http.client, which sends no Content-Type of its own when none is given."""
    address = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
    try:
        connection.request("POST", address.path + (f"?{address.query}" if address.query else ""), body=body,
                           headers={"Content-Type": content_type} if content_type else {})
        answer = connection.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        connection.close()


def _get(url: str, accept: str | None = None) -> tuple[str, str]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return answer.headers["Content-Type"], answer.read().decode()


def bomb_png(width: int = 12000, height: int = 12000) -> bytes:
    """A real decompression bomb: a valid greyscale PNG of width x height zeros, 140 KB at 12000 x 12000
    (144 megapixels: 3.4 s and 144 MB to decode here)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    packer, row = zlib.compressobj(9), b"\0" * (width + 1)  # each row: filter byte 0, then its pixels
    data = b"".join(packer.compress(row * min(1000, height - top)) for top in range(0, height, 1000)) + packer.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", data) + chunk(b"IEND", b""))


def test_health_and_real_digits_are_classified(server, samples, digits_run):
    """The test digits, posted one by one as PNG files, get the class the exported model gives the
    run's own test tensors (so the server's preprocessing is training's), and their labels as often as
    the run's test accuracy says; the top-k list is sorted and as long as asked."""
    run_dir, summary = digits_run
    dm = DigitsDataModule()
    dm.setup()
    tensors = torch.stack([dm.test_set[i][0] for i in range(30)])
    expected = onnx_logits(run_dir / "export" / "model.onnx", tensors).argmax(1).tolist()
    with urllib.request.urlopen(server.url + "/health", timeout=10) as answer:
        assert answer.status == 200
    agree = correct = 0
    for sample, reference in zip(samples[:30], expected):
        status, answer = _post(server.url + "/predict", sample.body, sample.content_type)
        assert status == 200, answer
        probabilities = [entry["probability"] for entry in answer["top_k"]]
        assert len(probabilities) == 5 and probabilities == sorted(probabilities, reverse=True)
        assert answer["top_k"][0]["class"] == str(answer["top_k"][0]["index"])
        agree += answer["top_k"][0]["index"] == reference
        correct += answer["top_k"][0]["index"] == sample.label
    assert agree >= 29  # one near-tie may fall the other way: an 8-bit file rounds 0..16 levels
    assert abs(correct / 30 - summary["metrics"]["test"]["acc"]) <= 0.15
    status, answer = _post(server.url + "/predict?k=2", samples[0].body, "image/png")
    assert status == 200 and len(answer["top_k"]) == 2


def test_bad_requests_are_a_one_line_4xx_and_the_server_keeps_serving(server, samples):
    good = samples[0].body
    cases = [
        (b"%PDF-1.4 not an image", "image/png", 400, "not a usable image"),
        (good[: len(good) // 2], "image/png", 400, "truncated or corrupt"),
        (b"", "image/jpeg", 400, "empty body"),
        (good, "text/plain", 415, "'text/plain' is read as a data URL"),
        (good, None, 415, "'none' is not an image"),
        (b"\x89PNG" + bytes(MAX_BYTES), "image/png", 413, "over the limit"),
    ]
    for body, content_type, status, says in cases:
        got, answer = _post(server.url + "/predict", body, content_type)
        assert got == status and says in answer["detail"] and "\n" not in answer["detail"], (says, got, answer)
    got, answer = _post(server.url + "/predict?k=zero", good, "image/png")
    assert got == 422 and "k='zero'" in answer["detail"]
    status, answer = _post(server.url + "/predict", good, "image/png")
    assert status == 200 and answer["top_k"][0]["index"] == samples[0].label


def test_a_json_body_with_a_base64_image_is_classified_like_its_bytes(server, samples):
    """LitServe's own clients send JSON: {"image": base64} (or "input") gets the raw body's answer,
    k from the JSON; a body that is not base64 or has no image is a one-line 4xx."""
    import base64

    sample = samples[1]
    _, raw = _post(server.url + "/predict?k=3", sample.body, sample.content_type)
    encoded = base64.b64encode(sample.body).decode()
    for key in ("image", "input"):
        status, answer = _post(server.url + "/predict", json.dumps({key: encoded, "k": 3}).encode(),
                               "application/json")
        assert status == 200 and [c["index"] for c in answer["top_k"]] == [c["index"] for c in raw["top_k"]]
    for body, status, says in [(b'{"image": "not base64!"}', 400, "not valid base64"),
                               (b'{"picture": "abc"}', 422, 'no "image" string'), (b"{oops", 400, "not JSON")]:
        got, answer = _post(server.url + "/predict", body, "application/json")
        assert got == status and says in answer["detail"], (body, got, answer)


def test_the_api_is_documented_and_counted(server, samples):
    """/openapi.json names the project and its version and documents /predict's bodies (an image, or
    JSON) and its answer; /metrics counts the requests by status, their latency and batch sizes."""
    from importlib.metadata import version

    with urllib.request.urlopen(server.url + "/openapi.json", timeout=10) as answer:
        api = json.loads(answer.read())
    assert api["info"]["title"] == "gpu-practice-trainer image classifier"
    assert api["info"]["version"] == version("gpu-practice-trainer")
    predict = api["paths"]["/predict"]["post"]
    assert set(predict["requestBody"]["content"]) == {"image/jpeg", "image/png", "application/json", "text/plain"}
    answer_schema = predict["responses"]["200"]["content"]["application/json"]["schema"]
    assert answer_schema["$ref"].endswith("/Prediction") and "/metrics" in api["paths"]
    _post(server.url + "/predict", samples[2].body, samples[2].content_type)
    _post(server.url + "/predict", b"", "image/png")
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as answer:
        assert answer.headers["Content-Type"].startswith("text/plain")
        text = answer.read().decode()
    counts = {line.split("{")[1].split("}")[0]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("trainer_serve_predict_requests_total{")}
    assert counts['status="200"'] >= 1 and counts['status="400"'] >= 1
    assert "trainer_serve_predict_latency_seconds_bucket" in text and "trainer_serve_predict_batch_size_count" in text


def test_the_openapi_declares_every_answer_and_k(server):
    """/predict's refusals (400, 413, 415, 422) are declared with their one-line `detail`, `?k=` as an
    integer query parameter, and a data URL as a text/plain body."""
    _, text = _get(server.url + "/openapi.json")
    api = json.loads(text)
    predict = api["paths"]["/predict"]["post"]
    for status in ("400", "413", "415", "422"):
        schema = predict["responses"][status]["content"]["application/json"]["schema"]
        assert schema["$ref"].endswith("/ErrorDetail"), status
    assert api["components"]["schemas"]["ErrorDetail"]["properties"]["detail"]["type"] == "string"
    (k,) = [p for p in predict["parameters"] if p["name"] == "k"]
    assert k["in"] == "query" and k["schema"] == {"type": "integer", "minimum": 1}
    assert "text/plain" in predict["requestBody"]["content"]


def test_info_states_the_limits_the_server_applies(server):
    """/info says --max-bytes (LitServe's own said max_payload_size null) and --max-pixels."""
    _, text = _get(server.url + "/info")
    limits = json.loads(text)["server"]
    assert limits["max_payload_size"] == MAX_BYTES and limits["max_body_bytes"]["image"] == MAX_BYTES
    assert limits["max_pixels"] == 40_000_000 and limits["max_batch_size"] == 16 and limits["top_k"] == 5


def test_a_data_url_is_classified_like_the_file_and_a_malformed_one_is_a_one_line_400(server, samples):
    """What a browser's FileReader.readAsDataURL makes, sent as text/plain, as the JSON body or inside
    it: the raw file's answer; base64 that is not strictly valid, or a data URL of another type, is
    refused in one line."""
    sample = samples[3]
    _, raw = _post(server.url + "/predict?k=3", sample.body, sample.content_type)
    url = f"data:image/png;base64,{base64.b64encode(sample.body).decode()}"
    for body, content_type in [(url, "text/plain;charset=UTF-8"), (url + "\n", "text/plain"),
                               (url, "application/json"), (json.dumps(url), "application/json"),
                               (json.dumps({"image": url}), "application/json")]:
        status, answer = _post(server.url + "/predict?k=3", body.encode(), content_type)
        assert status == 200 and answer["top_k"] == raw["top_k"], (body[:40], content_type, answer)
    for body, status, says in [(url[:-3] + "!==", 400, "not valid base64"),
                               (url.replace(";base64", ""), 400, "not base64"),
                               (url.replace("image/png", "image/gif"), 415, "'image/gif'")]:
        got, answer = _post(server.url + "/predict", body.encode(), "text/plain")
        assert got == status and says in answer["detail"] and "\n" not in answer["detail"], (got, answer)


def test_a_decompression_bomb_is_refused_from_its_header_without_decoding(server, samples):
    """A 140 KB PNG of 144 megapixels (3.4 s to decode here): 413 naming its size and the limit,
    answered well before a decode could have finished; the server then serves on."""
    bomb = bomb_png()
    assert len(bomb) < MAX_BYTES
    started = time.perf_counter()
    status, answer = _post(server.url + "/predict", bomb, "image/png")
    elapsed = time.perf_counter() - started
    assert status == 413 and "12,000 x 12,000 = 144,000,000 pixels" in answer["detail"], answer
    assert "limit of 40,000,000 pixels (--max-pixels)" in answer["detail"] and "\n" not in answer["detail"]
    assert elapsed < 1.5, elapsed
    status, answer = _post(server.url + "/predict", samples[0].body, "image/png")
    assert status == 200


def test_metrics_negotiate_openmetrics_and_include_the_processes(server):
    """/metrics answers OpenMetrics when the Accept header asks for it, Prometheus' text otherwise; it
    has the HTTP process's own process_* and the memory of each of the server's processes."""
    content_type, text = _get(server.url + "/metrics", "application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text") and text.rstrip().endswith("# EOF")
    assert "trainer_serve_predict_requests_total" in text
    content_type, text = _get(server.url + "/metrics")
    assert content_type.startswith("text/plain") and "# EOF" not in text
    assert float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("process_resident_memory_bytes"))) > 10e6
    roles = {line.split('role="')[1].split('"')[0]: float(line.split()[-1]) for line in text.splitlines()
             if line.startswith("trainer_serve_process_proportional_memory_bytes{")}
    assert {"main", "queue_manager", "inference_worker", "http"} <= set(roles) and min(roles.values()) > 1e6


def test_concurrent_requests_are_served_in_batches(server, samples):
    """48 requests at once: the server answers each with its own label, in batches larger than one."""
    import aiohttp

    async def all_at_once() -> list[dict]:
        async with aiohttp.ClientSession() as session:
            async def one(sample):
                async with session.post(server.url + "/predict", data=sample.body,
                                        headers={"Content-Type": sample.content_type}) as answer:
                    assert answer.status == 200
                    return await answer.json()
            return await asyncio.gather(*(one(s) for s in samples[:48]))

    answers = asyncio.run(all_at_once())
    assert max(a["batch"] for a in answers) > 1
    assert sum(a["top_k"][0]["index"] == s.label for a, s in zip(answers, samples)) >= 48 * 0.7


def test_sigterm_stops_the_server_and_everything_it_started(server):
    """Last in this module: SIGTERM ends the server with exit code 0, its inference worker, queue
    manager and HTTP process gone with it."""
    children = descendants(server.process.pid)
    assert len(children) >= 2  # at least the inference worker and the HTTP server
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=90) == 0
    assert "stopped after" in server.log.read_text()
    # The children end on their own once the main process is gone (the resource tracker when its pipe
    # closes): given up to 30 s on a busy machine, none may still be running.
    deadline = time.monotonic() + 30
    while running(children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(children), [(pid, Path(f"/proc/{pid}/cmdline").read_text()[:80]) for pid in running(children)]



def test_a_tiny_load_run_measures_both_servers(digits_run):
    run_dir, _ = digits_run
    report = load_run(run_dir, concurrencies=(1, 4), requests=24, budget_s=5, rounds=1)
    rows, markdown = report.rows, report.markdown
    assert {(r.server.split(" ")[0], r.concurrency) for r in rows} == {
        (name, c) for name in ("batched", "unbatched") for c in (1, 4)}
    assert all(r.requests > 0 and r.errors == 0 and r.correct >= 0.7 and r.p50_ms <= r.p99_ms for r in rows)
    assert all(r.mean_batch == 1.0 for r in rows if r.server == "unbatched")
    assert all(r.cpu_ms["worker"] > 0 and r.cpu_ms["server"] > 0 and r.cpu_ms["client"] > 0 for r in rows)
    assert all(0 <= share < 10 for share in report.at_rest.values())  # no polling at rest (LitServe's: 18%)
    text = markdown.read_text()
    assert "| 4 | unbatched |" in text and "the QPS of unbatched" in text and "CPU at rest" in text
    assert len(json.loads(markdown.with_suffix(".json").read_text())["rounds"]) == 4


@pytest.mark.parametrize("args,says", [
    (["serve", "{tmp}"], "is not a run folder"),
    (["serve", "{run}", "--port", "80"], "--port: 80 is out of range"),
    (["load", "{run}", "--concurrency", "0"], "--concurrency: '0' is not a list of positive integers"),
])
def test_serve_and_load_mistakes_are_one_line(digits_run, tmp_path, args, says):
    run_dir, _ = digits_run
    argv = [a.format(tmp=tmp_path, run=run_dir) for a in args]
    result = python_forked(["-m", "trainer.deploy", *argv])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and says in lines[0], result.stderr


def test_a_port_in_use_and_a_model_that_does_not_load_end_in_one_line(digits_run, tmp_path):
    """Exit 2 and, last on stderr, one line naming the port or the export folder (the inference worker's
    own error about the model is printed above it)."""
    run_dir, _ = digits_run
    broken = tmp_path / "export"
    shutil.copytree(export_folder(run_dir), broken)
    (broken / "model.onnx").write_bytes(b"not a protobuf")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for argv, says in (([str(run_dir), "--port", port], f"127.0.0.1:{port} cannot be listened on"),
                           ([str(broken), "--port", str(free_port())], "could not load and warm up the model")):
            # A new interpreter, not python_forked: the server starts LitServe's processes, and a fork of
            # a fork of this multi-threaded pytest can hang in a lock it inherited (seen: a process left over).
            result = subprocess.run([sys.executable, "-m", "trainer.deploy", "serve", *argv], cwd=REPO,
                                    capture_output=True, text=True, timeout=300)
            last = result.stderr.strip().splitlines()[-1]
            assert result.returncode == 2 and last.startswith("error: ") and says in last, result.stderr
