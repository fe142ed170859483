"""The server as production runs it (controlplane.serving): uvicorn with the project's protocol,
bounding what a client may send and hold before the application sees a request."""

from __future__ import annotations

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
