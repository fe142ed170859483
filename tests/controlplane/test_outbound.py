"""Requests to URLs operators set go to the address vetted for them, one lookup each, and
follow no redirect; against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import http.server
import threading

import httpx
import pytest

from controlplane import outbound
from controlplane.imaging.fetch import UnsafeURL

LOOPBACK = ("127.0.0.1/32",)


class Handler(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        Handler.seen.append(self.headers.get("Host"))
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/to-metadata":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
        else:
            self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")


@pytest.fixture
def port():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Handler.seen.clear()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def answers(*addresses):
    """A resolver whose answers change from one lookup to the next, as a rebinding DNS's do."""
    queue = list(addresses)
    return lambda host, port: [queue.pop(0) if len(queue) > 1 else queue[0]]


def test_a_request_goes_to_the_vetted_address_with_its_own_host_name(port):
    # hooks.test resolves nowhere but in this resolver: reaching the server proves the
    # connection went to the address vetted, with no second lookup.
    with outbound.client(trusted_networks=LOOPBACK, resolver=answers("127.0.0.1")) as client:
        assert client.post(f"http://hooks.test:{port}/hook", json={}).status_code == 200
    assert Handler.seen == [f"hooks.test:{port}"]


def test_each_request_is_vetted_again_so_a_name_that_moves_is_refused(port):
    with outbound.client(trusted_networks=LOOPBACK, resolver=answers("127.0.0.1", "127.0.0.2")) as client:
        assert client.post(f"http://hooks.test:{port}/hook", json={}).status_code == 200
        with pytest.raises(outbound.RefusedTarget, match="resolves to 127.0.0.2, a loopback address"):
            client.post(f"http://hooks.test:{port}/hook", json={})
    assert len(Handler.seen) == 1


def test_private_addresses_are_refused_unless_trusted(port):
    with outbound.client(trusted_networks=(), what="webhook URL") as client:
        with pytest.raises(outbound.RefusedTarget, match="webhook URL host '127.0.0.1' resolves to 127.0.0.1"):
            client.post(f"http://127.0.0.1:{port}/hook", json={})
    assert Handler.seen == []


def test_a_redirect_is_not_followed(port):
    with outbound.client(trusted_networks=LOOPBACK) as client:
        response = client.post(f"http://127.0.0.1:{port}/to-metadata", json={})
    assert response.status_code == 302 and len(Handler.seen) == 1


def test_a_host_that_does_not_resolve_fails_as_a_connection_would():
    with outbound.client(trusted_networks=(), resolver=lambda host, port: []) as client:
        with pytest.raises(httpx.ConnectError, match="has no address"):
            client.post("http://nowhere.test/hook", json={})


def test_the_async_client_vets_each_request_too(port):
    async def post_twice():
        async with outbound.async_client(trusted_networks=LOOPBACK,
                                         resolver=answers("127.0.0.1", "169.254.169.254")) as client:
            assert (await client.post(f"http://hooks.test:{port}/v1/moderations", json={})).status_code == 200
            with pytest.raises(outbound.RefusedTarget, match="metadata"):
                await client.post(f"http://hooks.test:{port}/v1/moderations", json={})

    asyncio.run(post_twice())
    assert Handler.seen == [f"hooks.test:{port}"]


def test_a_pinned_client_sends_to_the_address_vetted_once_and_nowhere_else(port):
    target = outbound.vet(f"http://gateway.test:{port}/v1", trusted_networks=LOOPBACK,
                          resolver=answers("127.0.0.1"))

    async def send():
        async with httpx.AsyncClient(transport=outbound.AsyncPinnedTransport(target)) as client:
            for _ in range(2):
                assert (await client.post(f"http://gateway.test:{port}/v1/chat/completions")).status_code == 200
            with pytest.raises(outbound.RefusedTarget, match="not the host"):
                await client.post(f"http://elsewhere.test:{port}/v1/chat/completions")

    asyncio.run(send())
    assert Handler.seen == [f"gateway.test:{port}"] * 2


@pytest.mark.parametrize("url, reason", [
    ("http://user:secret@hooks.example.com/", "user name or password"),
    ("ftp://hooks.example.com/", "scheme"),
    ("http://[::ffff:0:a9fe:a9fe]/", "metadata"),
])
def test_vetting_refuses_what_image_urls_refuse(url, reason):
    with pytest.raises(UnsafeURL, match=reason):
        outbound.vet(url, trusted_networks=(), resolver=lambda host, port: ["93.184.215.14"])
