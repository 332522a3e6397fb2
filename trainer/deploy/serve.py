"""``python -m trainer.deploy serve RUN_DIR|CKPT|EXPORT_DIR``: the exported model behind a batching HTTP server.

Built on LitServe (its inference worker, dynamic batching, ``/health`` and graceful shutdown); the
API and where LitServe's behaviour is replaced, and why, are in docs/deploy.md. In short: LitServe
reads every non-form body as JSON (LitServe #732), so the handler is ours, and it checks and decodes
the image before queueing (in LitServe's batched loop one failing ``decode_request`` fails its whole
batch); SIGTERM takes LitServe's Ctrl+C path (it installs no handler, and the process would die
leaving its queue manager's children behind); ``/info`` and ``/metrics`` are ours."""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import signal
import socket
import time
from functools import partial
from pathlib import Path
from queue import Empty
from typing import Any, Awaitable, Callable, Iterator, Optional

import litserve as ls
import numpy as np
import torch
from fastapi import HTTPException, Request, Response
from litserve.loops.base import _SENTINEL_VALUE, _StopLoopError
from litserve.loops.simple_loops import BatchedLoop
from litserve.server import RegularRequestHandler
from fastapi.responses import JSONResponse
from PIL import Image
from prometheus_client import (CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector,
                               ProcessCollector)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from pydantic import BaseModel, ConfigDict, Field

from trainer.deploy import DEFAULT_BATCH_TIMEOUT_MS, DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_BYTES, DEFAULT_MAX_PIXELS
from trainer.deploy.preprocess import NotAnImage, Normalizer, Preprocessing, TooManyPixels
from trainer.infra.errors import UserError
from trainer.infra.processes import descendants, memory_bytes, stat_fields
from trainer.infra.versions import project_version

CONTENT_TYPES = ("image/jpeg", "image/png")
JSON_TYPE = "application/json"
TEXT_TYPE = "text/plain"  # what a browser's fetch() sends a string as: here, a data URL
#: a data URL's media type: what FileReader.readAsDataURL writes for a JPEG, a PNG, or a file it cannot type
DATA_URL_TYPES = (*CONTENT_TYPES, "", "application/octet-stream")
API_PATH = "/predict"
METRICS_PATH = "/metrics"
INFO_PATH = "/info"
METRICS_NAMESPACE = "trainer_serve"
TITLE = "gpu-practice-trainer image classifier"


# -- the API's documented shapes (/openapi.json) -----------------------------------------------------------
class ImageJSON(BaseModel):
    """The JSON body of /predict: the image's file bytes (JPEG or PNG), base64-encoded."""

    image: str = Field(description="the JPEG or PNG file, base64-encoded (standard alphabet), or as a data URL "
                                   "(data:image/png;base64,...)")
    k: Optional[int] = Field(None, ge=1, description="how many classes to answer (default: the server's --top-k)")


