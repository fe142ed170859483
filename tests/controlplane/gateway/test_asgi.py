"""The production way in: /v1 served by the plain ASGI front, the rest by Django."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from controlplane.asgi import Application, application
from controlplane.fleet.models import EngineInstance, Node
from tests.engines import simulator
from tests.http_wire import BodyBytesTaken, answer, closed, send
from tests.system.harness import wait_for

pytestmark = pytest.mark.django_db


@async_to_sync
async def call(method, path, **kwargs):
    transport = httpx.ASGITransport(app=application)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        return await client.request(method, path, **kwargs)


def test_v1_answers_with_openai_errors_and_the_rest_is_django(world, settings):
    settings.ALLOWED_HOSTS = ["127.0.0.1"]
    assert call("GET", "/v1/models").json()["error"]["code"] == "invalid_api_key"
    models = call("GET", "/v1/models", headers={"Authorization": f"Bearer {world.alice_key}"})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "auto"
    bad = call("POST", "/v1/chat/completions", content=b"{nope", headers={"Authorization": f"Bearer {world.alice_key}"})
    assert (bad.status_code, bad.json()["error"]["code"]) == (400, "invalid_json")
    assert call("GET", "/v1/embeddings").json()["error"]["code"] == "unknown_url"
    assert call("GET", "/static/css/app.css").status_code == 200  # not /v1: Django serves it
    assert "csrftoken" not in call("GET", "/v1/models").headers.get("set-cookie", "")


def test_an_oversized_body_is_refused_without_being_kept(world, settings):
    settings.GATEWAY_MAX_BODY_BYTES = 50_000
    response = call("POST", "/v1/chat/completions", content=b"x" * 200_000,
                    headers={"Authorization": f"Bearer {world.alice_key}"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_the_gateway_process_keeps_freed_image_buffers_unless_told_not_to():
    from controlplane.gateway.memory import keep_freed_buffers

    # glibc accepts the tuning (a refused value would leave every request faulting in fresh pages)
    assert keep_freed_buffers(256) is True
    assert keep_freed_buffers(0) is False  # GATEWAY_HEAP_KEEP_MB=0: glibc's defaults


def _connections_to(port: int) -> int:
    """Established TCP connections to 127.0.0.1:`port` on this machine (the engine's side)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                local, state = row.split()[1], row.split()[3]
                count += state == "01" and int(local.rsplit(":", 1)[1], 16) == port
    return count


def test_a_server_stopping_closes_its_connections_to_the_engines(world):
    """A gateway replica taken out of service lets go of the connections it pooled to the
    engines as it stops, instead of leaving each engine to find them idle later."""
    with simulator(family="qwen2", name="text", images=None) as port:
        node = Node.objects.create(name="local", address="127.0.0.1", queue="node.local",
                                   last_seen_at=timezone.now())
        EngineInstance.objects.create(tier=world.text, node=node, port=port, actual_state="running",
                                      healthy=True, last_health_at=timezone.now())

        async def scenario():
            transport = httpx.ASGITransport(app=application)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=60) as client:
                answer = await client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {world.alice_key}"},
                                           json={"model": "text", "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "hello there"}]})
            pooled = _connections_to(port)
            messages, sent = asyncio.Queue(), []
            for message in ("lifespan.startup", "lifespan.shutdown"):
                messages.put_nowait({"type": message})

            async def send(message):
                sent.append(message["type"])

            await asyncio.wait_for(application({"type": "lifespan"}, messages.get, send), 30)
            for _ in range(100):  # the engine's side sees the close as soon as it is made
                if not _connections_to(port):
                    break
                await asyncio.sleep(0.02)
            return answer.status_code, pooled, sent, _connections_to(port)

        status, pooled, sent, left = async_to_sync(scenario)()
    assert status == 200 and pooled >= 1  # the answer came over a pooled connection
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert left == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("method, path, keyed, status", [
    ("POST", "/v1/files", True, 404),
    ("PUT", "/v1", False, 404),
    ("GET", "/v1/chat/completions", True, 405),
    ("POST", "/v1/models", True, 405),
    ("GET", "/v1/models", False, 401),
    ("POST", "/v1/chat/completions", False, 401),
])
def test_every_v1_path_and_method_answers_before_reading_a_declared_body(world, serve, method, path, keyed,
                                                                          status):
    app = BodyBytesTaken(Application())
    port = serve(app)
    key = f"\nAuthorization: Bearer {world.alice_key}" if keyed else ""
    with send(port, f"{method} {path} HTTP/1.1\nHost: x\nContent-Length: 64000000{key}", b"x" * 65536) as client:
        got = answer(client)
        assert got.status == status
        assert "message" in orjson.loads(got.body)["error"]
        if status == 405:
            assert got.headers["allow"] == ("GET" if path == "/v1/models" else "POST")
        assert got.headers["connection"] == "close" and closed(client)  # the rest is not waited for
    assert app.taken == 0


@pytest.mark.django_db(transaction=True)
def test_a_chunked_body_past_the_limit_is_refused_as_it_arrives(world, serve, settings):
    settings.GATEWAY_MAX_BODY_BYTES = 100_000
    app = BodyBytesTaken(Application())
    port = serve(app)
    chunk = b"%x\r\n%s\r\n" % (50_000, b"x" * 50_000)
    with send(port, f"POST /v1/chat/completions HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\n"
                    f"Authorization: Bearer {world.alice_key}", chunk * 3) as client:  # and never the end
        got = answer(client)
        assert (got.status, orjson.loads(got.body)["error"]["code"]) == (413, "request_too_large")
        assert closed(client)
    assert app.taken <= 150_000


def _reading(port: int, key: str, app: BodyBytesTaken, *, forwarded_for: str | None = None):
    """A chat request whose body has begun and never ends, once the gateway is reading it."""
    taken = app.taken
    extra = f"\nX-Forwarded-For: {forwarded_for}" if forwarded_for else ""
    client = send(port, f"POST /v1/chat/completions HTTP/1.1\nHost: x\nAuthorization: Bearer {key}\n"
                        f"Content-Length: 100000{extra}", b'{"model":')  # over 64 KB: counted
    wait_for(lambda: app.taken >= taken + 9, timeout=10, interval=0.01, what="the body to be read")
    return client


def _chat(port: int, key: str, *, forwarded_for: str | None = None):
    extra = f"\nX-Forwarded-For: {forwarded_for}" if forwarded_for else ""
    junk = b"{" + b"x" * 99_999  # over 64 KB, as a body the caps count; not JSON
    with send(port, f"POST /v1/chat/completions HTTP/1.1\nHost: x\nAuthorization: Bearer {key}\n"
                    f"Content-Length: {len(junk)}{extra}", junk) as client:
        return answer(client)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("caps, status, code", [
    ({"HTTP_MAX_BODY_READS_PER_CLIENT": 2, "HTTP_MAX_BODY_READS": 0}, 429, "rate_limit_exceeded"),
    ({"HTTP_MAX_BODY_READS_PER_CLIENT": 0, "HTTP_MAX_BODY_READS": 2}, 503, "service_unavailable"),
])
def test_a_body_past_a_cap_on_bodies_read_at_once_is_refused_unread(world, serve, settings, caps, status, code):
    for name, value in caps.items():
        setattr(settings, name, value)
    app = BodyBytesTaken(Application())
    port = serve(app)
    first, second = _reading(port, world.alice_key, app), _reading(port, world.bob_key, app)
    with first, second:
        taken = app.taken
        refused = _chat(port, world.alice_key)
        assert (refused.status, orjson.loads(refused.body)["error"]["code"]) == (status, code)
        assert int(refused.headers["retry-after"]) >= 1 and refused.headers["connection"] == "close"
        assert app.taken == taken
        with send(port, f"GET /v1/models HTTP/1.1\nHost: x\nAuthorization: Bearer {world.alice_key}") as other:
            assert answer(other).status == 200  # a request without a body is served meanwhile
        first.close()
        wait_for(lambda: _chat(port, world.alice_key).status == 400, timeout=10, interval=0.05,
                 what="a body to be read again once one was let go")


@pytest.mark.django_db(transaction=True)
def test_behind_a_trusted_proxy_bodies_are_counted_per_forwarded_client(world, serve, settings):
    settings.HTTP_MAX_BODY_READS_PER_CLIENT = 1
    app = BodyBytesTaken(Application())
    port = serve(app, proxy_headers=True, forwarded_allow_ips="127.0.0.1")
    with _reading(port, world.alice_key, app, forwarded_for="203.0.113.1"), \
            _reading(port, world.alice_key, app, forwarded_for="203.0.113.2"):
        assert _chat(port, world.alice_key, forwarded_for="203.0.113.1").status == 429
        assert _chat(port, world.alice_key, forwarded_for="203.0.113.3").status == 400


@pytest.mark.django_db(transaction=True)
def test_bodies_past_the_megabytes_read_at_once_are_refused_unread(world, serve, settings):
    """Ten connections declaring 64 MB each, all but the end sent, took the gateway from 595 to
    992 MB: the bodies being read are weighed in what they may grow to."""
    settings.HTTP_MAX_BODY_READ_MB = 100
    app = BodyBytesTaken(Application())
    port = serve(app)
    taken = app.taken
    head = f"POST /v1/chat/completions HTTP/1.1\nHost: x\nAuthorization: Bearer {world.alice_key}\nContent-Length: 64000000"
    with send(port, head, b'{"model":') as first:
        wait_for(lambda: app.taken >= taken + 9, timeout=10, interval=0.01, what="the first body to be read")
        with send(port, head.replace(world.alice_key, world.bob_key), b'{"model":') as second:
            refused = answer(second)
            assert (refused.status, orjson.loads(refused.body)["error"]["code"]) == (503, "service_unavailable")
            assert int(refused.headers["retry-after"]) >= 1
        assert _chat(port, world.bob_key).status == 400  # a body of 100 KB fits beside it
        first.close()


@pytest.mark.django_db(transaction=True)
def test_small_bodies_are_read_whatever_the_caps_on_bodies_read_at_once(world, serve, settings):
    """A burst of hundreds of text requests is read in a moment: bodies of 64 KB or less
    declared as such are not counted, and never refused for the large ones being read."""
    settings.HTTP_MAX_BODY_READS = 2
    app = BodyBytesTaken(Application())
    port = serve(app)
    with _reading(port, world.alice_key, app), _reading(port, world.bob_key, app):
        assert _chat(port, world.alice_key).status == 503  # a large one waits its turn
        with send(port, f"POST /v1/chat/completions HTTP/1.1\nHost: x\nAuthorization: Bearer {world.alice_key}\n"
                        "Content-Length: 5", b"{nope") as client:
            assert answer(client).status == 400  # read, and found not to be JSON


@pytest.mark.django_db(transaction=True)
def test_a_body_of_too_much_json_is_refused_at_its_first_megabytes(world, serve):
    """2,048 messages of 1,024 parts (54.6 MB): refused as soon as what has come holds more
    objects than a request can use, not once all of it is read."""
    body = orjson.dumps({"model": "vlm-lite", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}] * 1024}] * 2048})
    app = BodyBytesTaken(Application())
    port = serve(app)
    head = (f"POST /v1/chat/completions HTTP/1.1\nHost: x\nAuthorization: Bearer {world.alice_key}\n"
            f"Content-Length: {len(body)}")
    with send(port, head, body[:4 << 20]) as client:  # the first 4 MB, and no more
        got = answer(client)
        assert (got.status, orjson.loads(got.body)["error"]["code"]) == (400, "request_too_complex")
    assert app.taken <= 4 << 20
