"""``deploy serve`` of a text model: an encoder's ``POST /predict`` (JSON text in, classes out) and a
language model's ``POST /generate`` and ``POST /generate/stream`` (serve_generate.py), picked by
the export card's task; ``/info``, ``/metrics`` and ``/openapi.json`` as for images.

The text is tokenized in the HTTP process, by the request handler, before anything is queued: a bad
request fails alone (in LitServe's batched loop one failing ``decode_request`` fails its batch), and
its length is known when the inference worker forms batches. The worker groups waiting requests by
length (`LengthBinnedLoop`): a text of n tokens is padded to at most ``max(8, 2 n)`` tokens (the bound
in docs/deploy.md), however long the other texts waiting with it are."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from queue import Empty
from typing import Any, Optional

import litserve as ls
import numpy as np
import torch
from fastapi import HTTPException, Request
from litserve.loops.base import _SENTINEL_VALUE, _StopLoopError
from litserve.server import RegularRequestHandler
from pydantic import BaseModel, Field

from trainer.deploy import DEFAULT_MAX_CHARS
from trainer.deploy.serve import (API_PATH, ERROR_RESPONSES, JSON_TYPE, ImageRequestHandler, ModelServer, Runtime,
                                  WaitingBatchLoop, _check_port, refusals, run_server, runtime_for)
from trainer.infra.errors import UserError

#: The /openapi.json title of a text model's server (an encoder's, serve_generate.py's).
TEXT_TITLE = "gpu-practice-trainer text model"
#: Batches are padded to a multiple of this (as training's batches: trainer/data/labelled_text.py).
PAD_MULTIPLE = 8
#: Above this probability a label of a multi-label model is answered as present.
MULTI_LABEL_THRESHOLD = 0.5


# -- the API's documented shapes (/openapi.json) -----------------------------------------------------------
class TextJSON(BaseModel):
    """The body of an encoder's /predict."""

    text: str = Field(description="the text to classify (not empty; at most the server's max_chars characters)")
    k: Optional[int] = Field(None, ge=1, description="how many classes to answer (default: the server's --top-k)")


class RankedLabel(BaseModel):
    class_name: str = Field(alias="class", description="the class's name, as in the training data")
    index: int = Field(description="the class's index in the model's output")
    probability: float = Field(description="softmax (one label) or sigmoid (multi-label) probability, 6 digits")


class TextPrediction(BaseModel):
    """The answer of an encoder's /predict."""

    top_k: Optional[list[RankedLabel]] = Field(None, description="one label a text: the k most probable classes")
    labels: Optional[list[str]] = Field(None, description="multi-label: the labels whose probability is over 0.5")
    probabilities: Optional[list[RankedLabel]] = Field(None, description="multi-label: every label, most probable first")
    batch: int = Field(description="the size of the batch this request was served in")
    length: int = Field(description="the length the batch was padded to, in tokens")
    tokens: int = Field(description="the text's tokens the model read, [CLS] and [SEP] included")
    text_tokens: int = Field(description="the tokens of the whole text, before any truncation")
    truncated: bool = Field(description="whether the text was cut to the model's max_length")


TEXT_ERRORS = {**refusals({
    400: "the body is not JSON, or not a JSON object",
    413: "the body over --max-bytes, or the text over --max-chars characters",
    415: "a Content-Type other than application/json",
    422: "no \"text\" string, an empty text, or k not a positive integer",
}), 504: ERROR_RESPONSES[504]}


