"""/v1 checks the key and the declared length before reading a body, and a body that does
not arrive in time is refused: nobody without a key makes the gateway buffer or wait."""

from __future__ import annotations

import asyncio
import json

import pytest
from asgiref.sync import async_to_sync

from controlplane.gateway.asgi import app

pytestmark = pytest.mark.django_db(transaction=True)


def _call(headers: dict, chunks: list[bytes], *, stall: bool = False) -> tuple[dict, int]:
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


def test_a_request_without_a_valid_key_is_refused_before_its_body_is_read(world):
    big = [b"x" * 1_000_000] * 64
    for headers in ({}, {"authorization": "Bearer sk-not-a-key"}):
        response, read = _call({**headers, "content-length": str(64_000_000)}, big)
        assert response["status"] == 401 and read == 0


def test_a_body_declared_past_the_limit_is_refused_unread(world, settings):
    settings.GATEWAY_MAX_BODY_BYTES = 1_000_000
    response, read = _call({"authorization": f"Bearer {world.alice_key}", "content-length": "1000001"},
                           [b"x" * 1_000_001])
    assert (response["status"], response["error"]["code"], read) == (413, "request_too_large", 0)


def test_a_body_that_does_not_arrive_in_time_is_a_408(world, settings):
    settings.GATEWAY_BODY_TIMEOUT_S = 1
    response, read = _call({"authorization": f"Bearer {world.alice_key}", "content-length": "5000"},
                           [b'{"model":'], stall=True)
    assert (response["status"], response["error"]["code"]) == (408, "request_timeout")
