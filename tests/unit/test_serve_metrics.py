"""What `GET /metrics` reports (trainer/deploy/serve.py's ServerMetrics, in Prometheus' text format):
requests by status, latency, and batch sizes with a bucket at every power of two up to the largest
batch; and the request body /openapi.json declares for /predict."""

from prometheus_client.parser import text_string_to_metric_families

from trainer.deploy.serve import ServerMetrics, _request_body_schema


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.exposition().body.decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_requests_latency_and_batch_sizes_are_counted():
    metrics = ServerMetrics(max_batch_size=12)
    metrics.observe(200, 0.004, batch=3)
    metrics.observe(200, 0.02, batch=12)
    metrics.observe(415, 0.0005)
    samples = _samples(metrics)
    assert samples[("predict_requests_total", (("status", "200"),))] == 2
    assert samples[("predict_requests_total", (("status", "415"),))] == 1
    assert samples[("predict_latency_seconds_count", ())] == 3
    assert samples[("predict_batch_size_count", ())] == 2 and samples[("predict_batch_size_sum", ())] == 15
    buckets = [dict(labels)["le"] for name, labels in samples if name == "predict_batch_size_bucket"]
    assert buckets == ["1.0", "2.0", "4.0", "8.0", "12.0", "+Inf"]
    assert ServerMetrics(max_batch_size=12).registry is not metrics.registry  # each server its own


def test_the_request_body_is_an_image_or_json():
    content = _request_body_schema(1000)["requestBody"]["content"]
    assert content["image/png"]["schema"] == {"type": "string", "format": "binary", "maxLength": 1000}
    assert content["application/json"]["schema"]["required"] == ["image"]
