"""An OpenAI-compatible upstream that answers instantly, for measuring what a proxy adds.

    python -m bench.fake_upstream PORT

/v1/chat/completions answers at once (stream or not) with a fixed reply and a usage block;
/health and /metrics answer as vLLM's do; /stats reports the request bodies it received
(count and bytes), so a benchmark can compare what a proxy forwards with what it was sent.
Served by bench/wire.py on uvloop: tens of microseconds of CPU a request, so that the proxy
in front of it is what a benchmark measures.
"""

from __future__ import annotations

import json
import re
import sys

from bench.wire import serve

_stats = {"requests": 0, "body_bytes": 0, "last_body_bytes": 0}
_REPLY = {
    "id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": "fake",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13,
              "prompt_tokens_details": {"cached_tokens": 0}},
}


_EDGE = 16_384  # bytes at each end of a large body where its model and stream are looked for
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]*)"')
_STREAM = re.compile(rb'"stream"\s*:\s*(true|false)')


def fields(raw: bytes) -> tuple[str, bool]:
    """The request's model, and whether it streams. A large body is not parsed: its images
    are in `messages`, and both fields outside it, at its head or its tail, as every client
    of the benchmarks and every proxy measured write them. So the answer takes the same time
    whatever the images weigh: parsing a 12 MP photo's 3 MB body takes 2 ms, which a request
    sent directly would pay and one through a proxy that shrinks the photo would not, and
    that proxy's added time would seem 2 ms less than it is."""
    if len(raw) > 2 * _EDGE:
        edges = raw[:_EDGE] + b"\n" + raw[-_EDGE:]
        model, stream = _MODEL.search(edges), _STREAM.search(edges)
        if model is not None:
            return model.group(1).decode(), stream is not None and stream.group(1) == b"true"
    request = json.loads(raw)
    return request.get("model", "fake"), bool(request.get("stream"))


async def answer(method: str, path: str, raw: bytes) -> tuple[int, bytes, bytes]:
    if path == "/health":
        return 200, b"text/plain", b""
    if path == "/metrics":
        return 200, b"text/plain", b"vllm:num_requests_running{engine=\"0\"} 0\n"
    if path == "/stats":
        return 200, b"application/json", json.dumps(_stats).encode()
    if path == "/v1/chat/completions":
        _stats["requests"] += 1
        _stats["body_bytes"] += len(raw)
        _stats["last_body_bytes"] = len(raw)
        model, stream = fields(raw)
        reply = {**_REPLY, "model": model}
        if not stream:
            return 200, b"application/json", json.dumps(reply).encode()
        chunk = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": reply["model"],
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}
        usage = {**chunk, "choices": [], "usage": _REPLY["usage"]}
        body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in (chunk, usage)) + b"data: [DONE]\n\n"
        return 200, b"text/event-stream", body
    return 404, b"application/json", b'{"detail": "Not Found"}'


async def main(port: int) -> None:
    server = await serve("127.0.0.1", port, answer)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    import uvloop

    uvloop.run(main(int(sys.argv[1])))
