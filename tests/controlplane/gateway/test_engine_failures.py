"""When an engine fails part-way, the client gets a clear answer and nothing leaks: the
request is metered once, its quota reservation settled, its large-image slot freed."""

from __future__ import annotations

import json

import pytest

from controlplane.gateway.apps import current_process
from controlplane.metering.models import UsageEvent
from controlplane.tenants.models import Quota
from tests.controlplane.gateway.conftest import ingested
from tests.engines import dies_mid_body, read_request, with_raw_engine
from tests.images import data_url, image_bytes

pytestmark = pytest.mark.django_db(transaction=True)


async def dies_mid_stream(reader, writer):
    await read_request(reader)
    chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hel"}}]}
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    line = b"data: " + json.dumps(chunk).encode() + b"\n\n"
    writer.write(hex(len(line))[2:].encode() + b"\r\n" + line + b"\r\n")
    await writer.drain()
    writer.close()


def _large_image_request(**extra):
    # A PNG, which the gateway re-encodes before sending: these engines answer, and break, at
    # once, where a JPEG sent as it came would be answered only once its check passed, and what
    # the engine sent before closing would be gone by then (aiohttp raises the break first).
    return {"model": "vlm-lite", "max_tokens": 5, **extra, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image_bytes(640, 480, "PNG"), "image/png")}}]}]}


@pytest.mark.accounting
def test_an_answer_cut_off_is_a_502_metered_once_and_frees_the_large_image_slot(world, ledger_mode):
    world.vision.large_image_threshold = 0  # every image request is "large"
    world.vision.save()
    Quota.objects.create(tenant=world.alice, concurrent_large_images=1, total_tokens=10**9)
    (first, _), (second, _) = with_raw_engine(world, dies_mid_body, _large_image_request())
    assert (first, second) == (502, 502)  # the second is not refused: the slot came back
    ingested()
    events = UsageEvent.objects.filter(tenant=world.alice)
    assert [(e.status, e.http_status, e.cost, e.error_stage, e.error_code) for e in events] == \
        [("error", 502, 0, "engine", "engine_error")] * 2
    assert not any(current_process().engines.outstanding.values())


def test_a_stream_the_engine_drops_ends_with_an_error_event(world):
    (status, text), _ = with_raw_engine(world, dies_mid_stream, _large_image_request(stream=True))
    assert status == 200
    events = [line[6:] for line in text.decode().split("\n\n") if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "hel"
    assert json.loads(events[-1])["error"]["code"] == "engine_error"
    recorded = UsageEvent.objects.filter(tenant=world.alice).order_by("created_at").first()
    assert (recorded.status, recorded.http_status, recorded.error_stage, recorded.error_code) == \
        ("error", 502, "relay", "engine_error")
