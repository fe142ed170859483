"""The server as production runs it (controlplane.serving): uvicorn with the project's protocol,
bounding what a client may send and hold before the application sees a request."""

from __future__ import annotations

import http.client
import socket
import threading

import pytest

from controlplane.asgi import Application
from tests.http_wire import answer, closed, refused, send
from tests.system.harness import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_client_still_sending_a_body_reads_the_answer_given_before_it(serve):
    port = serve(Application())
    body = b"x" * 8_000_000
    with send(port, f"POST /v1/chat/completions HTTP/1.1\nHost: x\nContent-Length: {len(body)}") as client:
        client.sendall(body)  # all of it, though the server answers without reading it
        got = answer(client)
        assert got.status == 401 and got.headers["connection"] == "close"
        assert closed(client)


def test_a_client_that_goes_on_sending_tens_of_megabytes_after_its_answer_is_cut_off(serve):
    """What still comes once the answer is given is read and dropped, up to 8 MB: past that the
    connection is cut, rather than the event loop reading 60 MB more for nothing."""
    port = serve(Application())
    sent = 0
    with send(port, "POST /v1/chat/completions HTTP/1.1\nHost: x\nContent-Length: 64000000") as client:
        piece = b"x" * 65536
        try:
            while sent < 64_000_000:
                client.sendall(piece)
                sent += len(piece)
        except OSError:  # reset, or broken pipe
            pass
    assert sent < 32_000_000


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


def _answered(port: int, **headers) -> socket.socket:
    """A connection that has had a request answered (so the server holds it), kept open."""
    extra = "".join(f"\n{name.replace('_', '-')}: {value}" for name, value in headers.items())
    client = send(port, f"GET /v1/models HTTP/1.1\nHost: 127.0.0.1{extra}")
    assert answer(client).status == 401
    return client


@pytest.mark.parametrize("caps", [
    {"HTTP_MAX_CONNECTIONS_PER_CLIENT": 2, "HTTP_MAX_CONNECTIONS": 0},
    {"HTTP_MAX_CONNECTIONS_PER_CLIENT": 0, "HTTP_MAX_CONNECTIONS": 2},
])
def test_a_connection_past_a_cap_is_closed_at_once_until_one_is_let_go(serve, settings, caps):
    settings.HTTP_HEADER_TIMEOUT_S = 60  # the connection held without a request is not closed for that
    for name, value in caps.items():
        setattr(settings, name, value)
    port = serve(Application(), timeout_keep_alive=60)
    first, second = _answered(port), _answered(port)
    with first, second, socket.create_connection(("127.0.0.1", port)) as third:
        assert refused(third)
        first.close()

        def a_new_one_answered():
            try:
                _answered(port).close()
                return True
            except (ConnectionError, http.client.RemoteDisconnected):
                return False

        wait_for(a_new_one_answered, timeout=10, interval=0.05, what="a connection to be served again")


def test_a_trusted_proxy_s_connections_are_not_capped_per_address(serve, settings):
    settings.HTTP_MAX_CONNECTIONS_PER_CLIENT = 1
    port = serve(Application(), proxy_headers=True, forwarded_allow_ips="127.0.0.1")
    connections = [_answered(port, X_Forwarded_For=f"10.0.0.{n}") for n in range(3)]
    for connection in connections:
        connection.close()


def test_serving_lets_the_process_open_as_many_files_as_it_may():
    """Past the soft limit on open files a server cannot accept anyone's connection for a
    second; serving raises it to the hard limit, so that the connection caps are what refuse."""
    import resource
    import subprocess
    import sys

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    probe = ("import resource; from controlplane.serving import allow_open_files; allow_open_files(); "
             "print(*resource.getrlimit(resource.RLIMIT_NOFILE))")
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                           preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    assert shown.stdout.split() == [str(hard), str(hard)]
