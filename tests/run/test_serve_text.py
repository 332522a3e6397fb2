"""Text models exported, served and loaded, end to end on loopback: a tiny encoder and a tiny GPT
(copies of the session's runs of their recipes, tests/shared_runs.py: what is tested here is the
serving, not the training), each exported, served by a real ``deploy serve`` process
once for the module and asked many things: the encoder's answers are its network's own
probabilities for the same text, concurrent requests are batched by length, refusals are one line
and the server goes on; the GPT's greedy text is the uncached `generate`'s, streamed and whole; the
load reports have their fields."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import python_forked
from tests.shared_runs import copy_run, encoder_recipe_run, gpt_recipe_run
from trainer.deploy.export import export_run, load_card, load_network
from trainer.deploy.load import ServerProcess
from trainer.deploy.load_text import load_text_run

pytestmark = [pytest.mark.run, pytest.mark.slow]

MAX_BYTES, MAX_CHARS, MAX_NEW_TOKENS = 20_000, 3_000, 40
LONG_TEXT = " ".join(f"asyncio.sleep({i}) await" for i in range(100))  # far over 128 tokens, under MAX_CHARS


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    """(run folder, export, server) of a copy of the session's tiny encoder recipe run (the one
    test_sequence_classification_run.py checks; here any trained encoder of the recipe would do)."""
    root = tmp_path_factory.mktemp("encoder")
    copy_run(encoder_recipe_run(tmp_path_factory).run_dir, root / "run")
    exported = export_run(root / "run")
    server = ServerProcess(exported.folder, max_batch_size=16, batch_timeout_ms=150, log=root / "serve.log",
                           extra=["--max-bytes", str(MAX_BYTES), "--max-chars", str(MAX_CHARS), "--top-k", "3"])
    try:
        server.wait_ready()
        yield root / "run", exported, server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    """(run folder, export, server) of a copy of the session's shortened tiny GPT recipe run (the one
    test_language_model.py checks; here any trained GPT would do)."""
    root = tmp_path_factory.mktemp("gpt")
    copy_run(gpt_recipe_run(tmp_path_factory), root / "run")
    exported = export_run(root / "run")
    server = ServerProcess(exported.folder, max_batch_size=1, batch_timeout_ms=0, log=root / "serve.log",
                           extra=["--max-bytes", str(MAX_BYTES), "--max-new-tokens", str(MAX_NEW_TOKENS)])
    try:
        server.wait_ready()
        yield root / "run", exported, server
    finally:
        server.stop()


def _post(url: str, body: bytes | dict, content_type: str = "application/json") -> tuple[int, dict]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, headers={"Content-Type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as ex:
        return ex.code, json.loads(ex.read())


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read().decode()


# The GPT's tests first: its shared run is made early in a session (by test_language_model.py), the
# encoder's later (test_sequence_classification_run.py, which may still be training it on another worker).
def test_the_gpt_generates_greedy_text_equal_to_uncached_generation_whole_and_streamed(gpt):
    from trainer.generate import load_language_model, load_tokenizer
    from trainer.models.gpt import generate

    run_dir, exported, server = gpt
    card = json.loads((exported.folder / "model.json").read_text())
    assert card["tokenizer"] == "tokenizer.json" and (exported.folder / "tokenizer.json").is_file()
    tokenizer = load_tokenizer(run_dir)
    net = load_language_model(run_dir, exported.checkpoint)
    prompt = "def main(self):\n    return"
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    out = generate(net, ids, 30, greedy=True, cache=False, stop_token=card["text"]["end_of_text_id"])[0, ids.shape[1]:]
    tokens = [t for t in out.tolist() if t != card["text"]["end_of_text_id"]]
    status, whole = _post(server.url + "/generate", {"prompt": prompt, "max_tokens": 30, "temperature": 0})
    assert status == 200 and whole["text"] == tokenizer.decode(tokens) and whole["tokens"] == len(tokens)
    assert whole["finish_reason"] == ("stop" if len(tokens) < 30 else "length") and whole["prompt_tokens"] == ids.shape[1]
    assert whole["ttft_ms"] > 0 and (whole["tpot_ms"] is None or whole["tpot_ms"] > 0)
    request = urllib.request.Request(server.url + "/generate/stream", method="POST", headers={
        "Content-Type": "application/json"}, data=json.dumps({"prompt": prompt, "max_tokens": 30, "temperature": 0}).encode())
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert answer.headers["Content-Type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in answer.read().decode().splitlines()]
    assert "".join(line["token"] for line in lines[:-1]) == whole["text"] and lines[-1]["text"] == whole["text"]
    sampled = [_post(server.url + "/generate", {"prompt": prompt, "max_tokens": 12, "seed": seed})[1]["text"]
               for seed in (3, 3)]
    assert sampled[0] == sampled[1]


def test_the_gpt_server_refuses_over_its_limits_in_one_line(gpt):
    _, _, server = gpt
    url = server.url + "/generate"
    cases = [({"prompt": "x", "max_tokens": MAX_NEW_TOKENS + 1}, 413, "--max-new-tokens"),
             ({"prompt": "def f(): pass " * 100}, 413, "context of 128 tokens"), ({"prompt": ""}, 422, "empty"),
             ({"prompt": "x", "max_tokens": 0}, 422, "max_tokens=0"), ({"prompt": "x", "temperature": -1}, 422,
                                                                          "temperature=-1"),
             ({"prompt": "x", "top_k": 0}, 422, "top_k=0"), ({"prompt": "x", "seed": "a"}, 422, "seed=\"a\"")]
    for body, status, words in cases:
        got, answer = _post(url, body)
        assert got == status and words in answer["detail"], (body, answer)
    assert _post(url, b"{oops", "application/json")[0] == 400 and _post(url, b"x", "text/plain")[0] == 415
    info = json.loads(_get(server.url + "/info"))["server"]
    assert info["max_new_tokens"] == MAX_NEW_TOKENS and info["context"] == 128 and info["kv_cache"] is True
    assert "one generation at a time" in info["concurrency"]
    assert "/generate/stream" in json.loads(_get(server.url + "/openapi.json"))["paths"]
    assert 'trainer_serve_predict_requests_total{status="413"} 2.0' in _get(server.url + "/metrics")


def test_the_encoders_export_serves_alone_and_checks_every_length(encoder):
    run_dir, exported, _ = encoder
    card = json.loads((exported.folder / "model.json").read_text())
    assert card["task"] == "sequence_classification" and len(card["classes"]) == 8 and card["multi_label"] is False
    assert card["text"] == {**card["text"], "max_length": 128, "pad_id": 0, "framing": "[CLS] tokens [SEP]",
                            "tokenizer": "tokenizer.json"}
    assert card["inputs"][0]["shape"] == ["batch", "sequence"] and card["outputs"][0]["shape"] == ["batch", 8]
    lengths = card["checked"]["sequences"]["lengths"]
    assert len(set(lengths)) >= 3 and min(lengths) < 40 and max(lengths) == 128, lengths
    assert max(card["checked"]["max_abs_diff"].values()) <= card["checked"]["bound"]
    assert (exported.folder / "tokenizer.json").read_bytes() == (run_dir / "tokenizer.json").read_bytes()
    hf = json.loads((exported.folder / "huggingface" / "config.json").read_text())
    assert hf["id2label"] == {str(i): name for i, name in enumerate(card["classes"])}
    assert hf["label2id"] == {name: i for i, name in enumerate(card["classes"])}
    # ONNX Runtime at lengths the export's example never had: 3 tokens and 128, batch 1 and 5
    from trainer.deploy.export import onnx_logits

    net, *_ = load_network(run_dir, exported.checkpoint, run_dir.parent / "scratch")
    for ids in (torch.tensor([[2, 40, 3]]), torch.randint(4, 200, (5, 128))):
        with torch.inference_mode():
            assert torch.allclose(onnx_logits(exported.folder / "model.onnx", ids), net.eval()(ids), atol=1e-4)


def test_the_encoder_answers_its_own_networks_probabilities(encoder):
    from trainer.data.labelled_corpus import builtin_samples, encode_texts, load_tokenizer, special_ids

    run_dir, exported, server = encoder
    texts = [s.text for s in builtin_samples(3)[:6]] + [LONG_TEXT]
    tokenizer = load_tokenizer(str(run_dir / "tokenizer.json"))
    ids = special_ids(tokenizer, "run")
    rows, lengths, truncated = encode_texts(tokenizer, texts, ids, 128, np.dtype(np.int64))
    net, *_ = load_network(run_dir, exported.checkpoint, run_dir.parent / "scratch2")
    with torch.inference_mode():
        expected = [torch.softmax(net.eval()(torch.from_numpy(row[None, :n])), dim=1)[0] for row, n in zip(rows, lengths)]
    classes = json.loads((exported.folder / "model.json").read_text())["classes"]
    for text, want, n in zip(texts, expected, lengths):
        status, answer = _post(server.url + "/predict", {"text": text, "k": 8})
        assert status == 200 and answer["tokens"] == n and answer["truncated"] == (answer["text_tokens"] > 128)
        got = {entry["index"]: entry["probability"] for entry in answer["top_k"]}
        assert len(got) == 8 and max(abs(got[i] - float(want[i])) for i in range(8)) < 1e-4
        assert answer["top_k"][0]["class"] == classes[int(want.argmax())]
    status, answer = _post(server.url + "/predict", {"text": LONG_TEXT})
    assert truncated >= 1 and answer["truncated"] is True and answer["tokens"] == 128 and answer["text_tokens"] > 400
    assert len(answer["top_k"]) == 3  # the server's --top-k
    status, short = _post(server.url + "/predict", {"text": "import email", "k": 2})
    assert short["truncated"] is False and short["tokens"] == short["text_tokens"] < 8 and len(short["top_k"]) == 2


def test_concurrent_requests_are_batched_by_length(encoder):
    import aiohttp

    _, _, server = encoder
    texts = ["import email"] * 8 + [LONG_TEXT] * 8

    async def send() -> list[dict]:
        async with aiohttp.ClientSession() as session:
            async def one(text: str) -> dict:
                async with session.post(server.url + "/predict", json={"text": text}) as response:
                    return await response.json()
            return list(await asyncio.gather(*(one(text) for text in texts)))

    answers = asyncio.run(send())
    assert max(a["batch"] for a in answers) > 1  # batched (150 ms batch timeout)
    for answer in answers:  # and never padded beyond the bound
        assert answer["length"] <= max(8, 2 * answer["tokens"]), answer
    assert {a["length"] for a in answers[:8]} == {8} and {a["length"] for a in answers[8:]} == {128}


def test_bad_requests_are_refused_in_one_line_and_the_server_goes_on(encoder):
    _, _, server = encoder
    url = server.url + "/predict"
    cases = [(b"{not json", "application/json", 400, "not JSON"), (b"[1, 2]", "application/json", 400, "not an object"),
             (b'{"text": "x"}', "text/plain", 415, "not application/json"),
             (json.dumps({"text": "a" * (MAX_BYTES + 10)}).encode(), "application/json", 413, "over the limit"),
             (json.dumps({"text": "a " * (MAX_CHARS // 2 + 5)}).encode(), "application/json", 413, "--max-chars"),
             (b'{"text": "   "}', "application/json", 422, "empty"), (b'{"words": "x"}', "application/json", 422, "no \"text\""),
             (b'{"text": "x", "k": 0}', "application/json", 422, "k=0"), (b'{"text": "x", "k": "3"}', "application/json",
                                                                          422, "k=\"3\""),
             (b'{"text": "x", "k": true}', "application/json", 422, "k=true")]
    for body, kind, status, words in cases:
        got, answer = _post(url, body, kind)
        assert got == status and words in answer["detail"] and "\n" not in answer["detail"], (body[:40], answer)
    assert _post(url, {"text": "import logging"})[0] == 200
    metrics = _get(server.url + "/metrics")
    assert 'trainer_serve_predict_requests_total{status="422"} 5.0' in metrics
    assert 'trainer_serve_predict_requests_total{status="413"} 2.0' in metrics
    assert "trainer_serve_process_proportional_memory_bytes" in metrics


def test_info_and_openapi_state_the_limits(encoder):
    _, _, server = encoder
    info = json.loads(_get(server.url + "/info"))["server"]
    assert info["max_chars"] == MAX_CHARS and info["max_body_bytes"] == MAX_BYTES and info["max_length"] == 128
    assert info["max_batch_size"] == 16 and "max(8, 2n)" in info["batching"] and "126" in info["truncation"]
    api = json.loads(_get(server.url + "/openapi.json"))
    predict = api["paths"]["/predict"]["post"]
    text = predict["requestBody"]["content"]["application/json"]["schema"]["properties"]["text"]
    assert text["maxLength"] == MAX_CHARS and "128 tokens" in text["description"]
    assert {"400", "413", "415", "422"} <= set(predict["responses"])
    assert "/info" in api["paths"] and "/metrics" in api["paths"]


def test_load_reports_of_both_text_servers(encoder, gpt):
    """The GPT's through the command (which starts its own server); the encoder's on the module's server,
    already running (a third server would only repeat the start-up)."""
    run_dir, exported, server = encoder
    load_text_run(run_dir, exported.folder, load_card(exported.folder / "model.json"), [1, 4], 8, 2.0,
                  max_batch_size=16, batch_timeout_ms=150, server=server)
    done = python_forked(["-m", "trainer.deploy", "load", str(gpt[0]), "--concurrency", "1,4", "--requests", "8",
                          "--budget-s", "2"], timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for run_dir, _, _ in (encoder, gpt):
        report = json.loads((Path(run_dir) / "deploy_load.json").read_text())
        memory = report["memory_mib"]
        assert {"main", "inference_worker", "http"} <= {name.split(" ")[0] for name in memory}
        assert memory["total"]["pss_mib"] < memory["total"]["rss_mib"] and memory["total"]["pss_mib"] > 100
        rows = report["rows"]
        assert {r["concurrency"] for r in rows} == {1, 4} and all(r["requests"] > 0 and r["errors"] == 0 for r in rows)
        assert all(r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] for r in rows)
        if report["generating"]:
            assert all(r["figures"]["tokens_per_s"] > 0 and r["figures"]["ttft_p50_ms"] <= r["figures"]["ttft_p99_ms"]
                       for r in rows)
        else:
            bins = {r["bin"] for r in rows}
            assert "all" in bins and len(bins) >= 3 and all(r["qps"] > 0 for r in rows)
            assert all(r["figures"]["mean_length"] <= int(r["bin"]) for r in rows if r["bin"] != "all")
        assert "| concurrency |" in (Path(run_dir) / "deploy_load.md").read_text()
