"""The gateway in-process (Django test client) in front of real simulator engines."""

from __future__ import annotations

import asyncio
import json

import pytest
from asgiref.sync import async_to_sync
from django.test import AsyncClient
from django.utils import timezone

from controlplane.catalog.models import ModelTier
from controlplane.fleet.models import EngineInstance, Node
from controlplane.gateway import state
from controlplane.metering.models import UsageEvent
from controlplane.tenants.services import api_key_revoke
from tests.controlplane.gateway.calls import error_of, image_message, post, post_and_read_stream
from tests.engines import simulator
from tests.factories import VisionTierFactory
from tests.images import data_url, image_bytes, noise_bytes, serve_files


@pytest.mark.django_db
class TestAuthentication:
    def test_it_refuses_a_missing_key(self, client, world):
        response = client.get("/v1/models")
        assert response.status_code == 401
        assert error_of(response)["code"] == "invalid_api_key"

    def test_it_refuses_a_wrong_key(self, client, world):
        response = client.get("/v1/models", HTTP_AUTHORIZATION="Bearer vlm-0000-nope")
        assert response.status_code == 401

    def test_it_refuses_a_revoked_key(self, client, world):
        from controlplane.tenants.models import ApiKey

        api_key_revoke(api_key=ApiKey.objects.get(name="alice-main"))
        response = client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {world.alice_key}")
        assert response.status_code == 401


@pytest.mark.django_db
def test_models_lists_auto_and_the_tiers_a_key_may_use(client, world):
    world.bob.allowed_tiers.set([world.text])
    alice = client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {world.alice_key}").json()
    bob = client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {world.bob_key}").json()
    assert [m["id"] for m in alice["data"]] == ["auto", "text", "vlm-lite"]
    assert [m["id"] for m in bob["data"]] == ["auto", "text"]


@pytest.mark.django_db
def test_it_forwards_an_image_request_and_records_its_usage(client, routed):
    response = post(client, routed.alice_key, {"model": "vlm-lite", "max_tokens": 16,
                                               "messages": image_message(data_url(image_bytes(1920, 1080)))})
    assert response.status_code == 200
    body = response.json()
    assert body["usage"]["prompt_tokens_details"]["image_tokens"] == 1224
    event = UsageEvent.objects.get(request_id=response["x-request-id"])
    assert event.tenant == routed.alice
    assert (event.image_count, event.image_tokens, event.output_tokens) == (
        1, 1224, body["usage"]["completion_tokens"])
    assert event.text_tokens == body["usage"]["prompt_tokens"] - 1224
    # Where its time went, for the request log: not streamed, so no time to first token.
    assert event.prepare_ms is not None and event.queue_ms is not None and event.ttft_ms is None
    assert event.prepare_ms + event.queue_ms <= event.latency_ms


@pytest.mark.django_db
def test_low_detail_costs_fewer_image_tokens(client, routed):
    url = data_url(image_bytes(1920, 1080))
    high = post(client, routed.alice_key, {"model": "vlm-lite", "messages": image_message(url, "high")})
    low = post(client, routed.alice_key, {"model": "vlm-lite", "messages": image_message(url, "low")})
    high_tokens = high.json()["usage"]["prompt_tokens_details"]["image_tokens"]
    low_tokens = low.json()["usage"]["prompt_tokens_details"]["image_tokens"]
    assert low_tokens < high_tokens / 3


