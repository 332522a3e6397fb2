"""``deploy serve`` of a language model: ``POST /generate`` (the whole answer as one JSON) and ``POST
/generate/stream`` (newline-delimited JSON: a line per piece of text as it is generated, then the
same answer as the last line), so that a client can measure the time to its first token itself.

The network is rebuilt in the inference worker from the card's constructor and weights.safetensors
(the exported graphs have no KV cache) and generates with `trainer.models.gpt.KVCache`: a new token
costs one position. One request is generated at a time per worker (LitServe's streaming loop; no
batching of generations), which ``/info`` and docs/deploy.md say. The prompt is tokenized and every
field checked in the HTTP process before anything is queued."""

from __future__ import annotations

import asyncio
import importlib
import json
import time
from collections import deque
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Optional

import litserve as ls
import torch
from fastapi import HTTPException, Request
from fastapi.responses import StreamingResponse
from litserve.server import BaseRequestHandler
from litserve.utils import LitAPIStatus, ResponseBufferItem
from pydantic import BaseModel, Field

from trainer.deploy.serve import JSON_TYPE, ModelServer, _check_port, refusals, run_server
from trainer.deploy.serve_text import TEXT_TITLE, check_text_export, positive_int, read_json
from trainer.infra.errors import UserError

GENERATE_PATH = "/generate"
STREAM_PATH = "/generate/stream"
NDJSON_TYPE = "application/x-ndjson"
DEFAULTS: dict[str, Any] = {"max_tokens": 64, "temperature": 0.8, "top_k": 50, "seed": 0}


class GenerateJSON(BaseModel):
    """The body of /generate and /generate/stream."""

    prompt: str = Field(description="the text to continue (not empty; at most the model's context in tokens)")
    max_tokens: int = Field(DEFAULTS["max_tokens"], ge=1, description="tokens to add at most (the server's "
                                                                     "--max-new-tokens bounds it, and the default)")
    temperature: float = Field(DEFAULTS["temperature"], ge=0, description="divides the logits; 0: the most "
                                                                          "likely token every step (greedy)")
    top_k: Optional[int] = Field(DEFAULTS["top_k"], ge=1, description="sample among the k most likely (null: all)")
    seed: int = Field(DEFAULTS["seed"], description="seed of the sampling: the same request, the same text")


class Generation(BaseModel):
    """The answer of /generate (and the last line of /generate/stream)."""

    text: str = Field(description="the generated text (the prompt not repeated; the end-of-text token left out)")
    tokens: int = Field(description="tokens generated (the end-of-text token not counted)")
    prompt_tokens: int = Field(description="the prompt's tokens")
    finish_reason: str = Field(description="stop: the model wrote its end-of-text token; length: max_tokens reached")
    ttft_ms: Optional[float] = Field(description="server side: from the request's arrival to its first token")
    tpot_ms: Optional[float] = Field(description="server side: mean time per token after the first")


GENERATE_ERRORS = refusals({
    400: "the body is not JSON, or not a JSON object",
    413: "the body over --max-bytes, the prompt longer than the model's context, or max_tokens over "
         "--max-new-tokens",
    415: "a Content-Type other than application/json",
    422: "no prompt string or an empty one; max_tokens, top_k not positive integers; temperature negative; seed "
         "not an integer",
})


# -- the inference worker -------------------------------------------------------------------------------
def cached_tokens(net: Any, ids: torch.Tensor, max_new_tokens: int, temperature: float, top_k: Optional[int],
                  generator: torch.Generator) -> Iterator[int]:
    """The tokens `trainer.models.gpt.generate` would add to `ids` ``[1, t]`` (its KV cache path, the
    same window rule: once the cache holds `max_positions`, the last window runs again), one at a time
    as each is sampled, so that the server can send each as soon as it exists. Temperature 0: greedy."""
    from trainer.models.gpt import KVCache, next_token

    kv = KVCache(net, ids.shape[0])
    context = ids
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            if kv.length == 0 or kv.length == kv.capacity:
                kv.length = 0
                logits = net(context[:, -net.max_positions:], kv)[:, -1, :]
            else:
                logits = net(context[:, -1:], kv)[:, -1, :]
            token = next_token(logits.float(), temperature or 1.0, top_k, temperature == 0, generator)
            yield int(token)
            context = torch.cat((context, token), dim=1)