class RankedClass(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    class_name: str = Field(alias="class", description="the class's name, as in the training data")
    index: int = Field(description="the class's index in the model's output")
    probability: float = Field(description="softmax probability, rounded to 6 digits")


class Prediction(BaseModel):
    """The answer of /predict."""

    top_k: list[RankedClass] = Field(description="the k most probable classes, most probable first")
    batch: int = Field(description="the size of the batch this request was served in")


class ErrorDetail(BaseModel):
    """A refused request: one line saying what was wrong and what is allowed."""

    detail: str = Field(description="one line: what was wrong with the request and what is allowed")


def refusals(descriptions: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """An endpoint's refusals by status, for /openapi.json: one line in `detail` each (`ErrorDetail`)."""
    return {status: {"model": ErrorDetail, "description": text} for status, text in descriptions.items()}


#: /predict's refusals (see docs/deploy.md)
ERROR_RESPONSES = refusals({
    400: "not a usable image (not JPEG or PNG, truncated, corrupt), an empty body, JSON that is not JSON, base64 "
         "or a data URL that is malformed",
    413: "over a limit: the body or the image's bytes over --max-bytes, or the image's pixels (from its header, "
         "before decoding) over --max-pixels",
    415: "a Content-Type other than image/jpeg, image/png, application/json or text/plain (a data URL), or a data "
         "URL of another media type",
    422: "k is not a positive integer, or the JSON has no \"image\" string",
    504: "the inference worker did not answer within 30 s",
})


def encoded_limit(max_bytes: int) -> int:
    """The largest body read when the image comes base64-encoded (JSON, a data URL): its base64 length
    plus 1 KiB for the JSON's or the data URL's header."""
    return (max_bytes + 2) // 3 * 4 + 1024


def _openapi_extra(max_bytes: int) -> dict[str, Any]:
    """/predict's requestBody (an image file as the body, `ImageJSON`, or a data URL as text) and its
    `k` query parameter: FastAPI sees neither in the raw Request the handler takes."""
    binary = {"schema": {"type": "string", "format": "binary", "maxLength": max_bytes}}
    data_url = {"schema": {"type": "string", "pattern": "^data:(image/(png|jpeg))?(;[^,]*)?;base64,",
                           "maxLength": encoded_limit(max_bytes),
                           "description": "a data URL, as a browser's FileReader.readAsDataURL makes it"}}
    k = {"name": "k", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1},
         "description": "how many classes to answer (default: the server's --top-k; JSON's \"k\" wins)"}
    return {"parameters": [k], "requestBody": {"required": True, "content": {
        **{kind: binary for kind in CONTENT_TYPES}, JSON_TYPE: {"schema": ImageJSON.model_json_schema()},
        TEXT_TYPE: data_url}}}


def image_from_data_url(text: str) -> bytes:
    """The file bytes of a base64 data URL (``data:image/png;base64,...``, RFC 2397); HTTPException 400
    when it is malformed or not base64 (checked strictly: standard alphabet, padded), 415 when its
    media type is not a JPEG or PNG. The size limit is the caller's, on the bytes returned."""
    header, comma, payload = text.strip().partition(",")
    if not _is_data_url(header) or not comma:
        raise HTTPException(400, "not a data URL (no ',' after its header); allowed: data:image/png;base64,<base64>")
    media, *parameters = [part.strip().lower() for part in header[5:].split(";")]
    if "base64" not in parameters:
        raise HTTPException(400, "the data URL is not base64 (no ';base64' in its header); allowed: "
                                 "data:image/png;base64,<base64>, or POST the image's bytes as image/png")
    if media not in DATA_URL_TYPES:
        raise HTTPException(415, f"the data URL is of '{media}', not an image this server reads; allowed: "
                                 f"{', '.join(CONTENT_TYPES)}")
    return _strict_base64(payload, "the data URL's data")


def _strict_base64(text: str, what: str) -> bytes:
    """The bytes of base64 `text` (standard alphabet, padded, no whitespace); HTTPException 400 naming
    `what` otherwise."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise HTTPException(400, f"{what} is not valid base64 (standard alphabet, padded, no whitespace)") from None


def _is_data_url(body: bytes | str) -> bool:
    """Whether a body or a JSON string starts as a data URL does (``data:``, any case)."""
    start = body.lstrip()[:5]
    return (start.decode("latin-1") if isinstance(start, bytes) else start).lower() == "data:"


class ServerMetrics:
    """What `GET /metrics` tells Prometheus (docs/deploy.md lists it), counted in the HTTP process,
    where every request passes: the server's own under ``trainer_serve_``, and the HTTP process's."""

    def __init__(self, max_batch_size: int) -> None:
        self.registry = CollectorRegistry()  # the server's own: a second server in a process starts at 0
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.registry.register(ServerMemoryCollector())
        self.requests = Counter("predict_requests", "requests to /predict, by HTTP status", ["status"],
                                namespace=METRICS_NAMESPACE, registry=self.registry)
        self.latency = Histogram("predict_latency_seconds", "time from a request's arrival to its answer",
                                 namespace=METRICS_NAMESPACE, registry=self.registry,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256} & set(range(1, max_batch_size + 1)) | {max_batch_size})
        self.batch = Histogram("predict_batch_size", "the size of the batch each answered request was in",
                               namespace=METRICS_NAMESPACE, registry=self.registry,
                               buckets=tuple(float(size) for size in sizes))

    def observe(self, status: int, seconds: float, batch: Optional[int] = None) -> None:
        self.requests.labels(status=str(status)).inc()
        self.latency.observe(seconds)
        if batch is not None:
            self.batch.observe(batch)

    def exposition(self, request: Request) -> Response:
        """Prometheus' text format, or OpenMetrics when the Accept header asks for it (prometheus-client's
        own negotiation, as its HTTP server does)."""
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(self.registry), headers={"Content-Type": content_type})


def server_processes(main_pid: int) -> dict[int, str]:
    """The server's processes by role: ``main`` (LitServer.run, waiting for the end), ``queue_manager``
    (multiprocessing's Manager: the request queue and the workers' status), ``inference_worker``
    (spawned: a fresh interpreter with the model), ``http`` (uvicorn, forked from main) and
    ``resource_tracker`` (multiprocessing's, started with the first spawned process). The two forked
    ones share main's command line; LitServer.run starts the manager before the worker and the HTTP
    server after it, so the start time tells them apart."""
    roles = {main_pid: "main"}
    forked: list[tuple[int, int]] = []
    worker_started: Optional[int] = None
    for pid in descendants(main_pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            started = int(stat_fields(pid)[19])
        except OSError:
            continue  # gone meanwhile
        if b"resource_tracker" in command:
            roles[pid] = "resource_tracker"
        elif b"spawn_main" in command:
            roles[pid] = "inference_worker"
            worker_started = started if worker_started is None else min(worker_started, started)
        else:
            forked.append((started, pid))
    for started, pid in forked:
        roles[pid] = "queue_manager" if worker_started is not None and started < worker_started else "http"
    return roles


def process_memory(main_pid: int) -> Iterator[tuple[int, str, int, int]]:
    """(pid, role, RSS bytes, PSS bytes) of each of the server's processes (`server_processes`)."""
    for pid, role in server_processes(main_pid).items():
        try:
            resident, proportional, _ = memory_bytes(pid)
        except OSError:
            continue  # gone meanwhile
        yield pid, role, resident, proportional


class ServerMemoryCollector:
    """``trainer_serve_process_resident_memory_bytes`` and ``..._proportional_memory_bytes`` of each of
    the server's processes, by role (`server_processes`), read from /proc at each scrape. Runs in the
    HTTP process, whose parent is main; where /proc cannot be read (not Linux), nothing."""

    def collect(self) -> Any:
        rss = GaugeMetricFamily(f"{METRICS_NAMESPACE}_process_resident_memory_bytes",
                                "resident memory (RSS) of each of the server's processes; shared pages are "
                                "counted in each", labels=["role", "pid"])
        pss = GaugeMetricFamily(f"{METRICS_NAMESPACE}_process_proportional_memory_bytes",
                                "proportional memory (PSS) of each of the server's processes: shared pages "
                                "divided among their sharers, so the sum is the server's memory", labels=["role", "pid"])
        try:
            for pid, role, resident, proportional in process_memory(os.getppid()):
                rss.add_metric([role, str(pid)], resident)
                pss.add_metric([role, str(pid)], proportional)
        except OSError:
            pass
        yield rss
        yield pss


# -- the model files ------------------------------------------------------------------------------------
def read_card(folder: Path) -> tuple[dict[str, Any], Preprocessing]:
    from trainer.deploy.export import load_card  # see ClassifierAPI: not in the inference worker

    card = load_card(folder / "model.json")
    if card.get("task") == "language_model":
        raise UserError(str(folder / "model.json"), "is a language model: this server answers images with classes",
                        f"python -m trainer.generate {card.get('run', {}).get('folder', 'RUN_DIR')} --prompt TEXT, or "
                        "the exported model.pt2 / model.onnx (token ids in, next-token logits out)")
    if card.get("kind", "images") != "images":
        shapes = ", ".join(f"{i['name']} {i['dtype']} {'x'.join(map(str, i['shape']))}" for i in card.get("inputs", []))
        raise UserError(str(folder / "model.json"), f"is a model of {card['kind']} ({shapes or 'no inputs stated'}): "
                        "this server answers images with classes", "the exported model.onnx or model.pt2, whose "
                        "inputs, outputs and preprocessing the card states")
    if not card.get("preprocessing"):
        raise UserError(str(folder / "model.json"), "states no preprocessing: the run's data are not images a "
                        "client could send", "a run trained on digits, CIFAR-10 or an image folder")
    try:
        return card, Preprocessing.from_card(card["preprocessing"], str(folder / "model.json"))
    except ValueError as ex:
        raise UserError(str(folder / "model.json"), str(ex).partition(": ")[2], "a model card written by "
                        "this version's export") from None


class Runtime:
    """The exported network on one device: ONNX Runtime (model.onnx, CPU) or the torch.export program
    (model.pt2, any device). Takes normalized float batches, gives probabilities."""

    def __init__(self, folder: Path, kind: str, device: torch.device) -> None:
        self.kind, self.device = kind, device
        if kind == "onnxruntime":
            import onnxruntime

            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = torch.get_num_threads()
            # ONNX Runtime's pool threads spin between calls by default: in a server that waits for
            # requests most of the time, that spinning takes the CPU the HTTP process needs.
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            self._session = onnxruntime.InferenceSession(str(folder / "model.onnx"), options,
                                                         providers=["CPUExecutionProvider"])
            self._input = self._session.get_inputs()[0].name
        else:
            self._program = torch.export.load(str(folder / "model.pt2")).module().to(device)

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """The network's output for a batch (images, or an encoder's token ids), as float32."""
        if self.kind == "onnxruntime":
            return torch.from_numpy(self._session.run(None, {self._input: inputs.cpu().numpy()})[0]).float()
        with torch.inference_mode():
            return self._program(inputs.to(self.device)).float()

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.logits(images), dim=1).cpu()


