"""The answer to a request leaves once its usage is written to Redis, not once Redis has
acknowledged it: the hand-over is on its way to Redis (it gets there even if the gateway dies
now), and waiting for Redis's reply as well would put one more round trip on every answer.
The reply is awaited afterwards, and what its failure calls for (the database, the disk) is
done then, as before."""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
import pytest
import redis
from asgiref.sync import async_to_sync
from django.conf import settings as django_settings
from django.utils import timezone

from controlplane.asgi import application
from controlplane.fleet.models import EngineInstance, Node
from controlplane.gateway import ledger
from controlplane.gateway.apps import current_process
from controlplane.gateway.ledger.redis_scripts import FINISH, sha
from controlplane.metering.models import UsageEvent
from controlplane.metering.outbox import stream_key, usage_ingest
from tests.engines import simulator
from tests.redis_relay import ledger_behind_relay

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def text_engine():
    with simulator(family="qwen2", name="text", images=None) as port:
        yield port


@pytest.fixture
def held(settings):
    """The gateway's ledger in Redis, behind a relay that holds Redis's replies to hand-overs."""
    with ledger_behind_relay(settings, sha(FINISH).encode(), "hand-over") as relay:
        yield relay


@pytest.fixture
def routed(world, text_engine):
    node = Node.objects.create(name="local", address="127.0.0.1", queue="node.local", last_seen_at=timezone.now())
    EngineInstance.objects.create(tier=world.text, node=node, port=text_engine, actual_state="running",
                                  healthy=True, last_health_at=timezone.now())
    return world


async def _ask(key: str) -> httpx.Response:
    """A text request through the production ASGI application."""
    transport = httpx.ASGITransport(app=application)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=60) as client:
        return await client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                 json={"model": "text", "max_tokens": 4,
                                       "messages": [{"role": "user", "content": "hello there"}]})


def test_the_answer_leaves_once_its_usage_is_written_to_redis_not_once_redis_acknowledges_it(routed, held):
    direct = redis.Redis.from_url(django_settings.REDIS_URL)  # Redis itself, not through the relay

    async def scenario():
        answer = await _ask(routed.alice_key)
        # Answered while Redis's acknowledgement of the hand-over is still held back...
        still_held = not held.acknowledged.is_set()
        # ...and Redis already has the usage: were the gateway to die now, nothing is lost.
        in_redis = [orjson.loads(fields[b"record"])["request_id"] for _, fields in direct.xrange(stream_key())]
        held.release()
        await asyncio.wait_for(asyncio.gather(*current_process().hand_overs), 30)
        return answer, still_held, in_redis

    answer, still_held, in_redis = async_to_sync(scenario)()
    assert answer.status_code == 200, answer.text
    assert still_held, "the answer waited for Redis to acknowledge the usage"
    request_id = answer.headers["x-request-id"]
    assert in_redis == [request_id]
    # The acknowledgement came: nothing fell back to the database, nothing is stored twice.
    assert not UsageEvent.objects.filter(request_id=request_id).exists()
    while usage_ingest():
        pass
    event = UsageEvent.objects.get(request_id=request_id)
    assert (event.status, event.output_tokens) == ("ok", answer.json()["usage"]["completion_tokens"])


def test_a_server_stopping_finishes_the_hand_overs_still_awaiting_redis_before_it_exits(routed, held):
    async def scenario():
        answer = await _ask(routed.alice_key)
        request_id = answer.headers["x-request-id"]
        messages, sent = asyncio.Queue(), []
        for message in ("lifespan.startup", "lifespan.shutdown"):
            messages.put_nowait({"type": message})

        async def send(message):
            sent.append(message["type"])

        # The server stops (uvicorn's lifespan) while Redis's reply to the hand-over is held.
        stopping = asyncio.ensure_future(application({"type": "lifespan"}, messages.get, send))
        done, _ = await asyncio.wait({stopping}, timeout=1)
        waited = not done and sent == ["lifespan.startup.complete"]
        held.release()
        await asyncio.wait_for(stopping, 30)
        # Stopped only once the hand-over had its reply: it was not cut off by the process exiting.
        remembered = request_id in {record.request_id for _, record in ledger.ledger().handed}
        return waited, sent, remembered

    waited, sent, remembered = async_to_sync(scenario)()
    assert waited, "the server stopped without waiting for the hand-over's reply"
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert remembered


def _relayed(direct: redis.Redis) -> list[dict]:
    """The usage stream's records once what the gateway wrote before now has passed the relay
    (its threads take turns with everything else on a loaded machine). Polled from inside the
    gateway's send, which holds its event loop: nothing it would write later can be among them."""
    deadline = time.monotonic() + 10
    while not (records := [orjson.loads(fields[b"record"]) for _, fields in direct.xrange(stream_key())]) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    return records


def test_a_plain_answer_is_metered_in_full_before_its_status_line_leaves(routed, held):
    """A gateway killed between a plain answer's status line and its body (the server writes
    them apart) leaves a client with a 200 and no body; the answer was recorded as given, in
    full, before a byte of it left, as a stream is billed for what it had relayed."""
    # Through the relay, which holds only the replies to hand-overs: reading the stream is not held.
    direct = redis.Redis.from_url(django_settings.REDIS_URL)
    body = orjson.dumps({"model": "text", "max_tokens": 4, "messages": [{"role": "user", "content": "hello there"}]})
    at_status_line, sent = [], []

    async def scenario():
        requests = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if requests:
                return requests.pop()
            await asyncio.Event().wait()  # the client stays until the answer is sent

        async def send(message):
            if message["type"] == "http.response.start":
                at_status_line.extend(_relayed(direct))
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
                 "headers": [(b"authorization", f"Bearer {routed.alice_key}".encode()),
                             (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
        await application(scope, receive, send)
        held.release()
        await asyncio.wait_for(asyncio.gather(*current_process().hand_overs), 30)

    async_to_sync(scenario)()
    start, answer = sent[0], orjson.loads(sent[1]["body"])
    assert start["status"] == 200
    request_id = dict(start["headers"])[b"x-request-id"].decode()
    assert [(r["request_id"], r["status"], r["output_tokens"]) for r in at_status_line] == [
        (request_id, "ok", answer["usage"]["completion_tokens"])]
