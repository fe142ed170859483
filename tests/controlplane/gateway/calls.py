"""Calls to the gateway as tenants make them, for the gateway's tests."""

from __future__ import annotations

import asyncio
import json

from asgiref.sync import async_to_sync
from django.test import AsyncClient

from controlplane.gateway.asgi import app


def post(client, key, body, **headers):
    return client.post("/v1/chat/completions", data=json.dumps(body) if not isinstance(body, bytes) else body,
                       content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}", **headers)


def image_message(url, detail=None):
    image = {"url": url} if detail is None else {"url": url, "detail": detail}
    return [{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                         {"type": "image_url", "image_url": image}]}]


@async_to_sync
async def post_and_read_stream(key, body):
    """Request and read a stream in one event loop, as the ASGI server does."""
    response = await AsyncClient().post("/v1/chat/completions", data=json.dumps(body),
                                        content_type="application/json",
                                        headers={"Authorization": f"Bearer {key}"})
    return response, b"".join([chunk async for chunk in response.streaming_content])


def error_of(response):
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def front_call(headers: dict, chunks: list[bytes], *, stall: bool = False) -> tuple[dict, int]:
    """One request through the ASGI front. Returns the response and how many body chunks it read."""
    read, sent = [0], []

    async def receive():
        if read[0] >= len(chunks):
            await asyncio.sleep(3600)  # a client that never sends the rest (nor leaves)
        read[0] += 1
        return {"type": "http.request", "body": chunks[read[0] - 1], "more_body": read[0] < len(chunks) or stall}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    async_to_sync(app)(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return {"status": start["status"], "headers": dict(start["headers"]), "error": json.loads(body)["error"]}, read[0]
