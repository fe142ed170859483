"""An engine that stops answering: what waits on it is cut off as soon as supervision finds
it hung, not at the upstream timeout minutes later."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.utils import timezone

from controlplane.fleet.models import EngineInstance, Node
from controlplane.gateway import handlers
from controlplane.gateway.http import Request
from controlplane.metering.models import UsageEvent
from tests.controlplane.gateway.calls import post
from tests.engines import read_request

pytestmark = pytest.mark.django_db(transaction=True)
STARTED_STREAM = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def never_answers(reader, writer):
    await read_request(reader)
    await asyncio.sleep(3600)


async def hangs_mid_stream(reader, writer):
    await read_request(reader)
    chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hel"}}]}
    line = b"data: " + json.dumps(chunk).encode() + b"\n\n"
    writer.write(STARTED_STREAM + hex(len(line))[2:].encode() + b"\r\n" + line + b"\r\n")
    await writer.drain()
    await asyncio.sleep(3600)


def _through_a_hung_engine(world, handler, body):
    """Send `body` to an engine that hangs; a second later supervision marks it unhealthy."""
    @async_to_sync
    async def run():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        def register():
            node = Node.objects.create(name="hung", address="127.0.0.1", queue="node.hung", last_seen_at=timezone.now())
            return EngineInstance.objects.create(tier=world.text, node=node, port=port, actual_state="running",
                                                 healthy=True, last_health_at=timezone.now())

        instance = await sync_to_async(register)()

        async def supervision_finds_it_hung():
            await asyncio.sleep(1)
            await sync_to_async(EngineInstance.objects.filter(pk=instance.pk).update)(
                actual_state="unhealthy", healthy=False)

        marking = asyncio.ensure_future(supervision_finds_it_hung())
        started = time.monotonic()
        response = await handlers.chat_completions(
            Request("POST", {"authorization": f"Bearer {world.alice_key}"}, json.dumps(body).encode()))
        text = b"".join([c async for c in response.stream]) if response.stream else response.body
        if response.on_close:
            await response.on_close()
        await marking
        server.close()
        return response.status, text, time.monotonic() - started

    return run()


def test_a_request_waiting_on_an_engine_found_hung_is_answered_at_once(world, settings):
    settings.GATEWAY_ENGINE_WATCH_S = 0.2
    body = {"model": "text", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    status, text, took = _through_a_hung_engine(world, never_answers, body)
    assert status == 503 and took < 10  # no other engine to fail over to; not the 300 s timeout
    assert json.loads(text)["error"]["code"] == "engine_unavailable"
    [event] = UsageEvent.objects.filter(tenant=world.alice)
    assert (event.status, event.cost) == ("error", 0)


def test_a_stream_whose_engine_is_found_hung_ends_with_an_error_event(world, settings):
    settings.GATEWAY_ENGINE_WATCH_S = 0.2
    body = {"model": "text", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    status, text, took = _through_a_hung_engine(world, hangs_mid_stream, body)
    assert status == 200 and took < 10
    events = [line[6:] for line in text.decode().split("\n\n") if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "hel"
    assert json.loads(events[-1])["error"]["code"] == "engine_error"


def test_a_request_the_gateway_itself_fails_on_is_still_in_the_usage(client, world, monkeypatch):
    from controlplane.gateway import handlers as gateway_handlers
    
    async def broken(*_args, **_kwargs):
        raise RuntimeError("a bug in preparing the request")

    monkeypatch.setattr(gateway_handlers, "prepare", broken)  # stands in for any bug past the tier
    response = post(client, world.alice_key, {"model": "text", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 500 and response.json()["error"]["code"] == "internal_error"
    event = UsageEvent.objects.get(request_id=response["x-request-id"])
    assert (event.status, event.http_status, event.cost) == ("error", 500, 0)