def runtime_for(device: torch.device, runtime: str) -> str:
    if runtime == "auto":
        return "onnxruntime" if device.type == "cpu" else "torch"
    if runtime == "onnxruntime" and device.type != "cpu":
        raise UserError("--runtime", "onnxruntime runs on the CPU here (onnxruntime-gpu is not installed)",
                        "--runtime torch on CUDA, or --device cpu")
    return runtime


# -- the inference worker -------------------------------------------------------------------------------
class WaitingBatchLoop(BatchedLoop):
    """LitServe's batched loop, collecting a batch by waiting on the request queue instead of polling it.

    Replaces LitServe's ``collate_requests`` (litserve/loops/base.py), which asks the queue's manager
    process for a request every millisecond even when the server is idle (18% of a core measured
    here, at rest) and, with ``batch_timeout=0``, spins on ``get_nowait``. Here the first request is
    waited for (up to a second, then the loop checks in again), the rest of the batch until
    ``batch_timeout`` after it arrived, whichever of that and ``max_batch_size`` comes first."""

    def get_batch_requests(self, lit_api: ls.LitAPI, request_queue: Any, transport: Any) -> tuple[list, list]:
        payloads: list[tuple[Any, Any, Any]] = []
        timed_out: list[tuple[Any, Any]] = []
        deadline = None
        while len(payloads) < lit_api.max_batch_size:
            wait = 1.0 if deadline is None else deadline - time.monotonic()
            try:
                item = request_queue.get(timeout=wait) if wait > 0 else request_queue.get_nowait()
            except Empty:
                break
            if item == _SENTINEL_VALUE:
                raise _StopLoopError()
            response_queue_id, uid, queued_at, payload = item
            deadline = deadline or time.monotonic() + lit_api.batch_timeout
            if lit_api.request_timeout not in (-1, False) and time.monotonic() - queued_at > lit_api.request_timeout:
                timed_out.append((response_queue_id, uid))
            else:
                payloads.append((response_queue_id, uid, payload))
        return payloads, timed_out