@pytest.mark.django_db
def test_a_stream_ends_with_done_and_is_metered(client, routed):
    response, raw = post_and_read_stream(routed.alice_key, {
        "model": "text", "stream": True, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200
    body = raw.decode()
    events = [line[6:] for line in body.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any(c.get("usage") for c in chunks)  # the client did not ask for usage
    produced = sum(1 for c in chunks for ch in c["choices"] if ch["delta"].get("content"))
    event = UsageEvent.objects.get(request_id=response["x-request-id"])
    assert event.stream and event.output_tokens == produced == 5
    assert event.prepare_ms + event.queue_ms <= event.ttft_ms <= event.latency_ms


@pytest.mark.django_db
def test_auto_routes_text_to_the_text_tier(client, routed):
    response = post(client, routed.alice_key, {"model": "auto", "messages": [{"role": "user", "content": "hi"}]})
    assert response.json()["model"] == "text"


def _auto(client, key):
    return client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {key}").json()["data"][0]["resolves_to"]


@pytest.mark.django_db
def test_a_new_tier_whose_name_sorts_first_does_not_take_autos_traffic(client, routed):
    VisionTierFactory(name="aaa-vlm")  # enabled and priced: before, `auto` picked it by name
    assert _auto(client, routed.alice_key) == {"text": "text", "images": "vlm-lite"}
    response = post(client, routed.alice_key, {"model": "auto", "max_tokens": 2,
                                               "messages": image_message(data_url(image_bytes(64, 64)))})
    assert response.status_code == 200 and response.json()["model"] == "vlm-lite"


@pytest.mark.django_db
def test_auto_follows_the_tenants_own_default_before_the_marked_tier(client, world):
    big = VisionTierFactory(name="vlm-big")
    world.alice.default_image_tier = big
    world.alice.save()
    assert _auto(client, world.alice_key) == {"text": "text", "images": "vlm-big"}
    assert _auto(client, world.bob_key) == {"text": "text", "images": "vlm-lite"}
    world.alice.allowed_tiers.set([world.text, world.vision])  # its default is no longer its to use
    state.clear_caches()
    assert _auto(client, world.alice_key) == {"text": "text", "images": "vlm-lite"}


@pytest.mark.django_db
def test_with_no_default_set_auto_is_refused_with_a_message_saying_so(client, world):
    ModelTier.objects.update(default_for_text=False, default_for_images=False)
    response = post(client, world.alice_key, {"model": "auto", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 404
    assert error_of(response)["code"] == "model_not_found"
    assert "no default text model is set for this key" in error_of(response)["message"]
    assert _auto(client, world.alice_key) == {"text": None, "images": None}


@pytest.mark.django_db
def test_no_healthy_engine_is_a_503_with_retry_after(client, world):
    response = post(client, world.alice_key, {"model": "text", "messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 503
    assert response["Retry-After"]
    assert error_of(response)["code"] == "engine_unavailable"


@pytest.mark.django_db
def test_a_dead_engine_is_skipped_for_a_live_one(client, routed):
    node = Node.objects.get(name="local")
    # A second instance whose port has nothing listening: the gateway must retry elsewhere.
    from tests.system.harness import free_port

    EngineInstance.objects.create(tier=routed.text, node=node, port=free_port(),
                                  actual_state="running", healthy=True, last_health_at=timezone.now())
    for _ in range(4):
        response = post(client, routed.alice_key, {"model": "text", "messages": [{"role": "user", "content": "x"}]})
        assert response.status_code == 200


@pytest.mark.django_db
@pytest.mark.parametrize("body, status, code", [
    (b"{nope", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "missing_model"),
    ({"model": "text", "messages": []}, 400, "invalid_request"),
    ({"model": "text", "messages": [{"content": "x"}]}, 400, "invalid_request"),
    ({"model": "text", "n": 3, "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request"),
    ({"model": "text", "max_tokens": 10**6, "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request"),
    ({"model": "text", "max_tokens": "ten", "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request"),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "model_not_found"),
])
def test_bad_requests_get_a_clear_4xx(client, world, body, status, code):
    response = post(client, world.alice_key, body)
    assert response.status_code == status
    assert error_of(response)["code"] == code


_IMAGES = {"small": data_url(image_bytes(64, 48)), "megabytes": data_url(noise_bytes(900, 600), "image/png")}


@pytest.mark.django_db
@pytest.mark.parametrize("size", _IMAGES)
def test_an_integer_past_64_bits_is_forwarded_whatever_the_bodys_size(client, routed, size):
    assert size == "small" or len(_IMAGES[size]) > 2**20
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 2**70}}}
    response = post(client, routed.alice_key, {
        "model": "vlm-lite", "max_tokens": 4, "messages": image_message(_IMAGES[size]), "tool_choice": "none",
        "tools": [{"type": "function", "function": {"name": "count", "parameters": schema}}]})
    assert response.status_code == 200, response.content
    assert UsageEvent.objects.get(request_id=response["x-request-id"]).image_count == 1


@pytest.mark.django_db
@pytest.mark.parametrize("size", _IMAGES)
def test_a_lone_surrogate_is_invalid_json_whatever_the_bodys_size(client, world, size):
    body = json.dumps({"model": "vlm-lite", "messages": image_message(_IMAGES[size])})
    response = post(client, world.alice_key, body.replace('"what is this"', '"what \\ud800 is this"').encode())
    assert (response.status_code, error_of(response)["code"]) == (400, "invalid_json")


@pytest.mark.django_db
def test_a_tier_outside_the_keys_tenant_allowance_is_a_403(client, world):
    world.bob.allowed_tiers.set([world.text])
    response = post(client, world.bob_key, {"model": "vlm-lite", "messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 403
    assert error_of(response)["code"] == "model_not_allowed"


@pytest.mark.django_db
@pytest.mark.parametrize("url, code", [
    ("http://127.0.0.1/cat.png", "unsafe_image_url"),
    ("http://169.254.169.254/latest/meta-data/", "unsafe_image_url"),
    ("http://2130706433/cat.png", "unsafe_image_url"),
    ("http://example.com\\@127.0.0.1/cat.png", "unsafe_image_url"),
    ("file:///etc/passwd", "invalid_image_url"),
    ("data:image/png;base64,!!!!", "invalid_image_url"),
    ("data:image/png;base64," + "QUJD" * 8, "unsupported_image_format"),
    (data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml"), "unsupported_image_format"),
    (data_url(image_bytes(64, 64)[:40]), "corrupt_image"),
])
def test_unacceptable_images_are_refused_with_the_reason(client, world, url, code):
    response = post(client, world.alice_key, {"model": "vlm-lite", "messages": image_message(url)})
    assert response.status_code == 400
    assert error_of(response)["code"] == code
    assert "image 1" in error_of(response)["message"]


@pytest.mark.django_db
def test_too_many_images_and_images_to_a_text_tier_are_refused(client, world):
    limit = world.vision.resolution_policy.max_images_per_request
    parts = [{"type": "image_url", "image_url": {"url": data_url(image_bytes(32, 32))}}] * (limit + 1)
    many = post(client, world.alice_key, {"model": "vlm-lite", "messages": [{"role": "user", "content": parts}]})
    assert many.status_code == 400 and error_of(many)["code"] == "too_many_images"
    text = post(client, world.alice_key, {"model": "text", "messages": image_message(data_url(image_bytes(32, 32)))})
    assert text.status_code == 400 and error_of(text)["code"] == "images_not_supported"


@pytest.mark.django_db
def test_an_oversized_body_is_a_413(client, world, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    settings.GATEWAY_MAX_BODY_BYTES = 10_000
    response = post(client, world.alice_key, {"model": "text", "messages": [{"role": "user", "content": "x" * 20_000}]})
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"


@pytest.mark.django_db
def test_unknown_endpoints_and_methods_get_openai_errors(client, world):
    assert error_of(client.get("/v1/embeddings"))["code"] == "unknown_url"
    response = client.get("/v1/chat/completions", HTTP_AUTHORIZATION=f"Bearer {world.alice_key}")
    assert response.status_code == 405


@pytest.mark.django_db
def test_an_image_url_is_fetched_normalised_and_counted(client, routed, settings):
    settings.GATEWAY_TRUSTED_IMAGE_NETWORKS = ["127.0.0.1/32"]  # the test's image server
    with serve_files({"/photo.jpg": (image_bytes(1920, 1080), "image/jpeg")}) as base:
        response = post(client, routed.alice_key, {"model": "vlm-lite", "max_tokens": 8,
                                                   "messages": image_message(f"{base}/photo.jpg")})
    assert response.status_code == 200, response.content
    assert response.json()["usage"]["prompt_tokens_details"]["image_tokens"] == 1224


@pytest.mark.django_db
def test_a_tier_can_refuse_image_urls_or_limit_their_domains(client, world, settings):
    settings.GATEWAY_TRUSTED_IMAGE_NETWORKS = ["127.0.0.1/32"]
    world.vision.engine_settings = {**world.vision.engine_settings, "allowed_media_domains": ["images.example.com"]}
    world.vision.save()
    with serve_files({"/a.png": (image_bytes(64, 64, "PNG"), "image/png")}) as base:
        response = post(client, world.alice_key, {"model": "vlm-lite", "messages": image_message(f"{base}/a.png")})
    assert response.status_code == 400
    assert "allowed domains" in error_of(response)["message"]

    from controlplane.gateway import state

    world.vision.engine_settings = {**world.vision.engine_settings, "fetch_image_urls": False}
    world.vision.save()
    state.clear_caches()
    response = post(client, world.alice_key, {"model": "vlm-lite",
                                              "messages": image_message("https://images.example.com/a.png")})
    assert response.status_code == 400
    assert "base64 data URL" in error_of(response)["message"]


@pytest.mark.django_db
def test_a_long_image_reaches_the_engine_as_tiles_and_is_metered_per_tile(client, routed):
    policy = routed.vision.resolution_policy
    policy.max_aspect_ratio = 4
    policy.save()
    receipt = data_url(image_bytes(400, 4000, "PNG"), "image/png")  # aspect 10 -> 3 tiles
    response = post(client, routed.alice_key, {"model": "vlm-lite", "messages": image_message(receipt)})
    assert response.status_code == 200, response.content
    event = UsageEvent.objects.get(request_id=response["x-request-id"])
    assert event.image_count == 3
    tiles = list(event.images.order_by("position"))
    assert all(t.height <= 4 * t.width for t in tiles)
    assert [(t.tile, t.tiles) for t in tiles] == [(0, 3), (1, 3), (2, 3)]  # one picture, cut in three
    # The engine counted three images too: its prompt grew by exactly the tiles' tokens.
    body = response.json()
    assert body["usage"]["prompt_tokens_details"]["image_tokens"] == sum(t.tokens for t in tiles)
    assert "image 3" in body["choices"][0]["message"]["content"]


@pytest.mark.django_db
def test_an_image_in_a_reused_prefix_is_metered_as_cached(client, world):
    with simulator(name="vlm-lite", extra=("--enable-prefix-caching",)) as port:
        node = Node.objects.create(name="cache", queue="node.cache", last_seen_at=timezone.now())
        EngineInstance.objects.create(tier=world.vision, node=node, port=port, actual_state="running",
                                      healthy=True, last_health_at=timezone.now())
        first_turn = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(image_bytes(1024, 768))}},
            {"type": "text", "text": "What is in this picture?"}]}]
        first = post(client, world.alice_key, {"model": "vlm-lite", "messages": first_turn})
        follow_up = first_turn + [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                                  {"role": "user", "content": "And what colour is it?"}]
        second = post(client, world.alice_key, {"model": "vlm-lite", "messages": follow_up})
    first_image = UsageEvent.objects.get(request_id=first["x-request-id"]).images.get()
    second_event = UsageEvent.objects.get(request_id=second["x-request-id"])
    assert not first_image.cached
    assert second_event.cached_tokens >= second_event.images.get().tokens
    assert second_event.images.get().cached
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == second_event.cached_tokens


def test_an_engine_speaking_sglang_is_metered_as_one_speaking_vllm(client, world):
    with simulator(name="vlm-lite", extra=("--enable-prefix-caching", "--api", "sglang")) as port:
        node = Node.objects.create(name="sglang", queue="node.sglang", last_seen_at=timezone.now())
        EngineInstance.objects.create(tier=world.vision, node=node, port=port, actual_state="running",
                                      healthy=True, last_health_at=timezone.now())
        turn = image_message(data_url(image_bytes(1920, 1080)))
        first = post(client, world.alice_key, {"model": "vlm-lite", "max_tokens": 4, "messages": turn})
        again, streamed = post_and_read_stream(world.alice_key, {
            "model": "vlm-lite", "max_tokens": 4, "messages": turn, "stream": True,
            "stream_options": {"include_usage": True}})
        streamed = streamed.decode()
    assert first.status_code == again.status_code == 200
    assert first.json()["usage"]["prompt_tokens_details"]["image_tokens"] == 1224  # the gateway's count
    events = [UsageEvent.objects.get(request_id=r["x-request-id"]) for r in (first, again)]
    # SGLang's own count of the placeholders (its usage's image_tokens) agrees with the gateway's
    assert [(e.image_tokens, e.engine_image_tokens, e.image_tokens_disagree) for e in events] == [
        (1224, 1222, False)] * 2
    assert events[1].cached_tokens >= 1224 and events[1].images.get().cached  # SGLang's cache report
    assert f'"cached_tokens":{events[1].cached_tokens}' in streamed.replace(" ", "")


@pytest.mark.django_db
def test_with_priority_scheduling_text_runs_ahead_of_images(client, world):
    world.vision.engine_settings = {**world.vision.engine_settings, "scheduling_policy": "priority"}
    world.vision.save()
    # One sequence slot and a slow decode: requests queue, and the engine orders the queue.
    # Each image holds the slot ~0.6 s: the text, sent 50 ms after them, reaches the queue
    # before the first one ends even when the gateway prepares the images slowly.
    extra = ("--scheduling-policy", "priority", "--max-num-seqs", "1", "--sim-decode-ms-per-token", "60")
    with simulator(name="vlm-lite", extra=extra) as port:
        node = Node.objects.create(name="prio", queue="node.prio", last_seen_at=timezone.now())
        EngineInstance.objects.create(tier=world.vision, node=node, port=port, actual_state="running",
                                      healthy=True, last_health_at=timezone.now())

        @async_to_sync
        async def burst():
            image = {"model": "vlm-lite", "max_tokens": 10, "messages": image_message(data_url(image_bytes(256, 256)))}
            text = {"model": "vlm-lite", "max_tokens": 10, "messages": [{"role": "user", "content": "quick"}]}
            finished = []

            async def send(name, body, delay):
                await asyncio.sleep(delay)
                response = await AsyncClient().post("/v1/chat/completions", data=json.dumps(body),
                                                    content_type="application/json",
                                                    headers={"Authorization": f"Bearer {world.alice_key}"})
                assert response.status_code == 200, response.content
                finished.append(name)

            await asyncio.gather(*(send(f"image{n}", image, 0.0) for n in range(4)), send("text", text, 0.05))
            return finished

        order = burst()
    assert order.index("text") <= 1  # it overtook the images queued before it


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


def test_a_tier_without_a_tool_call_parser_refuses_tools_with_a_clear_400(client, routed):
    response = post(client, routed.alice_key, {"model": "vlm-lite", "tools": TOOLS,
                                               "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == ("tools_not_supported", "tools")
    # tool_choice "none" asks for no tool call: vLLM serves it without a parser.
    allowed = post(client, routed.alice_key, {"model": "vlm-lite", "tools": TOOLS, "tool_choice": "none",
                                              "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert allowed.status_code == 200


def test_a_tier_whose_engine_has_a_tool_call_parser_forwards_tools(client, routed):
    routed.vision.engine_settings = {**routed.vision.engine_settings, "tool_call_parser": "hermes"}
    routed.vision.save()
    response = post(client, routed.alice_key, {"model": "vlm-lite", "tools": TOOLS, "max_tokens": 2,
                                               "messages": [{"role": "user", "content": "hi"}]})
    # Forwarded: the engine behind it (a simulator launched without the parser) refuses it.
    assert response.status_code == 400 and "tool-call-parser" in response.json()["error"]["message"]


def test_a_tier_without_a_price_in_effect_is_not_served(client, routed):
    # The models refuse to leave a live tier without a price; the gateway refuses to serve one
    # all the same (a plan whose rate starts next week, set round the models).
    from controlplane.catalog.models import PricePlan, PriceRate

    later = PricePlan.objects.create(name="from-next-week")
    PriceRate.objects.create(plan=later, effective_from=timezone.now() + timezone.timedelta(days=7))
    ModelTier.objects.filter(pk=routed.vision.pk).update(price_plan=later)
    response = post(client, routed.alice_key, {"model": "vlm-lite", "messages": [{"role": "user", "content": "hi"}]})
    assert (response.status_code, response.json()["error"]["code"]) == (503, "model_not_priced")
    assert response["Retry-After"] == "60"


def test_a_conversation_with_tool_calls_and_null_content_is_laid_out_exactly_not_a_500(client, routed, tmp_path):
    """An assistant turn with tool calls and no content, tool results as parts, tools offered
    (tool_choice none: the engine runs no tool-call parser): the tier's own template lays it
    out as vLLM does; a template that fails on a request falls back to the estimate."""
    from django.core.management import call_command

    from controlplane.prompts import ChatTokenizer
    from workers.engines.cpu import tiny_model

    tiny_model.build_tokenizer(tmp_path)
    call_command("tier_tokenizer", "--tier", "vlm-lite", str(tmp_path))
    messages = [
        {"role": "user", "content": "What does a pear cost?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup_price", "arguments": '{"item": "pear"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "0.5 EUR"}]}]
    tools = [{"type": "function", "function": {"name": "lookup_price", "parameters": {"type": "object"}}}]
    response = post(client, routed.alice_key, {"model": "vlm-lite", "max_tokens": 5, "messages": messages,
                                                "tools": tools, "tool_choice": "none"})
    assert response.status_code == 200, response.content
    event = UsageEvent.objects.get(request_id=response["x-request-id"])
    qwen = ChatTokenizer((tmp_path / "tokenizer.json").read_text(), tiny_model.CHAT_TEMPLATE)
    assert event.prompt_estimated is False
    assert event.counted_prompt_tokens == qwen.layout(messages, [], markers=2, tools=tools).prompt_tokens
