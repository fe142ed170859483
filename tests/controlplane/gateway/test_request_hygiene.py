"""What a tenant cannot smuggle past the gateway, and what it cannot make the gateway lose."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.test import AsyncClient
from django.utils import timezone

from controlplane.fleet.models import EngineInstance, Node
from controlplane.gateway.apps import current_process
from controlplane.gateway.prepare import Prepared, RequestInvalid, TierSpec, prepare, validate_body
from controlplane.imaging.policy import Policy
from controlplane.metering.models import UsageEvent
from tests.engines import simulator
from tests.images import data_url, image_bytes

pytestmark = pytest.mark.django_db

VISION = TierSpec(id=1, name="vlm", family="qwen2_5_vl", kind="vision", policy=Policy(),
                  processor_options={"min_pixels": 3136, "max_pixels": 1003520}, large_image_threshold=4096,
                  max_output_tokens=1000, price_plan_id=1, max_model_len=4096)


def _post(client, key, body):
    raw = body if isinstance(body, bytes) else json.dumps(body)
    return client.post("/v1/chat/completions", data=raw, content_type="application/json",
                       HTTP_AUTHORIZATION=f"Bearer {key}")


@pytest.mark.parametrize("part, code", [
    ({"image_url": {"url": "http://169.254.169.254/"}}, "invalid_request"),  # no type: vLLM would still fetch it
    ({"uuid": "someone-elses-image"}, "invalid_request"),
    ({"type": "video_url", "video_url": {"url": "http://example.com/v.mp4"}}, "unsupported_content_type"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "unsupported_content_type"),
    ({"type": "image_embeds", "image_embeds": "AAAA"}, "unsupported_content_type"),
    ({"type": "text", "text": "hi", "uuid": "x"}, "invalid_request"),
])
def test_content_parts_other_than_text_and_images_are_refused(client, world, part, code):
    response = _post(client, world.alice_key, {"model": "vlm-lite",
                                               "messages": [{"role": "user", "content": [part]}]})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == code


@pytest.mark.parametrize("field", ["mm_processor_kwargs", "chat_template", "priority", "cache_salt",
                                   "request_id", "add_generation_prompt"])
def test_engine_options_a_tenant_could_steer_with_are_refused(client, world, field):
    response = _post(client, world.alice_key, {"model": "text", field: {"min_pixels": 10**9},
                                               "messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field


def test_deeply_nested_json_is_a_400(client, world):
    # Deeper than the parser goes, within the objects and arrays a body may hold.
    deep = b'{"model": "text", "messages": [{"role": "user", "content": "x"}], "metadata": ' + b"[" * 5_000
    response = _post(client, world.alice_key, deep + b"]" * 5_000 + b"}")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


def test_the_engine_receives_images_without_client_uuids_and_a_bounded_max_tokens():
    body = {"model": "vlm", "messages": [{"role": "user", "content": [
        {"type": "image_url", "uuid": "alias-of-another-tenant",
         "image_url": {"url": data_url(image_bytes(64, 64)), "detail": "high", "uuid": "x"}}]}]}
    validate_body(body)
    prepared: Prepared = async_to_sync(prepare)(body, VISION, max_image_bytes=10**7)
    part = prepared.body["messages"][0]["content"][0]
    assert part == {"type": "image_url", "image_url": {"url": prepared.images[0].image.data_url()}}
    assert prepared.body["max_tokens"] == 1000  # the tier's limit when the client sets none


def test_max_tokens_never_runs_past_the_context():
    body = {"model": "vlm", "messages": [{"role": "user", "content": "word " * 3500}]}
    prepared = async_to_sync(prepare)(body, VISION, max_image_bytes=10**7)
    assert prepared.body["max_tokens"] == VISION.max_model_len - prepared.text_tokens < 1000
    with pytest.raises(RequestInvalid, match="context"):
        async_to_sync(prepare)({"model": "vlm", "messages": [{"role": "user", "content": "word " * 5000}]},
                               VISION, max_image_bytes=10**7)


@pytest.mark.django_db(transaction=True)
def test_a_client_that_leaves_before_the_engine_answers_is_metered_and_frees_the_instance(world):
    # An engine that takes ~2 s to answer; the client gives up once the engine runs its request.
    with simulator(name="text", family="qwen2", images=None, extra=("--sim-decode-ms-per-token", "100")) as port:
        node = Node.objects.create(name="slow", queue="node.slow", last_seen_at=timezone.now())
        instance = EngineInstance.objects.create(tier=world.text, node=node, port=port, actual_state="running",
                                                 healthy=True, last_health_at=timezone.now())

        @async_to_sync
        async def leave_early():
            request = asyncio.ensure_future(AsyncClient().post(
                "/v1/chat/completions", content_type="application/json",
                data=json.dumps({"model": "text", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}),
                headers={"Authorization": f"Bearer {world.alice_key}"}))
            async with httpx.AsyncClient() as engine:
                for _ in range(250):
                    metrics = (await engine.get(f"http://127.0.0.1:{port}/metrics")).text.splitlines()
                    if any(line.startswith("vllm:num_requests_running") and float(line.split()[-1]) >= 1
                           for line in metrics):
                        break
                    await asyncio.sleep(0.02)
                else:
                    raise AssertionError("the engine never ran the request")
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
            for _ in range(100):  # the usage record is written in the background
                event = await sync_to_async(UsageEvent.objects.filter(tenant=world.alice).first)()
                if event is not None:
                    return event
                await asyncio.sleep(0.05)

        event = leave_early()
    assert event is not None and event.status == "aborted"
    assert event.instance_id == instance.pk
    assert current_process().engines.outstanding[instance.pk] == 0


def test_engines_refuse_callers_without_the_gateways_key(client, routed_with_key):
    import httpx

    port, world = routed_with_key
    direct = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                        json={"model": "vlm-lite", "messages": [{"role": "user", "content": "x"}]})
    assert direct.status_code == 401
    through = _post(client, world.alice_key, {"model": "vlm-lite", "messages": [{"role": "user", "content": "x"}]})
    assert through.status_code == 200


@pytest.fixture
def routed_with_key(world, monkeypatch):
    instance = EngineInstance(tier=world.vision)  # its key, generated as for any instance
    monkeypatch.setenv("VLLM_API_KEY", instance.api_key)
    with simulator(name="vlm-lite") as port:
        monkeypatch.delenv("VLLM_API_KEY")
        node = Node.objects.create(name="keyed", queue="node.keyed", last_seen_at=timezone.now())
        instance.node, instance.port, instance.actual_state = node, port, "running"
        instance.healthy, instance.last_health_at = True, timezone.now()
        instance.save()
        yield port, world


@pytest.mark.parametrize("extra, message", [
    ({"ignore_eos": "yes"}, "ignore_eos must be a boolean"),
    ({"min_tokens": -1}, "min_tokens must be a non-negative integer"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens 50 exceeds max_tokens 10"),
])
def test_vllm_output_length_controls_are_checked(extra, message):
    body = {"model": "text", "messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(RequestInvalid, match=message):
        validate_body(body)
    validate_body({"model": "text", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True,
                   "min_tokens": 5, "max_tokens": 10})  # what load tests send is accepted