def rebuild_network(folder: Path, card: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """The card's network (`network`: class and arguments) with weights.safetensors, in eval mode; the
    tied output head's weight, stored once, is tied again by the constructor."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    module, _, name = card["network"]["class"].rpartition(".")
    net = getattr(importlib.import_module(module), name)(**card["network"]["arguments"])
    path = folder / card.get("files", {}).get("weights", "weights.safetensors")
    with safe_open(str(path), framework="pt") as f:
        tied = set(json.loads((f.metadata() or {}).get("tied", "{}")))
    missing, unexpected = net.load_state_dict(load_file(str(path)), strict=False)
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"{path} does not fit {card['network']['class']}: missing {missing}, unexpected {unexpected}")
    return net.to(device).eval()


class GeneratorAPI(ls.LitAPI):
    """Runs in LitServe's inference worker: a checked, tokenized request in, lines of NDJSON out (a
    line per new piece of text, then `Generation`)."""

    def __init__(self, folder: Path, card: dict[str, Any]) -> None:
        super().__init__(max_batch_size=1, stream=True, api_path=GENERATE_PATH)
        self.folder, self.card = Path(folder), card
        self.stop_id = card["text"].get("end_of_text_id")

    def setup(self, device: str) -> None:
        from tokenizers import Tokenizer

        self.device = torch.device(device)
        self.net = rebuild_network(self.folder, self.card, self.device)
        self.tokenizer = Tokenizer.from_file(str(self.folder / self.card["text"]["tokenizer"]))
        warm = {"ids": [0], "max_tokens": 2, "temperature": 1.0, "top_k": None, "seed": 0, "arrived": time.time()}
        for _ in self.predict(warm):  # the first forward's one-off costs, before /health says ready
            pass

    def encode_response(self, outputs: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        yield from outputs  # LitServe's streaming loop wants a generator here too; its lines are JSON already

    def predict(self, x: dict[str, Any]) -> Iterator[dict[str, Any]]:
        generator = torch.Generator(device=self.device).manual_seed(x["seed"])
        ids = torch.tensor([x["ids"]], dtype=torch.long, device=self.device)
        produced: list[int] = []
        text, finish, first_at, last_at = "", "length", None, None
        for token in cached_tokens(self.net, ids, x["max_tokens"], x["temperature"], x["top_k"], generator):
            last_at = time.time()
            first_at = first_at or last_at
            if token == self.stop_id:
                finish = "stop"
                break
            produced.append(token)
            decoded = self.tokenizer.decode(produced)
            if not decoded.endswith("\ufffd"):  # a character's bytes not all generated yet: wait for them
                yield {"token": decoded[len(text):], "tokens": len(produced)}
                text = decoded
        text = self.tokenizer.decode(produced)
        steps = len(produced) + (finish == "stop") - 1
        yield {"text": text, "tokens": len(produced), "prompt_tokens": len(x["ids"]), "finish_reason": finish,
               "ttft_ms": None if first_at is None else round((first_at - x["arrived"]) * 1000, 3),
               "tpot_ms": round((last_at - first_at) * 1000 / steps, 3) if steps > 0 and first_at and last_at else None}


# -- the HTTP side ---------------------------------------------------------------------------------------
class GenerateRequestHandler(BaseRequestHandler):
    """Checks and tokenizes a request (`GenerateJSON`), then answers it whole or as a stream."""

    server: "GeneratorServer"

    async def _prepare_request(self, request: Request, request_type: Any) -> dict[str, Any]:
        arrived, server = time.time(), self.server
        data = await read_json(request, server.max_bytes, '{"prompt": "def main(", "max_tokens": 32}')
        prompt = data.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise HTTPException(422, 'the JSON has no "prompt" or it is empty; allowed: {"prompt": "def main(", '
                                     '"max_tokens": 32}')
        # a request that names no max_tokens gets the default, within this server's limit
        fields = {**DEFAULTS, "max_tokens": min(DEFAULTS["max_tokens"], server.max_new_tokens),
                  **{key: data[key] for key in DEFAULTS if key in data}}
        max_tokens = positive_int(fields["max_tokens"], "max_tokens")
        if max_tokens > server.max_new_tokens:
            raise HTTPException(413, f"max_tokens={max_tokens} is over the limit of {server.max_new_tokens} "
                                     "(--max-new-tokens)")
        temperature = fields["temperature"]
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise HTTPException(422, f"temperature={json.dumps(temperature)} is not a number of 0 or more "
                                     "(0: the most likely token every step)")
        top_k = None if fields["top_k"] is None else positive_int(fields["top_k"], "top_k")
        if isinstance(fields["seed"], bool) or not isinstance(fields["seed"], int):
            raise HTTPException(422, f"seed={json.dumps(fields['seed'])} is not an integer")
        ids = server.tokenizer.encode(prompt).ids
        if not ids:
            raise HTTPException(422, "the prompt encodes to no tokens; allowed: text the tokenizer keeps")
        if len(ids) > server.context:
            raise HTTPException(413, f"prompt of {len(ids):,} tokens is longer than the model's context of "
                                     f"{server.context} tokens; send a shorter prompt")
        return {"ids": ids, "max_tokens": max_tokens, "temperature": float(temperature), "top_k": top_k,
                "seed": fields["seed"], "arrived": arrived}

    async def handle_request(self, request: Request, request_type: Any) -> Any:
        return await self.answer(request, stream=False)

    async def answer(self, request: Request, stream: bool) -> Any:
        """The request queued; its lines streamed as NDJSON, or the last (the whole answer) as JSON."""
        payload = await self._prepare_request(request, Request)
        uid, _ = await self._submit_request(payload)
        event, lines = asyncio.Event(), deque[Any]()
        self.server.response_buffer[uid] = ResponseBufferItem(event=event, response_queue=lines)
        items = self.server.data_streamer(lines, data_available=event, send_status=True)
        if stream:
            return StreamingResponse(self._stream(uid, items), media_type=NDJSON_TYPE)
        last = None
        try:
            async for data, status in items:
                if status == LitAPIStatus.ERROR:
                    raise HTTPException(500, "generation failed in the inference worker (its log says why)")
                last = data
        finally:
            self.server.response_buffer.pop(uid, None)
        if last is None:
            raise HTTPException(500, "the inference worker gave no answer")
        return json.loads(last)

    async def _stream(self, uid: str, items: Any) -> Any:
        try:
            async for data, status in items:
                if status == LitAPIStatus.ERROR:
                    yield json.dumps({"error": "generation failed in the inference worker"}) + "\n"
                    return
                yield data
        finally:
            self.server.response_buffer.pop(uid, None)


class GeneratorServer(ModelServer):
    """A language model's server: POST /generate and /generate/stream with `GenerateJSON`."""

    def __init__(self, api: GeneratorAPI, folder: Path, card: dict[str, Any], max_bytes: int, max_new_tokens: int,
                 **kwargs: Any) -> None:
        from tokenizers import Tokenizer

        self.max_bytes, self.max_new_tokens = max_bytes, max_new_tokens
        self.context = int(card["text"]["context"])
        self.tokenizer = Tokenizer.from_file(str(folder / card["text"]["tokenizer"]))
        self.limits = {"max_payload_size": max_bytes, "max_body_bytes": max_bytes, "max_new_tokens": max_new_tokens,
                       "context": self.context, "prompt": f"at most {self.context} tokens (the model's context)",
                       "concurrency": "one generation at a time per inference worker (1 worker): requests wait "
                                      "in the queue; no batching of generations", "max_batch_size": 1,
                       "kv_cache": True, "stream": f"{STREAM_PATH}: newline-delimited JSON ({NDJSON_TYPE})",
                       "defaults": DEFAULTS}
        super().__init__(api, TEXT_TITLE, "Continues a prompt with the exported language model; POST /generate, "
                                          f"POST {STREAM_PATH}, GET /metrics, GET /info.", **kwargs)

    def _register_api_endpoints(self, lit_api: ls.LitAPI, request_type: Any, response_type: Any) -> None:
        handler = GenerateRequestHandler(lit_api, self)
        body = {"requestBody": {"required": True, "content": {JSON_TYPE: {"schema": GenerateJSON.model_json_schema()}}}}
        self.observed_route(GENERATE_PATH, partial(handler.answer, stream=False), response_model=Generation,
                            summary="Continue a prompt", responses=GENERATE_ERRORS, openapi_extra=body)
        streamed = {200: {"description": "one JSON object a line: {\"token\": piece, \"tokens\": n} per piece of "
                                         "text, then the Generation", "content": {NDJSON_TYPE: {}}}}
        self.observed_route(STREAM_PATH, partial(handler.answer, stream=True), summary="Continue a prompt, streamed",
                            responses={**streamed, **GENERATE_ERRORS}, openapi_extra=body)


def serve_generator(folder: Path, card: dict[str, Any], target: torch.device, port: int, host: str, max_bytes: int,
                    max_new_tokens: int, log_level: str = "warning") -> None:
    """Serve a language model's export (the command picks it by the card's task)."""
    _check_port(host, port)
    check_text_export(folder, card)
    if not card.get("network") or not card.get("text", {}).get("context"):
        raise UserError(str(folder / "model.json"), "states no network constructor or context (an export of an "
                        "earlier version)", "export the run again with this version")
    api = GeneratorAPI(folder, card)
    server = GeneratorServer(api, folder, card, max_bytes, max_new_tokens, accelerator=target.type, timeout=120,
                             model_metadata={"model": card.get("model"), "task": "language_model",
                                             "vocab_size": card.get("vocab_size")})
    run_server(server, folder, host, port, log_level, f"serving {folder} on http://{host}:{port}{GENERATE_PATH} "
               f"and {STREAM_PATH} (prompts up to {server.context} tokens, up to {max_new_tokens} new tokens, one "
               f"generation at a time, KV cache, on {target}); /health is 200 once warmed up")
