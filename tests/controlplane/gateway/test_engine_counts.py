"""The engine's own count of image tokens is kept beside the gateway's on every usage event;
a disagreement is flagged and counted, never silently billed."""

from __future__ import annotations

import json

import pytest

from controlplane.gateway.apps import current_process
from controlplane.imaging.tokens import count_image_tokens
from controlplane.metering.models import UsageEvent
from tests.engines import read_request, with_raw_engine
from tests.images import data_url, image_bytes

pytestmark = pytest.mark.django_db(transaction=True)

# What the world's vision tier makes of a 640x480 image (its policy leaves it as it is).
GATEWAY_TOKENS = count_image_tokens("qwen2_5_vl", 640, 480, min_pixels=3136, max_pixels=1003520)
FEATURES = GATEWAY_TOKENS - 2  # vLLM counts the placeholders, not <|vision_start|>/<|vision_end|>


def engine_reporting(image_count, cached_tokens=0, *, sglang=False):
    async def handler(reader, writer):
        await read_request(reader)
        details = {"cached_tokens": cached_tokens,
                   "multimodal_tokens": None if image_count is None else {"image": image_count}}
        if sglang:  # SGLang counts the same placeholders, under its own key (usage_processor.py)
            details = {"cached_tokens": cached_tokens, "image_tokens": image_count}
        body = json.dumps({"id": "c", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": GATEWAY_TOKENS + 20, "completion_tokens": 1,
                      "total_tokens": GATEWAY_TOKENS + 21, "prompt_tokens_details": details}}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    return handler


def _image_request():
    return {"model": "vlm-lite", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": data_url(image_bytes(640, 480))}}]}]}


def test_it_keeps_the_engines_image_count_beside_its_own(world):
    (status, body), _ = with_raw_engine(world, engine_reporting(FEATURES), _image_request())
    assert status == 200
    details = json.loads(body)["usage"]["prompt_tokens_details"]
    # image_tokens: every prompt position the image takes, what it is billed for; vLLM's own
    # count of its placeholders is passed through beside it.
    assert (details["image_tokens"], details["multimodal_tokens"]) == (GATEWAY_TOKENS, {"image": FEATURES})
    event = UsageEvent.objects.filter(tenant=world.alice).first()
    assert (event.image_tokens, event.engine_image_tokens, event.image_tokens_disagree) == (
        GATEWAY_TOKENS, FEATURES, False)


def test_sglangs_image_count_is_read_from_its_own_usage_field(world):
    (status, body), _ = with_raw_engine(world, engine_reporting(FEATURES, sglang=True), _image_request())
    assert status == 200
    # the client sees the gateway's count, as from any engine
    assert json.loads(body)["usage"]["prompt_tokens_details"]["image_tokens"] == GATEWAY_TOKENS
    event = UsageEvent.objects.filter(tenant=world.alice).first()
    assert (event.image_tokens, event.engine_image_tokens, event.image_tokens_disagree) == (
        GATEWAY_TOKENS, FEATURES, False)


def test_an_engine_that_counts_otherwise_is_flagged_counted_and_billed_at_the_gateways_count(world):
    before = current_process().counters.snapshot()[2].get("vlm-lite", 0)
    with_raw_engine(world, engine_reporting(FEATURES + 30), _image_request())
    events = list(UsageEvent.objects.filter(tenant=world.alice))
    assert [(e.engine_image_tokens, e.image_tokens_disagree, e.image_tokens) for e in events] == [
        (FEATURES + 30, True, GATEWAY_TOKENS)] * 2
    assert all(e.cost > 0 and e.rated for e in events)
    assert current_process().counters.snapshot()[2]["vlm-lite"] == before + 2


def test_an_engine_that_reports_no_image_count_for_an_image_request_disagrees(world):
    with_raw_engine(world, engine_reporting(None), _image_request())
    event = UsageEvent.objects.filter(tenant=world.alice).first()
    assert (event.engine_image_tokens, event.image_tokens_disagree) == (None, True)


def test_an_image_partly_inside_the_engines_cached_prefix_counts_its_share(world):
    from controlplane.textcount import image_positions

    start = image_positions(_image_request()["messages"], [GATEWAY_TOKENS])[0]  # no tokenizer: the estimate
    with_raw_engine(world, engine_reporting(FEATURES, cached_tokens=start + 100), _image_request())
    event = UsageEvent.objects.filter(tenant=world.alice).first()
    line = event.images.get()
    assert (event.cached_image_tokens, line.cached_tokens, line.cached) == (100, 100, True)
    assert event.cache_savings > 0 and event.prompt_estimated
