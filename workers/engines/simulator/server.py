"""The simulator's HTTP surface: the subset of vLLM's OpenAI server the platform uses."""

from __future__ import annotations

import hmac
import json
import time
import uuid

from workers.engines.simulator.engine import EngineRequestError, SimulatedEngine

VERSION = "0.0.0+simulator"
MAX_BODY = 256 * 1024 * 1024


async def _read_body(receive) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionError("client went away")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            raise EngineRequestError("request body too large")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def _send(send, status: int, body: bytes, content_type: str = "application/json") -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _json(data) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def _error(message: str, status: int = 400) -> bytes:
    return _json({"error": {"message": message, "type": "BadRequestError", "param": None,
                            "code": status}})


def _usage(completion, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": completion.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": completion.cached_image_tokens},
    }


class App:
    def __init__(self, engine: SimulatedEngine, api_key: str | None = None):
        self.engine = engine
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/health":
            return await _send(send, 200, b"", "text/plain")
        if path == "/version":
            return await _send(send, 200, _json({"version": VERSION}))
        if path == "/metrics":
            return await _send(send, 200, self.engine.metrics.render().encode(),
                               "text/plain; version=0.0.4")
        if path.startswith("/v1/") and self.api_key:
            headers = dict(scope["headers"])
            sent = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(sent, f"Bearer {self.api_key}"):
                return await _send(send, 401, _json({"error": "Unauthorized"}))
        if path == "/v1/models" and method == "GET":
            return await _send(send, 200, _json({"object": "list", "data": [{
                "id": self.engine.name, "object": "model", "created": int(time.time()),
                "owned_by": "vllm", "root": self.engine.name,
                "max_model_len": self.engine.max_model_len}]}))
        if path == "/v1/chat/completions" and method == "POST":
            return await self.chat(receive, send)
        return await _send(send, 404, _json({"detail": "Not Found"}))

    async def chat(self, receive, send):
        try:
            body = json.loads(await _read_body(receive))
            if not isinstance(body, dict):
                raise EngineRequestError("request body must be a JSON object")
            images, prompt_tokens, max_tokens = self.engine.plan(body)
        except ConnectionError:
            return
        except (ValueError, EngineRequestError) as exc:
            return await _send(send, 400, _error(str(exc)))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        generation = self.engine.generate(body, images, prompt_tokens, max_tokens)
        if not body.get("stream"):
            completion, produced = None, []
            async for kind, payload in generation:
                if kind == "first":
                    completion = payload
                else:
                    produced.append(payload)
            return await _send(send, 200, _json({
                "id": request_id, "object": "chat.completion", "created": created,
                "model": self.engine.name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": " ".join(produced)},
                             "logprobs": None, "finish_reason": completion.finish_reason}],
                "usage": _usage(completion, len(produced)),
            }))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})

        def chunk(delta, finish=None):
            return {"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.engine.name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        async def emit(data):
            await send({"type": "http.response.body", "body": b"data: " + _json(data) + b"\n\n",
                        "more_body": True})

        completion, produced = None, 0
        try:
            async for kind, payload in generation:
                if kind == "first":
                    completion = payload
                    await emit(chunk({"role": "assistant", "content": ""}))
                else:
                    await emit(chunk({"content": (" " if produced else "") + payload}))
                    produced += 1
            await emit(chunk({}, completion.finish_reason))
            if include_usage:
                await emit({"id": request_id, "object": "chat.completion.chunk", "created": created,
                            "model": self.engine.name, "choices": [],
                            "usage": _usage(completion, produced)})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        except OSError:  # the client disconnected mid-stream
            await generation.aclose()
