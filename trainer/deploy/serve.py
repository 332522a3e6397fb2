"""``python -m trainer.deploy serve RUN_DIR|CKPT|EXPORT_DIR``: the exported model behind a batching HTTP server.

Built on LitServe (its inference worker, dynamic batching, ``/health`` and graceful shutdown); the
API and where LitServe's behaviour is replaced, and why, are in docs/deploy.md. LitServe reads every
non-form body as JSON (LitServe #732), so the handler is ours, and the image is checked and decoded
in the HTTP process, before queueing: a bad one is a 4xx for its request alone (in LitServe's batched
loop one failing ``decode_request`` fails its whole batch); the worker gets uint8 pixels and normalizes
whole batches. SIGTERM takes LitServe's Ctrl+C path: LitServe installs no handler, and the process
would die leaving its queue manager's children behind."""

from __future__ import annotations

import base64
import binascii
import json
import os
import signal
import socket
import time
from queue import Empty
from pathlib import Path
from typing import Any, Optional

import litserve as ls
import numpy as np
import torch
from fastapi import HTTPException, Request, Response
from litserve.loops.base import _SENTINEL_VALUE, _StopLoopError
from litserve.loops.simple_loops import BatchedLoop
from litserve.server import RegularRequestHandler
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from trainer.deploy import DEFAULT_BATCH_TIMEOUT_MS, DEFAULT_MAX_BATCH_SIZE
from trainer.deploy.export import export_folder, load_card
from trainer.deploy.preprocess import NotAnImage, Normalizer, Preprocessing
from trainer.infra.errors import UserError
from trainer.infra.versions import project_version

CONTENT_TYPES = ("image/jpeg", "image/png")
JSON_TYPE = "application/json"
DEFAULT_MAX_BYTES = 10 * 1024 * 1024
API_PATH = "/predict"
METRICS_PATH = "/metrics"
TITLE = "gpu-practice-trainer image classifier"


# -- the API's documented shapes (/openapi.json) -----------------------------------------------------------
class ImageJSON(BaseModel):
    """The JSON body of /predict: the image's file bytes (JPEG or PNG), base64-encoded."""

    image: str = Field(description="the JPEG or PNG file, base64-encoded (standard alphabet)")
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


def _request_body_schema(max_bytes: int) -> dict[str, Any]:
    """The OpenAPI requestBody of /predict: an image file as the body, or `ImageJSON`."""
    binary = {"schema": {"type": "string", "format": "binary", "maxLength": max_bytes}}
    return {"requestBody": {"required": True, "content": {
        **{kind: binary for kind in CONTENT_TYPES}, JSON_TYPE: {"schema": ImageJSON.model_json_schema()}}}}