class ClassifierAPI(ls.LitAPI):
    """Runs in LitServe's inference worker process: a request is already checked, decoded uint8 pixels
    (see `ImageRequestHandler`; LitAPI's own decode_request and encode_response pass requests and
    answers through); batches are normalized and classified together.

    The worker is a fresh interpreter (spawned) that imports this module: the card is read by the main
    process and travels with this object, so that the worker never imports the exporter (which brings
    Lightning, about 100 MB per interpreter); see docs/deploy.md, "Processes and memory"."""

    def __init__(self, folder: Path, card: dict[str, Any], preprocessing: Preprocessing, runtime: str, top_k: int,
                 max_batch_size: int, batch_timeout: float) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout, api_path=API_PATH,
                         loop=WaitingBatchLoop() if max_batch_size > 1 else "auto")
        self.folder, self.runtime_kind, self.top_k = Path(folder), runtime, top_k
        self.classes, self.preprocessing = [str(c) for c in card["classes"]], preprocessing

    def setup(self, device: str) -> None:
        self.device = torch.device(device)
        self.normalize = Normalizer(self.preprocessing, self.device)
        self.model = Runtime(self.folder, runtime_for(self.device, self.runtime_kind), self.device)
        if self.model.kind == "onnxruntime":
            # PyTorch is left only the normalization and softmax of small batches; its thread pool
            # would spin between them on the cores ONNX Runtime and the HTTP process use.
            torch.set_num_threads(1)
        self._warm_up(self.preprocessing)

    def _warm_up(self, preprocessing: Preprocessing) -> None:
        """Every batch size the batcher can form, once, before /health says ready: ONNX Runtime and
        the CUDA allocator prepare per shape, and the first calls would otherwise be the slow ones."""
        size = (preprocessing.channels, *preprocessing.output_size)
        for batch in range(1, self.max_batch_size + 1):
            self.model(self.normalize(np.zeros((batch, *size), np.uint8)))

    def predict(self, x: Any) -> Any:
        requests = x if isinstance(x, list) else [x]  # unbatched: one request, not a list
        pixels = np.stack([r["pixels"] for r in requests])
        probabilities = self.model(self.normalize(pixels))
        answers = [self._top(p, min(r["k"], len(self.classes)), len(requests)) for p, r in
                   zip(probabilities, requests)]
        return answers if isinstance(x, list) else answers[0]

    def _top(self, probabilities: torch.Tensor, k: int, batch: int) -> dict[str, Any]:
        values, indices = probabilities.topk(k)
        return {"top_k": [{"class": self.classes[i], "index": i, "probability": round(v, 6)}
                          for v, i in zip(values.tolist(), indices.tolist())], "batch": batch}


