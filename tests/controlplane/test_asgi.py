"""The ASGI application served as production serves it: Django's pages and the bounds on the
bodies sent to them."""

from __future__ import annotations

import pytest

from controlplane.asgi import Application
from tests.http_wire import BodyBytesTaken, answer, closed, send
from tests.system.harness import wait_for

pytestmark = pytest.mark.django_db(transaction=True)
FORM = "POST /login/ HTTP/1.1\nHost: 127.0.0.1\nContent-Type: application/x-www-form-urlencoded"


def test_a_page_body_slower_than_the_timeout_is_a_408(serve, settings):
    settings.GATEWAY_BODY_TIMEOUT_S = 1
    port = serve(Application())
    with send(port, f"{FORM}\nContent-Length: 100", b"username=al") as client:  # and no more
        got = answer(client)
        assert got.status == 408 and b"did not arrive within 1s" in got.body
        assert got.headers["connection"] == "close" and closed(client)


def test_a_page_body_past_the_limit_is_a_413_declared_or_not(serve, settings):
    settings.WEB_MAX_BODY_BYTES = 10_000
    port = serve(Application())
    with send(port, f"{FORM}\nContent-Length: 10001", b"x" * 5000) as client:
        assert answer(client).status == 413 and closed(client)
    chunk = b"%x\r\n%s\r\n" % (6000, b"x" * 6000)
    with send(port, f"{FORM}\nTransfer-Encoding: chunked", chunk * 2) as client:  # and never the end
        got = answer(client)
        assert got.status == 413 and b"exceeds 10000 bytes" in got.body
        assert got.headers["connection"] == "close" and closed(client)


def test_a_page_body_past_the_cap_on_bodies_read_at_once_is_a_429_unread(serve, settings):
    settings.HTTP_MAX_BODY_READS_PER_CLIENT = 2
    app = BodyBytesTaken(Application())
    port = serve(app)
    held = []
    large = f"{FORM}\nContent-Length: 100000"  # bodies of 64 KB or less are read uncounted
    for _ in range(2):
        held.append(send(port, large, b"username=al"))
        wait_for(lambda: app.taken >= 11 * len(held), timeout=10, interval=0.01, what="the body to be read")
    with held[0], held[1], send(port, large, b"username=al") as client:
        got = answer(client)
        assert got.status == 429 and int(got.headers["retry-after"]) >= 1
        assert got.headers["connection"] == "close" and closed(client)
        assert app.taken == 22