class ServerMetrics:
    """What `GET /metrics` tells Prometheus, counted in the HTTP process (where every request passes):
    requests by status code, their latency from arrival to answer, and the batch each was served in."""

    def __init__(self, max_batch_size: int) -> None:
        self.registry = CollectorRegistry()  # the server's own: a second server in a process starts at 0
        self.requests = Counter("predict_requests", "requests to /predict, by HTTP status", ["status"],
                                registry=self.registry)
        self.latency = Histogram("predict_latency_seconds", "time from a request's arrival to its answer",
                                 registry=self.registry,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256} & set(range(1, max_batch_size + 1)) | {max_batch_size})
        self.batch = Histogram("predict_batch_size", "the size of the batch each answered request was in",
                               registry=self.registry, buckets=tuple(float(size) for size in sizes))

    def observe(self, status: int, seconds: float, batch: Optional[int] = None) -> None:
        self.requests.labels(status=str(status)).inc()
        self.latency.observe(seconds)
        if batch is not None:
            self.batch.observe(batch)

    def exposition(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


# -- the model files ------------------------------------------------------------------------------------
def read_card(folder: Path) -> tuple[dict[str, Any], Preprocessing]:
    card = load_card(folder / "model.json")
    if card.get("task") == "language_model":
        raise UserError(str(folder / "model.json"), "is a language model: this server answers images with classes",
                        f"python -m trainer.generate {card.get('run', {}).get('folder', 'RUN_DIR')} --prompt TEXT, or "
                        "the exported model.pt2 / model.onnx (token ids in, next-token logits out)")
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

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if self.kind == "onnxruntime":
            logits = torch.from_numpy(self._session.run(None, {self._input: images.cpu().numpy()})[0])
        else:
            with torch.inference_mode():
                logits = self._program(images.to(self.device))
        return torch.softmax(logits.float(), dim=1).cpu()


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
    (see `ImageRequestHandler`); batches are normalized and classified together."""

    def __init__(self, folder: Path, runtime: str, top_k: int, max_batch_size: int, batch_timeout: float) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout, api_path=API_PATH,
                         loop=WaitingBatchLoop() if max_batch_size > 1 else "auto")
        self.folder, self.runtime_kind, self.top_k = Path(folder), runtime, top_k

    def setup(self, device: str) -> None:
        card, preprocessing = read_card(self.folder)
        self.classes = [str(c) for c in card["classes"]]
        self.device = torch.device(device)
        self.normalize = Normalizer(preprocessing, self.device)
        self.model = Runtime(self.folder, runtime_for(self.device, self.runtime_kind), self.device)
        if self.model.kind == "onnxruntime":
            # PyTorch is left only the normalization and softmax of small batches; its thread pool
            # would spin between them on the cores ONNX Runtime and the HTTP process use.
            torch.set_num_threads(1)
        self._warm_up(preprocessing)

    def _warm_up(self, preprocessing: Preprocessing) -> None:
        """Every batch size the batcher can form, once, before /health says ready: ONNX Runtime and
        the CUDA allocator prepare per shape, and the first calls would otherwise be the slow ones."""
        size = (preprocessing.channels, *preprocessing.output_size)
        for batch in range(1, self.max_batch_size + 1):
            self.model(self.normalize(np.zeros((batch, *size), np.uint8)))

    def decode_request(self, request: dict[str, Any]) -> dict[str, Any]:
        return request  # checked and decoded in the HTTP process already

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

    def encode_response(self, output: dict[str, Any]) -> dict[str, Any]:
        return output


# -- the HTTP side ---------------------------------------------------------------------------------------
class ImageRequestHandler(RegularRequestHandler):
    """LitServe's request handler, reading the raw image body instead of JSON (see the module's
    docstring): content type, size and the image itself are checked here, one 4xx line each."""

    def __init__(self, lit_api: ls.LitAPI, server: "ImageServer") -> None:
        super().__init__(lit_api, server)
        self.preprocessing = server.preprocessing
        self.max_bytes = server.max_bytes
        self.default_k = server.default_k

    async def _prepare_request(self, request: Request, request_type: Any) -> dict[str, Any]:
        content_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if content_type not in (*CONTENT_TYPES, JSON_TYPE):
            raise HTTPException(415, f"Content-Type '{content_type or 'none'}' is not an image; allowed: "
                                     f"{', '.join(CONTENT_TYPES)} with the image's bytes as the body, or "
                                     f"{JSON_TYPE} with the image base64-encoded as \"image\"")
        is_json = content_type == JSON_TYPE
        body = bytes(await self._body(request, self.max_bytes * 4 // 3 + 1024 if is_json else self.max_bytes))
        k = self._k(request.query_params.get("k"))
        if is_json:
            body, k = self._from_json(body, k)
        if not body:
            raise HTTPException(400, "empty body; allowed: the bytes of a JPEG or PNG image")
        if len(body) > self.max_bytes:
            raise HTTPException(413, f"image of {len(body):,} bytes is over the limit of {self.max_bytes:,}")
        try:
            pixels = self.preprocessing.pixels(body)
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
        """The image and k of a JSON body (`ImageJSON`; LitServe's client sends ``input``)."""
        try:
            data = json.loads(body)
        except ValueError:
            raise HTTPException(400, "the body is not JSON; allowed: {\"image\": \"<base64 of a JPEG or "
                                     "PNG>\"}") from None
        encoded = data.get("image", data.get("input")) if isinstance(data, dict) else None
        if not isinstance(encoded, str):
            raise HTTPException(422, "the JSON has no \"image\" string; allowed: {\"image\": \"<base64 of a "
                                     "JPEG or PNG>\", \"k\": 3}")
        try:
            image = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise HTTPException(400, "\"image\" is not valid base64 (standard alphabet, padded)") from None
        if "k" in data:
            k = self._k(str(data["k"]))
        return image, k

    def _k(self, text: Optional[str]) -> int:
        if text is None:
            return self.default_k
        if not text.isdigit() or int(text) < 1:
            raise HTTPException(422, f"k='{text}' is not a positive integer")
        return int(text)


class ImageServer(ls.LitServer):
    """LitServer whose predict endpoint is served by `ImageRequestHandler`, documented in /openapi.json
    under the project's title and version, and counted for `GET /metrics`."""

    def __init__(self, api: ClassifierAPI, preprocessing: Preprocessing, max_bytes: int, default_k: int,
                 **kwargs: Any) -> None:
        self.preprocessing, self.max_bytes, self.default_k = preprocessing, max_bytes, default_k
        self.metrics = ServerMetrics(api.max_batch_size)
        super().__init__(api, **kwargs)
        # LitServe names its FastAPI app after FastAPI itself ("FastAPI 0.1.0" in /docs).
        self.app.title, self.app.version = TITLE, project_version()
        self.app.description = "Classifies an image with the exported model; POST /predict, GET /metrics."
        self.app.add_api_route(METRICS_PATH, self.metrics.exposition, methods=["GET"], include_in_schema=True,
                               summary="Prometheus metrics: requests by status, latency, batch sizes")

    # Replaces LitServer._register_api_endpoints (private in litserve 0.2.x, pinned <0.3 in pyproject): the
    # same route, our handler, the raw Request as its one parameter, its bodies and answer declared for
    # /openapi.json (FastAPI cannot see them in the raw Request).
    def _register_api_endpoints(self, lit_api: ls.LitAPI, request_type: Any, response_type: Any) -> None:
        handler = ImageRequestHandler(lit_api, self)
        metrics = self.metrics

        async def predict(request: Request) -> Any:
            started = time.perf_counter()
            try:
                answer = await handler.handle_request(request, Request)
            except HTTPException as ex:
                metrics.observe(ex.status_code, time.perf_counter() - started)
                raise
            except Exception:
                metrics.observe(500, time.perf_counter() - started)
                raise
            metrics.observe(200, time.perf_counter() - started, answer.get("batch") if isinstance(answer, dict)
                            else None)
            return answer

        self.app.add_api_route(lit_api.api_path, predict, methods=["POST"], response_model=Prediction,
                               response_model_by_alias=True, summary="Classify one image",
                               openapi_extra=_request_body_schema(self.max_bytes))



def serve(source: Path, port: int = 8000, host: str = "127.0.0.1", max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
          batch_timeout_ms: float = DEFAULT_BATCH_TIMEOUT_MS, top_k: int = 5, max_bytes: int = DEFAULT_MAX_BYTES,
          runtime: str = "auto", device: Optional[str] = None, log_level: str = "warning") -> None:
    _check_port(host, port)
    folder = export_folder(source)
    card, preprocessing = read_card(folder)
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    api = ClassifierAPI(folder, runtime_for(target, runtime), top_k, max_batch_size, batch_timeout_ms / 1000)
    server = ImageServer(api, preprocessing, max_bytes, top_k, accelerator=target.type, devices=1,
                         workers_per_device=1, timeout=30, model_metadata={"model": card.get("model"),
                                                                          "classes": len(card["classes"])})
    global _MAIN_PID
    _MAIN_PID = os.getpid()
    signal.signal(signal.SIGTERM, _interrupt)  # inherited by the processes LitServe forks: see _interrupt
    print(f"serving {folder} on http://{host}:{port}{API_PATH} (max batch {max_batch_size}, batch timeout "
          f"{batch_timeout_ms:g} ms, {api.runtime_kind} on {target}); /health is 200 once warmed up", flush=True)
    started = time.monotonic()
    try:
        server.run(host=host, port=port, num_api_servers=1, log_level=log_level, generate_client_file=False)
    except RuntimeError as ex:
        if "failed to start" not in str(ex):
            raise
        raise UserError(str(folder), "the inference worker could not load and warm up the model (its error is "
                        "above)", "an export folder written by export, with model.onnx or model.pt2") from None
    print(f"stopped after {time.monotonic() - started:.0f} s", flush=True)


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