# -- the HTTP side ---------------------------------------------------------------------------------------
class ImageRequestHandler(RegularRequestHandler):
    """LitServe's request handler, reading the raw image body instead of JSON (see the module's
    docstring): content type, size and the image itself are checked here, one 4xx line each."""

    server: "ImageServer"

    async def _prepare_request(self, request: Request, request_type: Any) -> dict[str, Any]:
        max_bytes = self.server.max_bytes
        content_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if content_type not in (*CONTENT_TYPES, JSON_TYPE, TEXT_TYPE):
            raise HTTPException(415, f"Content-Type '{content_type or 'none'}' is not an image; allowed: "
                                     f"{', '.join(CONTENT_TYPES)} with the image's bytes as the body, "
                                     f"{JSON_TYPE} with the image base64-encoded as \"image\", or {TEXT_TYPE} "
                                     "with a data URL (data:image/png;base64,...)")
        encoded = content_type in (JSON_TYPE, TEXT_TYPE)
        body = bytes(await self._body(request, encoded_limit(max_bytes) if encoded else max_bytes))
        k = self._k(request.query_params.get("k"))
        if _is_data_url(body):  # whatever the Content-Type: a browser's fetch() sends a string as text/plain
            body = image_from_data_url(body.decode("latin-1"))
        elif content_type == JSON_TYPE:
            body, k = self._from_json(body, k)
        elif content_type == TEXT_TYPE:
            raise HTTPException(415, f"Content-Type '{TEXT_TYPE}' is read as a data URL (data:image/png;base64,...) "
                                     "and this body is not one; allowed: the image's bytes as image/jpeg or "
                                     "image/png, or a data URL")
        if not body:
            raise HTTPException(400, "empty body; allowed: the bytes of a JPEG or PNG image")
        if len(body) > max_bytes:
            raise HTTPException(413, f"image of {len(body):,} bytes is over the limit of {max_bytes:,} "
                                     "(--max-bytes)")
        try:
            pixels = self.server.preprocessing.pixels(body, max_pixels=self.server.max_pixels)
        except TooManyPixels as ex:
            raise HTTPException(413, f"{ex} (--max-pixels); checked before decoding: send a smaller image") from None
        except NotAnImage as ex:
            raise HTTPException(400, str(ex)) from None
        return {"pixels": pixels, "k": k}

    @staticmethod
    async def _body(request: Request, limit: int) -> bytearray:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HTTPException(413, f"body of {int(declared):,} bytes is over the limit of {limit:,}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise HTTPException(413, f"body is over the limit of {limit:,} bytes")
        return body

    def _from_json(self, body: bytes, k: int) -> tuple[bytes, int]:
        """The image and k of a JSON body (`ImageJSON`; LitServe's client sends ``input``); the image
        base64 or a data URL, and a JSON string alone is the image too."""
        try:
            data = json.loads(body)
        except ValueError:
            raise HTTPException(400, "the body is not JSON; allowed: {\"image\": \"<base64 of a JPEG or "
                                     "PNG>\"}") from None
        if isinstance(data, str):
            data = {"image": data}
        encoded = data.get("image", data.get("input")) if isinstance(data, dict) else None
        if not isinstance(encoded, str):
            raise HTTPException(422, "the JSON has no \"image\" string; allowed: {\"image\": \"<base64 of a "
                                     "JPEG or PNG>\", \"k\": 3}")
        image = image_from_data_url(encoded) if _is_data_url(encoded) else _strict_base64(encoded, '"image"')
        if "k" in data:
            k = self._k(str(data["k"]))
        return image, k

    def _k(self, text: Optional[str]) -> int:
        if text is None:
            return self.server.default_k
        if not text.isdigit() or int(text) < 1:
            raise HTTPException(422, f"k='{text}' is not a positive integer")
        return int(text)


class ModelServer(ls.LitServer):
    """A LitServer of one inference worker on one device, documented in /openapi.json under `title` and
    the project's version, counted for `GET /metrics` (`observed_route`), with ``GET /info`` stating
    the limits this server applies (`limits`, set by the subclass) in place of LitServe's."""

    limits: dict[str, Any]

    def __init__(self, api: ls.LitAPI, title: str, description: str, **kwargs: Any) -> None:
        self.metrics = ServerMetrics(max(1, api.max_batch_size))
        super().__init__(api, info_path=INFO_PATH, devices=1, workers_per_device=1, **kwargs)
        # LitServe names its FastAPI app after FastAPI itself ("FastAPI 0.1.0" in /docs).
        self.app.title, self.app.version = title, project_version()
        self.app.description = description
        self.app.add_api_route(METRICS_PATH, self.metrics.exposition, methods=["GET"], response_class=Response,
                               summary="Prometheus metrics: requests by status, latency, batch sizes, memory")
        # Replaces LitServe's /info: it reports its own max_payload_size (None: its size middleware is
        # not used, the handler checks the body itself) and none of this server's limits.
        self.app.router.routes = [route for route in self.app.router.routes
                                  if getattr(route, "path", None) != INFO_PATH]
        self.app.add_api_route(INFO_PATH, self.info, methods=["GET"], summary="The model and the server's limits")

    def info(self) -> JSONResponse:
        """LitServe's /info (the model, devices, workers, timeout), with this server's real limits."""
        return JSONResponse({"model": self.model_metadata, "server": {
            "devices": self.devices, "workers_per_device": self.workers_per_device, "timeout": self.timeout,
            **self.limits}})

    def observed_route(self, path: str, answer: Callable[[Request], Awaitable[Any]], **route: Any) -> None:
        """POST `path`, answered by `answer` (a request handler's), counted for /metrics by status and
        batch. FastAPI is given the raw Request as the one parameter, so `route` declares the bodies and
        the answer for /openapi.json."""
        metrics = self.metrics

        async def endpoint(request: Request) -> Any:
            started = time.perf_counter()
            try:
                answered = await answer(request)
            except HTTPException as ex:
                metrics.observe(ex.status_code, time.perf_counter() - started)
                raise
            except Exception:
                metrics.observe(500, time.perf_counter() - started)
                raise
            metrics.observe(200, time.perf_counter() - started,
                            answered.get("batch") if isinstance(answered, dict) else None)
            return answered

        self.app.add_api_route(path, endpoint, methods=["POST"], **route)


class ImageServer(ModelServer):
    """The image classifier's server: POST /predict served by `ImageRequestHandler`."""

    def __init__(self, api: ClassifierAPI, preprocessing: Preprocessing, max_bytes: int, default_k: int,
                 max_pixels: int = DEFAULT_MAX_PIXELS, **kwargs: Any) -> None:
        self.preprocessing, self.max_bytes, self.default_k = preprocessing, max_bytes, default_k
        self.max_pixels = max_pixels
        super().__init__(api, TITLE, "Classifies an image with the exported model; POST /predict, GET /metrics, "
                                     "GET /info.", **kwargs)
        self.limits = {
            "stream": {lit_api.api_path: lit_api.stream for lit_api in self.litapi_connector},
            "track_requests": self.track_requests,
            # LitServe's key, meaning the largest body: here the image's bytes (base64 may take a third more)
            "max_payload_size": max_bytes,
            "max_body_bytes": {"image": max_bytes, "base64": encoded_limit(max_bytes)},
            "max_pixels": max_pixels, "top_k": default_k, "runtime": api.runtime_kind,
            "max_batch_size": api.max_batch_size, "batch_timeout_ms": api.batch_timeout * 1000}

    # Replaces LitServer._register_api_endpoints (private in litserve 0.2.x, pinned <0.3 in pyproject): the
    # same route, our handler (also in serve_text.py and serve_generate.py).
    def _register_api_endpoints(self, lit_api: ls.LitAPI, request_type: Any, response_type: Any) -> None:
        handler = ImageRequestHandler(lit_api, self)
        self.observed_route(lit_api.api_path, partial(handler.handle_request, request_type=Request),
                            response_model=Prediction, response_model_by_alias=True, summary="Classify one image",
                            responses=ERROR_RESPONSES, openapi_extra=_openapi_extra(self.max_bytes))


def serve(source: Path, port: int = 8000, host: str = "127.0.0.1", max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
          batch_timeout_ms: float = DEFAULT_BATCH_TIMEOUT_MS, top_k: int = 5, max_bytes: int = DEFAULT_MAX_BYTES,
          max_pixels: int = DEFAULT_MAX_PIXELS, runtime: str = "auto", device: Optional[str] = None,
          log_level: str = "warning") -> None:
    """An image classifier's export (a text model's: serve_text.py, serve_generate.py; the command
    picks by the card's task, `trainer.deploy.__main__`)."""
    _check_port(host, port)
    from trainer.deploy.export import export_folder

    folder = export_folder(source)
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    card, preprocessing = read_card(folder)
    api = ClassifierAPI(folder, card, preprocessing, runtime_for(target, runtime), top_k, max_batch_size,
                        batch_timeout_ms / 1000)
    server = ImageServer(api, preprocessing, max_bytes, top_k, max_pixels=max_pixels, accelerator=target.type,
                         timeout=30, model_metadata={"model": card.get("model"), "classes": len(card["classes"])})
    # The decoding path once here, in the main process: its imports (torchvision, PIL's plugins) are
    # then shared with the HTTP process forked from it, instead of loaded by its first request.
    preprocessing.pixels(_one_pixel_png())
    # PIL's decompression-bomb check is replaced by --max-pixels, in this server's processes only: the
    # same check on the header before decoding, but with the server's limit and a one-line 413 instead
    # of PIL's warning on stderr from 89 MP and its error from 179 MP.
    Image.MAX_IMAGE_PIXELS = None
    run_server(server, folder, host, port, log_level, f"serving {folder} on http://{host}:{port}{API_PATH} (max "
               f"batch {max_batch_size}, batch timeout {batch_timeout_ms:g} ms, {api.runtime_kind} on {target}; "
               f"images up to {max_bytes:,} bytes and {max_pixels:,} pixels); /health is 200 once warmed up")


def run_server(server: ls.LitServer, folder: Path, host: str, port: int, log_level: str, banner: str) -> None:
    """Run `server` until SIGTERM or Ctrl+C (see `_interrupt`), saying so; a worker that fails to
    load is one line."""
    global _MAIN_PID
    _MAIN_PID = os.getpid()
    signal.signal(signal.SIGTERM, _interrupt)  # inherited by the processes LitServe forks: see _interrupt
    print(banner, flush=True)
    started = time.monotonic()
    try:
        server.run(host=host, port=port, num_api_servers=1, log_level=log_level, generate_client_file=False)
    except RuntimeError as ex:
        if "failed to start" not in str(ex):
            raise
        raise UserError(str(folder), "the inference worker could not load and warm up the model (its error is "
                        "above)", "an export folder written by export, with model.onnx, model.pt2 or "
                        "weights.safetensors") from None
    print(f"stopped after {time.monotonic() - started:.0f} s", flush=True)


def _one_pixel_png() -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (1, 1)).save(buffer, "PNG")
    return buffer.getvalue()


def _check_port(host: str, port: int) -> None:
    if not 1024 <= port <= 65535:  # LitServe's own range
        raise UserError("--port", f"{port} is out of range", "a free port from 1024 to 65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as ex:
            raise UserError("--port", f"{host}:{port} cannot be listened on ({ex.strerror})",
                            "a free port from 1024 to 65535") from None


_MAIN_PID: Optional[int] = None


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM in the main process takes LitServer.run's graceful path (see the module's docstring).
    In a process LitServe forked (its queue manager, the HTTP process once uvicorn has drained),
    it does nothing while the main process lives: when the whole process group is signalled
    (systemd, a terminal), the main process stops them in order, and the queue manager must outlive
    the requests in flight. Orphaned (the main process killed), the child ends."""
    if os.getpid() == _MAIN_PID:
        raise KeyboardInterrupt
    if os.getppid() != _MAIN_PID:
        os._exit(0)
