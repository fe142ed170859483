"""Slow and oversized clients on every path: headers that trickle, bodies that never end or
exceed the limit are cut off, not held or spooled to disk."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn
from asgiref.sync import async_to_sync

from controlplane.asgi import application
from controlplane.serving import BoundedHttpProtocol

pytestmark = pytest.mark.django_db


def _django_path(headers: dict, chunks: list[bytes]) -> list[dict]:
    sent, given = [], [0]

    async def receive():
        if given[0] >= len(chunks):
            await asyncio.sleep(3600)  # the rest never comes
        given[0] += 1
        return {"type": "http.request", "body": chunks[given[0] - 1], "more_body": True}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/login/", "query_string": b"", "root_path": "",
             "scheme": "http", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000),
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    async_to_sync(application)(scope, receive, send)
    return sent


def test_a_page_request_declaring_a_body_past_the_limit_is_refused_unread(settings):
    settings.WEB_MAX_BODY_BYTES = 10_000
    sent = _django_path({"content-length": "10001", "content-type": "application/x-www-form-urlencoded"},
                        [b"x" * 10_001])
    assert sent[0]["status"] == 413


def test_a_page_request_whose_body_never_ends_is_cut_off(settings):
    settings.WEB_MAX_BODY_BYTES, settings.GATEWAY_BODY_TIMEOUT_S = 10_000, 1
    started = time.monotonic()
    sent = _django_path({"content-type": "application/x-www-form-urlencoded"}, [b"a=1&"] * 3)
    assert time.monotonic() - started < 10 and sent[0]["status"] == 408  # and the connection closed
    assert (b"connection", b"close") in sent[0]["headers"]
    sent = _django_path({"content-type": "application/x-www-form-urlencoded"}, [b"x" * 6000] * 3)
    assert sent[0]["status"] == 413  # past the limit without declaring it


@pytest.fixture
def server(settings):
    async def hello(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"hello"})

    settings.HTTP_HEADER_TIMEOUT_S = 1
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    running = uvicorn.Server(uvicorn.Config(hello, host="127.0.0.1", port=port, http=BoundedHttpProtocol,
                                            log_level="warning", lifespan="off"))
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    while not running.started:
        time.sleep(0.02)
    yield port
    running.should_exit = True
    thread.join(10)


def _closed_within(connection: socket.socket, seconds: float) -> bool:
    connection.settimeout(seconds)
    try:
        return connection.recv(1024) == b""
    except TimeoutError:
        return False


def test_a_client_trickling_its_headers_is_disconnected(server):
    with socket.create_connection(("127.0.0.1", server)) as slow:
        started, cut = time.monotonic(), False
        for byte in b"GET / HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"y" * 200:
            try:
                slow.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            time.sleep(0.05)
        assert cut or _closed_within(slow, 3)
        assert time.monotonic() - started < 5
    with socket.create_connection(("127.0.0.1", server)) as silent:  # and one that sends nothing
        assert _closed_within(silent, 3)
    with socket.create_connection(("127.0.0.1", server)) as prompt:  # a normal client is served
        prompt.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        prompt.settimeout(3)
        answer = b""
        while b"hello" not in answer and (chunk := prompt.recv(1024)):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200") and b"hello" in answer
