"""The simulator's HTTP surface: the subset of vLLM's OpenAI server the platform uses,
plus /sim/fault to inject faults (crash, hang, slow, error_rate) in tests and drills."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import random
import time
import uuid

from workers.engines.simulator.engine import EngineDead, EngineRequestError, SimulatedEngine

VERSION = "0.0.0+simulator"
MAX_BODY = 256 * 1024 * 1024
CRASH_EXIT_CODE = 1


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


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send(send, status: int, body: bytes, content_type: str = "application/json") -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _json(data) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def _error(message: str, status: int = 400, kind: str = "BadRequestError", param: str | None = None) -> bytes:
    return _json({"error": {"message": message, "type": kind, "param": param, "code": status}})


def _refusal(exc: ValueError) -> bytes:
    return _error(str(exc), param=getattr(exc, "parameter", None))


def _usage(completion, completion_tokens: int, *, streamed: bool, api: str = "vllm") -> dict:
    """vLLM 0.32's usage, keys in its order. A stream's usage chunk leaves out the fields
    that are null, as vLLM writes it without them. SGLang's (with --enable-cache-report):
    the image placeholders under `image_tokens`, beside the cached tokens."""
    images = completion.image_placeholder_tokens
    if api == "sglang":
        details = {"cached_tokens": completion.cached_tokens, **({"image_tokens": images} if images else {})}
        return {"prompt_tokens": completion.prompt_tokens,
                "total_tokens": completion.prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens, "prompt_tokens_details": details,
                "reasoning_tokens": 0}
    details = {"cached_tokens": completion.cached_tokens,
               "created_cache_tokens": completion.created_cache_tokens,
               "multimodal_tokens": {"image": images} if images else None}
    usage = {"prompt_tokens": completion.prompt_tokens,
             "total_tokens": completion.prompt_tokens + completion_tokens,
             "completion_tokens": completion_tokens,
             "prompt_tokens_details": details,
             "completion_tokens_details": None}
    if streamed:
        del usage["completion_tokens_details"]
        if images == 0:
            del details["multimodal_tokens"]
    return usage


class App:
    def __init__(self, engine: SimulatedEngine, api_key: str | None = None, api: str = "vllm"):
        self.engine = engine
        self.api_key = api_key
        self.api = api  # whose endpoints and metric names: vLLM's or SGLang's
        self.random = random.Random()

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
        if path == "/health":  # a hung loop still answers 200, as vLLM's does
            return await _send(send, 503 if self.engine.scheduler.dead else 200, b"", "text/plain")
        if path == "/metrics":
            return await _send(send, 200, self.engine.metrics.render(self.api).encode(),
                               "text/plain; version=0.0.4")
        if self.api == "sglang":
            if path in SGLANG_ROUTES:
                return await SGLANG_ROUTES[path](self, send)
        elif path == "/version":
            return await _send(send, 200, _json({"version": VERSION}))
        if path.startswith(("/v1/", "/sim/")) and self.api_key:
            headers = dict(scope["headers"])
            sent = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(sent, f"Bearer {self.api_key}"):
                return await _send(send, 401, _json({"error": "Unauthorized"}))
        if path == "/v1/models" and method == "GET":
            return await _send(send, 200, _json({"object": "list", "data": [{
                "id": self.engine.name, "object": "model", "created": int(time.time()),
                "owned_by": "sglang" if self.api == "sglang" else "vllm", "root": self.engine.name,
                "max_model_len": self.engine.max_model_len}]}))
        if path == "/v1/chat/completions" and method == "POST":
            return await self.chat(receive, send)
        if path == "/sim/fault" and method in ("GET", "POST"):
            return await self.fault(receive, send, method)
        return await _send(send, 404, _json({"detail": "Not Found"}))

    async def fault(self, receive, send, method):
        if method == "POST":
            try:
                body = json.loads(await _read_body(receive))
                if not isinstance(body, dict):
                    raise EngineRequestError("request body must be a JSON object")
                self.engine.set_fault(body.get("mode"), body.get("factor"), body.get("rate"))
            except ConnectionError:
                return
            except ValueError as exc:  # EngineRequestError included
                return await _send(send, 400, _refusal(exc))
        faults = self.engine.faults
        await _send(send, 200, _json({"mode": faults.mode, "factor": faults.factor,
                                      "rate": faults.rate}))
        if faults.mode == "crash":  # right after the answer has been written
            asyncio.get_running_loop().call_later(0.01, os._exit, CRASH_EXIT_CODE)

    async def chat(self, receive, send):
        try:
            body = json.loads(await _read_body(receive))
            if not isinstance(body, dict):
                raise EngineRequestError("request body must be a JSON object")
            if body.get("model") not in (None, self.engine.name):  # as vLLM answers a name it does not serve
                return await _send(send, 404, _error(f"The model `{body.get('model')}` does not exist.", 404,
                                                     "NotFoundError", "model"))
            prompt = self.engine.plan(body)
        except ConnectionError:
            return
        except ValueError as exc:  # EngineRequestError included
            return await _send(send, 400, _refusal(exc))
        faults = self.engine.faults
        if faults.mode == "error_rate" and self.random.random() < faults.rate:
            return await _send(send, 500, _error("simulated engine error (fault injection)", 500,
                                                 "InternalServerError"))
        # A client that goes away (stream or not) aborts its sequence and frees its KV.
        answer = asyncio.ensure_future(self.answer(body, prompt, send))
        gone = asyncio.ensure_future(_until_disconnect(receive))
        await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
        for task in (gone, answer):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def answer(self, body, prompt, send):
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        stream = bool(body.get("stream"))
        completion, produced = None, []
        if stream:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"),
                                    (b"cache-control", b"no-cache")]})
        try:
            async with contextlib.aclosing(self.engine.generate(body, prompt)) as generation:
                async for kind, payload in generation:
                    if kind == "first":
                        completion = payload
                        if stream:
                            await self._emit(send, self._chunk(request_id, created,
                                                               {"role": "assistant", "content": ""}))
                        continue
                    if stream:
                        delta = {"content": (" " if produced else "") + payload}
                        await self._emit(send, self._chunk(request_id, created, delta,
                                                           logprobs=self._logprobs(body, prompt, [payload])))
                    produced.append(payload)
        except EngineDead as exc:
            if not stream:
                return await _send(send, 500, _error(f"engine is dead: {exc}", 500,
                                                     "InternalServerError"))
            return await send({"type": "http.response.body", "body": b"", "more_body": False})
        if not stream:
            return await _send(send, 200, _json({
                "id": request_id, "object": "chat.completion", "created": created,
                "model": self.engine.name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": " ".join(produced)},
                             "logprobs": self._logprobs(body, prompt, produced),
                             "finish_reason": completion.finish_reason}],
                "usage": _usage(completion, len(produced), streamed=False, api=self.api),
            }))
        await self._emit(send, self._chunk(request_id, created, {}, completion.finish_reason))
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            await self._emit(send, {"id": request_id, "object": "chat.completion.chunk",
                                    "created": created, "model": self.engine.name, "choices": [],
                                    "usage": _usage(completion, len(produced), streamed=True, api=self.api)})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    def _chunk(self, request_id, created, delta, finish=None, logprobs=None):
        return {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.engine.name,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    def _logprobs(self, body, prompt, tokens) -> dict | None:
        """Each token's log-probability, as vLLM gives them when asked (`logprobs`)."""
        if not body.get("logprobs"):
            return None
        logprob = self.engine.token_logprob(prompt)
        return {"content": [{"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
                            for token in tokens]}

    @staticmethod
    async def _emit(send, data):
        await send({"type": "http.response.body", "body": b"data: " + _json(data) + b"\n\n",
                    "more_body": True})


async def _sglang_alive(app: App, send) -> None:
    # SGLang's /health_generate generates one token unless the server is busy, and /ready asks
    # its tokenizer manager: a dead scheduler can do neither.
    await _send(send, 503 if app.engine.scheduler.dead else 200, b"", "text/plain")


async def _sglang_model_info(app: App, send) -> None:
    engine = app.engine
    await _send(send, 200, _json({
        "model_path": engine.name, "served_model_name": engine.name, "tokenizer_path": engine.name,
        "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
        "has_image_understanding": bool(engine.images_per_prompt), "has_audio_understanding": False,
        "model_type": engine.family}))


# SGLang's native endpoints the simulator answers (sglang/srt/entrypoints/http_server.py; the
# tests check each against the installed package). /health and /metrics are shared.
SGLANG_ROUTES = {
    "/health_generate": _sglang_alive,
    "/ready": _sglang_alive,
    "/model_info": _sglang_model_info,
    "/get_model_info": _sglang_model_info,
}
