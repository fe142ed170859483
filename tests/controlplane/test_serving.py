"""The server as production runs it (controlplane.serving): uvicorn with the project's protocol,
bounding what a client may send and hold before the application sees a request."""

from __future__ import annotations

import socket
import threading

import pytest

from controlplane.asgi import Application
from tests.http_wire import answer, closed, send

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_client_still_sending_a_body_reads_the_answer_given_before_it(serve):
    port = serve(Application())
    body = b"x" * 8_000_000
    with send(port, f"POST /v1/chat/completions HTTP/1.1\nHost: x\nContent-Length: {len(body)}") as client:
        client.sendall(body)  # all of it, though the server answers without reading it
        got = answer(client)
        assert got.status == 401 and got.headers["connection"] == "close"
        assert closed(client)


def _sending(port: int, head: str) -> tuple[socket.socket, threading.Thread]:
    """A connection sending `head` from a thread of its own (the server may answer and close
    before it has all been sent)."""
    client = socket.create_connection(("127.0.0.1", port))

    def write():
        try:
            client.sendall(head.replace("\n", "\r\n").encode() + b"\r\n\r\n")
        except OSError:  # refused before the end: what the client reads says why
            pass

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return client, thread


@pytest.mark.parametrize("path", ["/v1/models", "/login/"])
def test_a_20_mb_header_is_a_431_and_the_connection_closed(serve, path):
    port = serve(Application())
    client, writing = _sending(port, f"GET {path} HTTP/1.1\nHost: 127.0.0.1\nX-Padding: {'y' * 20_000_000}")
    with client:
        got = answer(client)
        assert got.status == 431 and got.headers["connection"] == "close"
        assert closed(client)
    writing.join(10)


@pytest.mark.parametrize("path", ["/v1/models", "/login/"])
def test_a_million_headers_are_a_431_while_other_clients_are_answered(serve, path):
    port = serve(Application())
    flood = "".join(f"X-{n}: y\n" for n in range(1_000_000))
    client, writing = _sending(port, f"GET {path} HTTP/1.1\nHost: 127.0.0.1\n{flood.rstrip()}")
    with client:
        with send(port, "GET /v1/models HTTP/1.1\nHost: 127.0.0.1") as other:
            assert answer(other).status == 401
        got = answer(client)
        assert got.status == 431 and b"header fields" in got.body
        assert closed(client)
    writing.join(10)


def test_header_lines_and_urls_past_their_limits_are_refused(serve, settings):
    settings.HTTP_MAX_HEADER_LINE_BYTES = 1024
    port = serve(Application())
    with send(port, f"GET /v1/models HTTP/1.1\nHost: 127.0.0.1\nX-Long: {'y' * 1100}") as client:
        assert answer(client).status == 431 and closed(client)
    with send(port, f"GET /v1/models?{'q' * 1100} HTTP/1.1\nHost: 127.0.0.1") as client:
        assert answer(client).status == 414 and closed(client)


def test_requests_within_the_header_limits_are_served(serve):
    port = serve(Application())
    fields = "".join(f"X-{n}: {'y' * 300}\n" for n in range(90))  # 28 KB in 91 fields
    head = f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n{fields.replace(chr(10), chr(13) + chr(10))}\r\n"
    with socket.create_connection(("127.0.0.1", port)) as client:
        for _ in range(3):  # each request of a connection has the limits to itself
            client.sendall(head.encode())
            assert answer(client).status == 401
