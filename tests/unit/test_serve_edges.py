"""The pure pieces of the HTTP server (trainer/deploy/serve.py): data URLs decoded strictly, the body
limit for base64, /predict's OpenAPI additions and /metrics' content negotiation and names."""

import base64
import io

import pytest
from fastapi import HTTPException
from PIL import Image
from starlette.requests import Request

from trainer.deploy.serve import (ERROR_RESPONSES, ServerMetrics, _openapi_extra, encoded_limit,
                                  image_from_data_url)


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (5, 3), 7).save(buffer, "PNG")
    return buffer.getvalue()


def test_a_data_url_gives_the_file_bytes():
    png = _png()
    encoded = base64.b64encode(png).decode()
    for url in (f"data:image/png;base64,{encoded}", f" DATA:image/PNG;charset=x;BASE64,{encoded}\n",
                f"data:;base64,{encoded}", f"data:application/octet-stream;base64,{encoded}"):
        assert image_from_data_url(url) == png, url


@pytest.mark.parametrize("url,status,says", [
    ("data:image/png;base64,iVBOR w0K", 400, "not valid base64"),   # whitespace inside
    ("data:image/png;base64,iVBORw0", 400, "not valid base64"),      # unpadded
    ("data:image/png;base64,iVBO-w0K", 400, "not valid base64"),     # URL-safe alphabet
    ("data:image/png,%89PNG", 400, "not base64"),
    ("data:image/png;base64", 400, "not a data URL"),
    ("data:image/webp;base64,AAAA", 415, "'image/webp'"),
])
def test_a_malformed_data_url_is_a_one_line_refusal(url, status, says):
    with pytest.raises(HTTPException) as caught:
        image_from_data_url(url)
    assert caught.value.status_code == status and says in caught.value.detail
    assert "\n" not in caught.value.detail


def test_the_base64_body_limit_fits_an_image_at_the_byte_limit_in_a_data_url_or_json():
    for max_bytes in (1, 2, 3, 1000, 10 * 1024 * 1024):
        encoded = base64.b64encode(bytes(max_bytes)).decode()
        assert len(f'{{"image": "data:image/jpeg;base64,{encoded}", "k": 1000}}') <= encoded_limit(max_bytes)


def test_the_openapi_additions_declare_k_every_refusal_and_the_data_url_body():
    extra = _openapi_extra(1000)
    assert extra["parameters"][0]["name"] == "k" and extra["parameters"][0]["in"] == "query"
    assert set(extra["requestBody"]["content"]) == {"image/jpeg", "image/png", "application/json", "text/plain"}
    assert {400, 413, 415, 422} <= set(ERROR_RESPONSES)


def _request(accept: str | None) -> Request:
    headers = [(b"accept", accept.encode())] if accept else []
    return Request({"type": "http", "method": "GET", "path": "/metrics", "headers": headers})


def test_metrics_negotiate_the_format_and_keep_their_meaning_under_a_namespace():
    metrics = ServerMetrics(max_batch_size=8)
    metrics.observe(200, 0.003, batch=2)
    metrics.observe(400, 0.001)
    plain = metrics.exposition(_request(None))
    text = plain.body.decode()
    assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert 'trainer_serve_predict_requests_total{status="200"} 1.0' in text
    assert 'trainer_serve_predict_requests_total{status="400"} 1.0' in text
    assert "trainer_serve_predict_latency_seconds_count 2.0" in text
    assert 'trainer_serve_predict_batch_size_bucket{le="2.0"} 1.0' in text  # only answered requests
    assert "process_resident_memory_bytes" in text and "python_gc_collections_total" in text
    assert "python_info" in text
    open_metrics = metrics.exposition(_request("application/openmetrics-text; version=1.0.0, text/plain;q=0.5"))
    assert open_metrics.headers["content-type"].startswith("application/openmetrics-text")
    assert open_metrics.body.decode().rstrip().endswith("# EOF")
    assert "trainer_serve_predict_requests_total" in open_metrics.body.decode()


def test_batch_sizes_have_a_bucket_at_every_power_of_two_up_to_the_largest_batch():
    """Each server has its own registry, so two servers in one process never share counts."""
    from prometheus_client.parser import text_string_to_metric_families

    metrics = ServerMetrics(max_batch_size=12)
    metrics.observe(200, 0.004, batch=3)
    metrics.observe(200, 0.02, batch=12)
    text = metrics.exposition(_request(None)).body.decode()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    buckets = [s.labels["le"] for s in samples if s.name == "trainer_serve_predict_batch_size_bucket"]
    assert buckets == ["1.0", "2.0", "4.0", "8.0", "12.0", "+Inf"]
    assert ServerMetrics(max_batch_size=12).registry is not metrics.registry  # each server its own


def test_serving_an_export_does_not_import_lightning_or_the_run():
    """`deploy serve` of an exported folder reads the card and starts a server: the modules on that
    path (the command, the card's reader, the three servers, the checkpoint files) import neither
    Lightning nor the run's config groups, which cost seconds at every start (exporting still does)."""
    import subprocess
    import sys

    from tests.helpers import REPO

    probe = ("import sys, trainer.deploy.__main__, trainer.deploy.export, trainer.deploy.serve, "
             "trainer.deploy.serve_text, trainer.deploy.serve_generate, trainer.infra.checkpoint_files; "
             "print(sorted(n for n in ('lightning', 'trainer.configuration.spec', 'torchvision.models') "
             "if n in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_load_test_of_a_server_that_answers_only_errors_says_how_many_it_sent():
    """The image client against a loopback server answering 503 to every request: one line naming the URL
    and the count of requests that failed (it once said 'none of N requests (errors: N)')."""
    import asyncio

    from aiohttp import web

    from trainer.deploy.load import Sample, _measure
    from trainer.infra.errors import UserError
    from trainer.infra.processes import free_port

    async def busy(request: web.Request) -> web.Response:
        return web.json_response({"detail": "busy"}, status=503)

    async def refuse_all() -> None:
        app = web.Application()
        app.router.add_post("/predict", busy)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            await _measure(f"http://127.0.0.1:{port}/predict", [Sample(_png(), "image/png", 0)], concurrency=2,
                           requests=6, budget_s=30.0, server="refusing")
        finally:
            await runner.cleanup()

    with pytest.raises(UserError) as raised:
        asyncio.run(refuse_all())
    assert raised.value.problem == "answered none of 6 requests", raised.value
