"""An OpenAI-compatible upstream that answers instantly, for measuring what a proxy adds.

    python -m bench.fake_upstream PORT

/v1/chat/completions answers at once (stream or not) with a fixed reply and a usage block;
/health and /metrics answer as vLLM's do; /stats reports the request bodies it received
(count and bytes), so a benchmark can compare what a proxy forwards with what it was sent.
"""

from __future__ import annotations

import json
import sys

import uvicorn

_stats = {"requests": 0, "body_bytes": 0, "last_body_bytes": 0}
_REPLY = {
    "id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": "fake",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13,
              "prompt_tokens_details": {"cached_tokens": 0}},
}


async def _body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _send(send, status: int, body: bytes, kind: bytes = b"application/json") -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", kind), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path == "/health":
        return await _send(send, 200, b"", b"text/plain")
    if path == "/metrics":
        return await _send(send, 200, b"vllm:num_requests_running{engine=\"0\"} 0\n", b"text/plain")
    if path == "/stats":
        return await _send(send, 200, json.dumps(_stats).encode())
    if path == "/v1/chat/completions":
        raw = await _body(receive)
        _stats["requests"] += 1
        _stats["body_bytes"] += len(raw)
        _stats["last_body_bytes"] = len(raw)
        request = json.loads(raw)
        reply = {**_REPLY, "model": request.get("model", "fake")}
        if not request.get("stream"):
            return await _send(send, 200, json.dumps(reply).encode())
        chunk = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": reply["model"],
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}
        usage = {**chunk, "choices": [], "usage": _REPLY["usage"]}
        body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in (chunk, usage)) + b"data: [DONE]\n\n"
        return await _send(send, 200, body, b"text/event-stream")
    return await _send(send, 404, b'{"detail": "Not Found"}')


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
