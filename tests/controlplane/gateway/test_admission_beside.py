"""A request's admission runs beside its trip to the engine, not before it: the engine is sent
the request as soon as the script that admits and journals it is on its way to Redis, and the
client is answered only once Redis has admitted it. Refused meanwhile, the exchange with the
engine is abandoned and the client gets the 429 it would have got; the tenant's next requests
wait for their admission until one passes. Whatever happens, the request is finished in the
ledger only after its admission: nothing is left reserved or journaled."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import redis
from asgiref.sync import async_to_sync, sync_to_async
from django.utils import timezone

from controlplane.asgi import application
from controlplane.fleet.models import EngineInstance, Node
from controlplane.gateway import ledger
from controlplane.gateway.apps import current_process
from controlplane.gateway.ledger import Ask, Limits, Refused
from controlplane.gateway.ledger.redis_scripts import ADMIT, sha
from controlplane.metering.models import UsageEvent
from controlplane.metering.outbox import usage_ingest
from controlplane.tenants.models import Quota
from tests.engines import read_request
from tests.redis_relay import HOLD_S, ledger_behind_relay

pytestmark = pytest.mark.django_db

ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "text",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}}
QUOTA = 10_000  # total tokens a day


class Engine:
    """An engine that notes each request as it arrives, then, by `mode`: answers it once told
    to ("answers"), starts streaming once told to and holds the stream open ("streams"), or
    closes the connection without an answer ("breaks"); and notes when the gateway closes the
    exchange first."""

    def __init__(self, mode: str = "answers"):
        self.mode = mode
        self.arrived, self.abandoned, self.go = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.streaming = asyncio.Event()  # a stream's headers and first chunk are sent
        self.requests = 0
        self.server = None

    async def start(self, tier, *, pool: str = "default", waiting: int = 0) -> None:
        """Serve, registered as an engine of `tier` (`waiting`: the requests its last scrape
        found waiting, which routing weighs)."""
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.instance = await sync_to_async(_register)(tier, self.server.sockets[0].getsockname()[1], pool=pool,
                                                       waiting=waiting)

    async def _serve(self, reader, writer) -> None:
        await read_request(reader)
        self.requests += 1
        self.arrived.set()
        if self.mode == "breaks":
            writer.close()
            return
        told, closed = asyncio.ensure_future(self.go.wait()), asyncio.ensure_future(reader.read(1))
        await asyncio.wait({told, closed}, return_when=asyncio.FIRST_COMPLETED)
        if closed.done() and closed.result() == b"":
            self.abandoned.set()
        elif self.mode == "streams":
            chunk = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                         + hex(len(chunk))[2:].encode() + b"\r\n" + chunk + b"\r\n")
            await writer.drain()
            self.streaming.set()
            if await closed == b"":  # held open until the gateway closes it
                self.abandoned.set()
        else:
            body = json.dumps(ANSWER).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
        told.cancel()
        closed.cancel()
        writer.close()

    def stop(self) -> None:
        self.go.set()
        self.server.close()


def _register(tier, port: int, *, pool: str = "default", waiting: int = 0) -> EngineInstance:
    node, _ = Node.objects.get_or_create(name="local", defaults={
        "address": "127.0.0.1", "queue": "node.local", "last_seen_at": timezone.now()})
    return EngineInstance.objects.create(tier=tier, node=node, port=port, actual_state="running", healthy=True,
                                         last_health_at=timezone.now(), pool=pool, num_waiting=waiting)


@pytest.fixture
def held(settings):
    """The gateway's ledger in Redis, behind a relay that holds Redis's replies to admissions."""
    with ledger_behind_relay(settings, sha(ADMIT).encode(), "beside") as relay:
        yield relay


REQUEST = {"model": "text", "max_tokens": 50, "messages": [{"role": "user", "content": "hello there"}]}


def _ask(key: str, request: dict = REQUEST) -> asyncio.Task:
    """A request (text, by default) through the production ASGI application, under way."""
    async def ask():
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=60) as client:
            return await client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                     json=request)

    return asyncio.ensure_future(ask())


def _ask_then_leave(key: str, leaving: asyncio.Event, request: dict = REQUEST) -> asyncio.Task:
    """A request through the production ASGI application whose client disconnects once
    `leaving` is set (as the server says so: an http.disconnect)."""
    body = json.dumps(request).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 80),
             "headers": [(b"host", b"127.0.0.1"), (b"authorization", f"Bearer {key}".encode()),
                         (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop()
        await leaving.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        pass

    return asyncio.ensure_future(application(scope, receive, send))


async def _sent(engine: Engine) -> None:
    """Once the engine has the request (the admission's reply held meanwhile)."""
    try:
        await asyncio.wait_for(engine.arrived.wait(), HOLD_S / 2)
    except TimeoutError:
        pytest.fail("the engine was sent nothing before Redis answered the admission")


async def _answered_while_held(asking: asyncio.Task) -> bool:
    """Whether the client has its answer within half a second, Redis's reply to the admission
    held meanwhile."""
    await asyncio.wait({asking}, timeout=0.5)
    return asking.done()


async def _admitted_then(held, engine: Engine, asking: asyncio.Task):
    """The client's answer once Redis's replies are let through, every hand-over done and the
    engine stopped."""
    held.release()
    answer = await asyncio.wait_for(asking, 30)
    await _settled()
    engine.stop()
    return answer


async def _settled() -> None:
    """Every hand-over of this process done."""
    while current_process().hand_overs:
        await asyncio.wait_for(asyncio.gather(*list(current_process().hand_overs), return_exceptions=True), 30)


def stored() -> list[UsageEvent]:
    while usage_ingest():
        pass
    return list(UsageEvent.objects.order_by("created_at"))


def _room(world, quota: int = QUOTA) -> int:
    """Total tokens alice has left today of her `quota` (probed with reservations, as the
    gateway reserves)."""
    limits, low, high = Limits(period="day", total_tokens=quota), 0, quota

    async def fits(tokens: int) -> bool:
        store = ledger.ledger()
        try:
            reservation = await store.reserve(world.alice.pk, limits, Ask(0, tokens, False), timezone.now())
        except Refused:
            return False
        await store.settle(reservation, image_tokens=0, total_tokens=0)
        return True

    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if async_to_sync(fits)(middle) else (low, middle - 1)
    return low


def _journaled(settings) -> dict:
    return redis.Redis.from_url(settings.REDIS_URL).hgetall(f"{settings.CACHES['default']['KEY_PREFIX']}:inflight")


def test_the_engine_is_sent_a_request_while_its_admission_is_on_its_way_and_answered_once_admitted(
        world, held, settings):
    Quota.objects.create(tenant=world.alice, period="day", total_tokens=QUOTA)
    engine = Engine()

    async def scenario():
        await engine.start(world.text)
        asking = _ask(world.alice_key)
        await _sent(engine)  # Redis's reply to the admission is held: the engine has the request
        engine.go.set()  # it answers at once...
        answered_before_admitted = await _answered_while_held(asking)  # ...which waits for the admission
        answer = await _admitted_then(held, engine, asking)
        return answered_before_admitted, answer

    answered_before_admitted, answer = async_to_sync(scenario)()
    assert not answered_before_admitted, "the engine's answer was relayed before Redis admitted the request"
    assert answer.status_code == 200, answer.text
    [event] = stored()
    assert (event.request_id, event.status, event.output_tokens) == (answer.headers["x-request-id"], "ok", 1)
    assert _journaled(settings) == {}
    assert _room(world) == QUOTA - (event.text_tokens + event.output_tokens)  # settled to what was used


@pytest.mark.parametrize("engine_answers", ["after the refusal", "before the refusal", "streaming before it"])
def test_a_request_refused_while_its_engine_has_it_is_a_429_and_the_exchange_is_abandoned(
        world, held, settings, engine_answers):
    Quota.objects.create(tenant=world.alice, period="day", total_tokens=10)  # no room for anything

    async def scenario():
        streaming = engine_answers == "streaming before it"
        engine = Engine("streams" if streaming else "answers")
        await engine.start(world.text)
        if engine_answers != "after the refusal":
            engine.go.set()
        first = _ask(world.alice_key, {**REQUEST, "stream": streaming})
        await _sent(engine)
        if streaming:
            await asyncio.wait_for(engine.streaming.wait(), 10)
        held.release()
        refused = await asyncio.wait_for(first, 30)
        if engine_answers != "before the refusal":  # (an answer already given has nothing to abandon)
            await asyncio.wait_for(engine.abandoned.wait(), 10)
        # Refused here once: the tenant's next request waits for its admission.
        second = await asyncio.wait_for(_ask(world.alice_key), 30)
        await _settled()
        engine.stop()
        return refused, second, engine.requests

    refused, second, sent = async_to_sync(scenario)()
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "insufficient_quota"
    assert "Retry-After" in refused.headers
    assert second.status_code == 429
    assert sent == 1, "the engine was sent the tenant's request after its previous one was refused"
    events = stored()
    assert [(e.status, e.http_status, e.cost, e.image_tokens, e.text_tokens) for e in events] == \
        [("error", 429, 0, 0, 0)] * 2
    assert _journaled(settings) == {}
    assert _room(world, 10) == 10  # nothing reserved, nothing used


def test_a_client_leaving_while_its_admission_is_beside_the_engine_is_recorded_once_admitted(
        world, held, settings):
    Quota.objects.create(tenant=world.alice, period="day", total_tokens=QUOTA)
    engine = Engine()

    async def scenario():
        await engine.start(world.text)
        leaving = asyncio.Event()
        asking = _ask_then_leave(world.alice_key, leaving)
        await _sent(engine)
        leaving.set()  # the client leaves while Redis's reply to its admission is held
        await asyncio.wait_for(engine.abandoned.wait(), 10)
        held.release()
        await asyncio.gather(asking, return_exceptions=True)
        await _settled()
        engine.stop()

    async_to_sync(scenario)()
    [event] = stored()
    # Billed for its prompt, as any request its client left once an engine had it.
    assert (event.status, event.http_status, event.instance_id is not None, event.cost > 0) == \
        ("aborted", 499, True, True)
    # Finished after it was admitted: its journal entry gone, its reservation settled to what is
    # billed, not left holding the max_tokens ceiling.
    assert _journaled(settings) == {}
    assert _room(world) == QUOTA - (event.text_tokens + event.output_tokens)


def test_a_quota_store_that_does_not_answer_is_a_503_and_the_next_request_waits_for_its_admission(
        world, held, settings):
    settings.REDIS_TIMEOUT_S = 1  # the held reply is lost
    Quota.objects.create(tenant=world.alice, period="day", total_tokens=QUOTA)

    async def scenario():
        engine = Engine()
        await engine.start(world.text)
        first = await asyncio.wait_for(_ask(world.alice_key), 30)
        await asyncio.wait_for(engine.abandoned.wait(), 10)  # sent beside, then abandoned
        second = await asyncio.wait_for(_ask(world.alice_key), 30)
        held.release()
        await _settled()
        engine.stop()
        return first, second, engine.requests

    first, second, sent = async_to_sync(scenario)()
    assert (first.status_code, second.status_code) == (503, 503)
    assert first.json()["error"]["code"] == "quota_unavailable" and first.headers["Retry-After"]
    assert sent == 1, "the engine was sent a request while the quota's store did not answer"
    events = stored()
    assert [(e.status, e.http_status, e.cost) for e in events] == [("error", 503, 0)] * 2
    # Redis made both admissions, only their replies were lost: their 503s settled them.
    assert _journaled(settings) == {}
    assert _room(world) == QUOTA


@pytest.mark.parametrize(("quota", "status"), [(QUOTA, 502), (10, 429)])
def test_an_engine_that_breaks_before_the_admission_is_answered_is_answered_for_once_admitted(
        world, held, settings, quota, status):
    Quota.objects.create(tenant=world.alice, period="day", total_tokens=quota)
    engine = Engine("breaks")

    async def scenario():
        await engine.start(world.text)
        asking = _ask(world.alice_key)
        await _sent(engine)
        answered_before_admitted = await _answered_while_held(asking)
        answer = await _admitted_then(held, engine, asking)
        return answered_before_admitted, answer

    answered_before_admitted, answer = async_to_sync(scenario)()
    assert not answered_before_admitted, "the engine's failure was answered before Redis answered the admission"
    assert answer.status_code == status, answer.text  # a refusal over the engine's failure
    assert [(e.status, e.http_status, e.cost) for e in stored()] == [("error", status, 0)]
    assert _journaled(settings) == {}
    assert _room(world, quota) == quota


def test_a_client_leaving_after_the_engines_headers_and_before_its_admission_closes_the_exchange(
        world, held, settings):
    Quota.objects.create(tenant=world.alice, period="day", total_tokens=QUOTA)
    engine = Engine("streams")
    engine.go.set()  # it streams at once, and holds the stream open

    async def scenario():
        await engine.start(world.text)
        leaving = asyncio.Event()
        asking = _ask_then_leave(world.alice_key, leaving, {**REQUEST, "stream": True})
        await asyncio.wait_for(engine.streaming.wait(), HOLD_S / 2)
        await asyncio.sleep(0.3)  # the gateway reads the stream's headers, then waits for the admission
        leaving.set()
        try:
            await asyncio.wait_for(engine.abandoned.wait(), HOLD_S / 2)  # the admission's reply still held
        except TimeoutError:
            pytest.fail("the engine's stream was left open after its client left")
        finally:
            held.release()
            await asyncio.gather(asking, return_exceptions=True)
            await _settled()
            engine.stop()

    async_to_sync(scenario)()
    [event] = stored()
    assert (event.status, event.http_status) == ("aborted", 499)
    assert _journaled(settings) == {}


def test_a_request_without_a_quota_going_on_without_a_silent_store_keeps_the_others_waiting_for_theirs(
        world, held, settings):
    settings.REDIS_TIMEOUT_S = 1  # the held replies are lost
    Quota.objects.create(tenant=world.alice, period="day", total_tokens=QUOTA)  # bob has none
    engine = Engine()
    engine.go.set()

    async def scenario():
        await engine.start(world.text)
        first = await asyncio.wait_for(_ask(world.alice_key), 30)  # beside, then a 503
        unlimited = await asyncio.wait_for(_ask(world.bob_key), 30)  # served, its journal unwritten
        second = await asyncio.wait_for(_ask(world.alice_key), 30)
        held.release()
        await _settled()
        engine.stop()
        return first, unlimited, second, engine.requests

    first, unlimited, second, sent = async_to_sync(scenario)()
    assert (first.status_code, unlimited.status_code, second.status_code) == (503, 200, 503)
    assert sent == 2, "the engine was sent a request while the quota's store did not answer"


def test_a_large_image_is_admitted_before_its_engine_is_sent_it(world, held, settings):
    from tests.images import data_url, image_bytes

    world.vision.large_image_threshold = 0  # every image is a large one, served by the large pool
    world.vision.save()
    Quota.objects.create(tenant=world.alice, period="day", total_tokens=QUOTA, concurrent_large_images=1)
    engine = Engine()
    engine.go.set()
    request = {"model": world.vision.name, "max_tokens": 20, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image_bytes(64, 64, "PNG"), "image/png")}}]}]}

    async def scenario():
        await engine.start(world.vision, pool="large")
        asking = _ask(world.alice_key, request)
        done, _ = await asyncio.wait({asyncio.ensure_future(engine.arrived.wait())}, timeout=1)
        sent_before_admitted = bool(done)
        answer = await _admitted_then(held, engine, asking)
        return sent_before_admitted, answer

    sent_before_admitted, answer = async_to_sync(scenario)()
    assert not sent_before_admitted, "a large image was sent to its engine before Redis admitted it"
    assert answer.status_code == 200, answer.text


def test_a_request_whose_first_engine_cannot_be_reached_goes_to_another_once_admitted(world, held, settings):
    from tests.system.harness import free_port

    Quota.objects.create(tenant=world.alice, period="day", total_tokens=QUOTA)
    _register(world.text, free_port())  # nothing listens there; the least loaded, so tried first
    engine = Engine()
    engine.go.set()

    async def scenario():
        await engine.start(world.text, waiting=5)
        asking = _ask(world.alice_key)
        tried_before_admitted = await _answered_while_held(asking) or engine.arrived.is_set()
        answer = await _admitted_then(held, engine, asking)
        return tried_before_admitted, answer

    tried_before_admitted, answer = async_to_sync(scenario)()
    assert not tried_before_admitted, "another engine was tried before the admission was answered"
    assert answer.status_code == 200, answer.text
    [event] = stored()
    assert (event.status, event.instance_id) == ("ok", engine.instance.pk)  # the engine that did the work
    assert _journaled(settings) == {}
    assert _room(world) == QUOTA - (event.text_tokens + event.output_tokens)