def length_bin(tokens: int, max_length: int) -> int:
    """The padded length a batch of texts of `tokens` tokens may reach: the power of two at or above
    the tokens rounded up to `PAD_MULTIPLE` (at least 8), at most `max_length`. Texts are batched only
    with texts of their own bin, so that none is padded to more than ``max(8, 2 x tokens)``."""
    rounded = -(-tokens // PAD_MULTIPLE) * PAD_MULTIPLE
    return min(max_length, max(PAD_MULTIPLE, 1 << (rounded - 1).bit_length()))


def padded_width(longest: int, max_length: int) -> int:
    """A batch's length: its longest text rounded up to `PAD_MULTIPLE`, at most `max_length` (training's
    rule, trainer/data/labelled_text.py: not imported, as that brings Lightning into the worker)."""
    return max(longest, min(-(-longest // PAD_MULTIPLE) * PAD_MULTIPLE, max_length))


# -- the inference worker -------------------------------------------------------------------------------
class LengthBinnedLoop(WaitingBatchLoop):
    """`WaitingBatchLoop`, answering the oldest waiting request first with the requests of its length
    bin (`length_bin`, computed by the handler): the others wait for a later batch, held here in
    arrival order and topped up from the queue without waiting. At most ``max_batch_size`` requests
    are held at once, so a request waits behind at most that many batches."""

    def __init__(self) -> None:
        super().__init__()
        self._held: list[tuple[Any, Any, Any]] = []

    def get_batch_requests(self, lit_api: ls.LitAPI, request_queue: Any, transport: Any) -> tuple[list, list]:
        timed_out: list[tuple[Any, Any]] = []
        if not self._held:
            self._held, timed_out = super().get_batch_requests(lit_api, request_queue, transport)
        else:  # requests are waiting already: take what else queued, without waiting
            while len(self._held) < lit_api.max_batch_size:
                try:
                    item = request_queue.get_nowait()
                except Empty:
                    break
                if item == _SENTINEL_VALUE:
                    raise _StopLoopError()
                response_queue_id, uid, _, payload = item
                self._held.append((response_queue_id, uid, payload))
        if not self._held:
            return [], timed_out
        wanted = self._held[0][2]["bin"]
        batch = [item for item in self._held if item[2]["bin"] == wanted][:lit_api.max_batch_size]
        taken = {id(item) for item in batch}
        self._held = [item for item in self._held if id(item) not in taken]
        return batch, timed_out


class EncoderAPI(ls.LitAPI):
    """Runs in LitServe's inference worker: requests arrive tokenized (`TextRequestHandler`); a batch is
    padded to its longest, run by ONNX Runtime or the torch.export program, and answered per text."""

    def __init__(self, folder: Path, card: dict[str, Any], runtime: str, max_batch_size: int,
                 batch_timeout: float) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout, api_path=API_PATH,
                         loop=LengthBinnedLoop() if max_batch_size > 1 else "auto")
        self.folder, self.runtime_kind = Path(folder), runtime
        self.classes, self.multi_label = [str(c) for c in card["classes"]], bool(card.get("multi_label"))
        self.pad_id, self.max_length = int(card["text"]["pad_id"]), int(card["text"]["max_length"])

    def setup(self, device: str) -> None:
        self.model = Runtime(self.folder, self.runtime_kind, torch.device(device))
        if self.model.kind == "onnxruntime":
            torch.set_num_threads(1)  # as ClassifierAPI: PyTorch only pads and takes the softmax here
        widths = sorted({length_bin(n, self.max_length) for n in range(1, self.max_length + 1)})
        for width in widths:  # each bin's widest shape, alone and full, before /health says ready
            for batch in sorted({1, self.max_batch_size}):
                self.model.logits(torch.ones((batch, width), dtype=torch.int64))

    def predict(self, x: Any) -> Any:
        requests = x if isinstance(x, list) else [x]  # unbatched: one request, not a list
        width = padded_width(max(len(r["ids"]) for r in requests), self.max_length)
        ids = np.full((len(requests), width), self.pad_id, dtype=np.int64)
        for row, request in enumerate(requests):
            ids[row, :len(request["ids"])] = request["ids"]
        logits = self.model.logits(torch.from_numpy(ids)).cpu()
        probabilities = torch.sigmoid(logits) if self.multi_label else torch.softmax(logits, dim=1)
        answers = [self._answer(p, r, len(requests), width) for p, r in zip(probabilities, requests)]
        return answers if isinstance(x, list) else answers[0]

    def _answer(self, probabilities: torch.Tensor, request: dict[str, Any], batch: int, width: int) -> dict[str, Any]:
        counts = {"batch": batch, "length": width, "tokens": len(request["ids"]),
                  "text_tokens": request["text_tokens"], "truncated": request["truncated"]}
        k = len(self.classes) if self.multi_label else min(request["k"], len(self.classes))
        values, indices = probabilities.topk(k)
        ranked = [{"class": self.classes[i], "index": i, "probability": round(v, 6)}
                  for v, i in zip(values.tolist(), indices.tolist())]
        if self.multi_label:
            return {"labels": [r["class"] for r in ranked if r["probability"] > MULTI_LABEL_THRESHOLD],
                    "probabilities": ranked, **counts}
        return {"top_k": ranked, **counts}


# -- the HTTP side ---------------------------------------------------------------------------------------
class TextTokenizer:
    """The export's tokenizer.json, encoding as training did (``[CLS] tokens [SEP]``, cut to
    `max_length`), and saying how many tokens the whole text had. The file's own truncation is turned
    off and the cut made here (the same ids: the tokens cut to ``max_length - 2``, then [SEP]), because
    the tokenizer's truncation does not say how many tokens it dropped."""

    def __init__(self, path: Path, max_length: int, sep_id: int) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(path))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.max_length, self.sep_id = max_length, sep_id

    def __call__(self, text: str) -> tuple[list[int], int, bool]:
        """(the ids the model reads, the whole text's tokens with [CLS] and [SEP], whether it was cut)."""
        ids = self.tokenizer.encode(text).ids
        if len(ids) <= self.max_length:
            return ids, len(ids), False
        return [*ids[:self.max_length - 1], self.sep_id], len(ids), True


class TextRequestHandler(RegularRequestHandler):
    """Reads ``{"text": ..., "k": ...}``, checks it and tokenizes it, one 4xx line per refusal."""

    server: "EncoderServer"

    async def _prepare_request(self, request: Request, request_type: Any) -> dict[str, Any]:
        server = self.server
        data = await read_json(request, server.max_bytes, '{"text": "a text to classify", "k": 3}')
        text = data.get("text", data.get("input"))  # "input": what LitServe's generated client sends
        if not isinstance(text, str):
            raise HTTPException(422, 'the JSON has no "text" string; allowed: {"text": "a text to classify", "k": 3}')
        if not text.strip():
            raise HTTPException(422, "the text is empty; allowed: a text with at least one non-space character")
        if len(text) > server.max_chars:
            raise HTTPException(413, f"text of {len(text):,} characters is over the limit of {server.max_chars:,} "
                                     "(--max-chars)")
        k = positive_int(data.get("k", server.default_k), "k")
        ids, text_tokens, truncated = server.tokenize(text)
        return {"ids": ids, "k": k, "text_tokens": text_tokens, "truncated": truncated,
                "bin": length_bin(len(ids), server.max_length)}


async def read_json(request: Request, max_bytes: int, example: str) -> dict[str, Any]:
    """The request's JSON object; 415 for another Content-Type, 413 over `max_bytes`, 400 when not JSON
    or not an object."""
    content_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if content_type != JSON_TYPE:
        raise HTTPException(415, f"Content-Type '{content_type or 'none'}' is not {JSON_TYPE}; allowed: "
                                 f"{JSON_TYPE} with a body such as {example}")
    body = bytes(await ImageRequestHandler._body(request, max_bytes))
    try:
        data = json.loads(body)
    except ValueError:
        raise HTTPException(400, f"the body is not JSON; allowed: {example}") from None
    if not isinstance(data, dict):
        raise HTTPException(400, f"the JSON is a {type(data).__name__}, not an object; allowed: {example}")
    return data


def positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HTTPException(422, f"{name}={json.dumps(value)} is not a positive integer")
    return value


class EncoderServer(ModelServer):
    """An encoder's server: POST /predict with `TextJSON`, answered with `TextPrediction`."""

    def __init__(self, api: EncoderAPI, folder: Path, card: dict[str, Any], max_bytes: int, max_chars: int,
                 default_k: int, **kwargs: Any) -> None:
        self.max_bytes, self.max_chars, self.default_k = max_bytes, max_chars, default_k
        self.max_length = int(card["text"]["max_length"])
        self.tokenize = TextTokenizer(folder / card["text"]["tokenizer"], self.max_length, int(card["text"]["sep_id"]))
        self.limits = {"max_payload_size": max_bytes, "max_body_bytes": max_bytes, "max_chars": max_chars,
                       "max_length": self.max_length,
                       "truncation": f"a text over max_length tokens is cut to its first {self.max_length - 2} "
                                     "and [SEP]; the answer says so (truncated, text_tokens)",
                       "top_k": default_k, "runtime": api.runtime_kind, "max_batch_size": api.max_batch_size,
                       "batch_timeout_ms": api.batch_timeout * 1000,
                       "batching": "by length: a text of n tokens is padded to at most max(8, 2n) tokens"}
        super().__init__(api, TEXT_TITLE, "Classifies a text with the exported encoder; POST /predict, GET /metrics, "
                                          "GET /info.", **kwargs)

    def _register_api_endpoints(self, lit_api: ls.LitAPI, request_type: Any, response_type: Any) -> None:
        handler = TextRequestHandler(lit_api, self)
        body = {"requestBody": {"required": True, "content": {JSON_TYPE: {"schema": {
            **TextJSON.model_json_schema(), "properties": {
                "text": {"type": "string", "minLength": 1, "maxLength": self.max_chars,
                         "description": f"the text (at most {self.max_chars:,} characters; cut to "
                                        f"{self.max_length} tokens)"},
                "k": {"type": "integer", "minimum": 1}}}}}}}
        self.observed_route(lit_api.api_path, partial(handler.handle_request, request_type=Request),
                            response_model=TextPrediction, response_model_by_alias=True,
                            response_model_exclude_none=True, summary="Classify one text", responses=TEXT_ERRORS,
                            openapi_extra=body)


# -- the command -----------------------------------------------------------------------------------------
def check_text_export(folder: Path, card: dict[str, Any]) -> None:
    """A text model's export must hold its tokenizer (an earlier version's card named the run's)."""
    tokenizer = folder / card.get("text", {}).get("tokenizer", "tokenizer.json")
    if not tokenizer.is_file():
        raise UserError(str(folder), f"has no {tokenizer.name} (an export of an earlier version: the card named "
                        "the run's)", "export the run again: the tokenizer is then copied into the export")


def serve_encoder(folder: Path, card: dict[str, Any], target: torch.device, port: int, host: str,
                  max_batch_size: int, batch_timeout_ms: float, top_k: int, max_bytes: int, runtime: str,
                  log_level: str = "warning", max_chars: int = DEFAULT_MAX_CHARS) -> None:
    """Serve an encoder's export (the command picks it by the card's task)."""
    _check_port(host, port)
    check_text_export(folder, card)
    task = card["task"]
    api = EncoderAPI(folder, card, runtime_for(target, runtime), max_batch_size, batch_timeout_ms / 1000)
    server = EncoderServer(api, folder, card, max_bytes, max_chars, top_k, accelerator=target.type, timeout=30,
                           model_metadata={"model": card.get("model"), "task": task, "classes": len(card["classes"]),
                                           "multi_label": bool(card.get("multi_label"))})
    run_server(server, folder, host, port, log_level, f"serving {folder} on http://{host}:{port}{API_PATH} (texts "
               f"up to {max_chars:,} characters, cut to {server.max_length} tokens; max batch {max_batch_size} "
               f"grouped by length, batch timeout {batch_timeout_ms:g} ms, {api.runtime_kind} on {target}); "
               "/health is 200 once warmed up")
