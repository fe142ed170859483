"""The gateway's own request and response, so that one set of handlers serves both the
lean ASGI front (production) and Django views (the in-process test client)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import orjson


@dataclass
class Request:
    method: str
    headers: dict[str, str]  # lower-case names
    body: bytes | None  # None: larger than GATEWAY_MAX_BODY_BYTES
    key: object = None  # the caller's KeyInfo, once checked (the ASGI front checks it before the body)


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    stream: AsyncIterator[bytes] | None = None
    # Runs once however the response ends (finished, failed, or never sent at all).
    on_close: Callable[[], Awaitable[None]] | None = None


def json_response(data, *, status: int = 200, headers: dict | None = None) -> Response:
    return Response(status=status, body=orjson.dumps(data), headers=dict(headers or {}))
