"""The real vLLM (its CPU build, serving a tiny Qwen2.5-VL made at test time) behind the
gateway, launched and supervised by the node agent of the started system, as in production.

One engine serves every test here; the ones that kill, stop or drain it come last.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from controlplane.fleet.models import EngineEvent, EngineInstance, EngineMetricSample
from controlplane.imaging.tokens import engine_image_tokens
from controlplane.metering.models import UsageEvent
from tests.images import data_url, image_bytes, noise_bytes
from tests.system.conftest import REAL_TIER
from tests.system.harness import wait_for
from workers.supervision.liveness import scrape

pytestmark = [pytest.mark.system, pytest.mark.xdist_group("system")]


@pytest.fixture
def client(system, real_engine):
    return openai.OpenAI(base_url=f"{system.base_url}/v1", api_key=system.api_key, max_retries=0)


def metered(system_db, request_id):
    return wait_for(lambda: UsageEvent.objects.using(system_db).filter(request_id=request_id).first(),
                    timeout=20, what=f"the usage event of {request_id}")


def _content(*images, detail=None, text="What is in this picture?"):
    parts = [{"type": "text", "text": text}]
    for image in images:
        url = {"url": data_url(image)} if detail is None else {"url": data_url(image), "detail": detail}
        parts.append({"type": "image_url", "image_url": url})
    return [{"role": "user", "content": parts}]


def _ask(client, messages, **extra):
    raw = client.chat.completions.with_raw_response.create(model=REAL_TIER, messages=messages, max_tokens=4, **extra)
    return raw.parse(), raw.headers["x-request-id"]


CASES = {
    "hd photo": dict(images=[image_bytes(1920, 1080)]),
    "vga photo": dict(images=[image_bytes(640, 480)]),
    "tiny icon": dict(images=[image_bytes(40, 30)]),  # grown to the processor's minimum
    "portrait": dict(images=[image_bytes(750, 1334)]),
    "three images": dict(images=[image_bytes(800, 600), image_bytes(300, 300), image_bytes(1024, 200)]),
    "receipt cut into tiles": dict(images=[image_bytes(400, 12000)]),  # past the policy's aspect bound
    "low detail": dict(images=[image_bytes(1920, 1080)], detail="low"),
    # Decoded at half size, its resample and encode behind the decode (imaging/rows.py).
    "phone photo (12 MP)": dict(images=[image_bytes(4000, 3000)]),
    # A body of megabytes: its base64 decoded where it lies in the body (gateway/body.py).
    "grainy photo": dict(images=[noise_bytes(1600, 1200, "JPEG", quality=90)]),
}


@pytest.mark.parametrize("case", CASES)
def test_the_gateway_counts_image_tokens_as_the_real_engine_does(client, system_db, case):
    spec = CASES[case]
    completion, request_id = _ask(client, _content(*spec["images"], detail=spec.get("detail")))
    details = completion.usage.prompt_tokens_details
    event = metered(system_db, request_id)
    lines = list(event.images.order_by("position"))
    if case == "receipt cut into tiles":
        assert len(lines) > 1
    # vLLM counts each image's placeholders; the gateway also counts the two markers around
    # each image, which are prompt positions too. Both agree, image by image.
    assert details.multimodal_tokens == {"image": sum(engine_image_tokens("qwen2_5_vl", line.tokens) for line in lines)}
    assert details.image_tokens == event.image_tokens == sum(line.tokens for line in lines)
    assert (event.engine_image_tokens, event.image_tokens_disagree) == (details.multimodal_tokens["image"], False)
    assert event.text_tokens + event.image_tokens == completion.usage.prompt_tokens
    assert event.output_tokens == completion.usage.completion_tokens
    # The gateway counted the whole prompt before forwarding, with the tier's own tokenizer
    # and chat template (published by the node agent from the model it launched).
    assert (event.counted_prompt_tokens, event.prompt_estimated) == (completion.usage.prompt_tokens, False)


def test_the_gateway_lays_out_a_conversation_as_vllms_tokenize_does(client, system_db, real_engine):
    photo = image_bytes(640, 480)
    messages = [{"role": "system", "content": "You read receipts, briefly."},
                *_content(photo, text="What does this say?"),
                {"role": "assistant", "content": "It is a receipt from a café."},
                {"role": "user", "content": [{"type": "text", "text": "And the total, "},
                                             {"type": "text", "text": "in euros?"}]}]
    completion, request_id = _ask(client, messages)
    tokenized = _engine_call(real_engine, {"model": REAL_TIER, "messages": messages}, "/tokenize").json()
    event = metered(system_db, request_id)
    assert event.counted_prompt_tokens == tokenized["count"] == completion.usage.prompt_tokens
    assert event.prompt_estimated is False



def _text(text):
    return {"type": "text", "text": text}


def _picture(image, detail=None):
    url = {"url": data_url(image)} if detail is None else {"url": data_url(image), "detail": detail}
    return {"type": "image_url", "image_url": url}


PRICE_TOOL = [{"type": "function", "function": {"name": "lookup_price", "description": "The price of an item",
                                                "parameters": {"type": "object",
                                                               "properties": {"item": {"type": "string"}}}}}]
# Every shape of request the layout must get right, each checked against vLLM's /tokenize.
LAYOUTS = {
    "plain text": dict(messages=[{"role": "user", "content": "hello there"}]),
    "system, turns and split text": dict(messages=[
        {"role": "system", "content": "You read receipts, briefly."},
        {"role": "user", "content": [_text("What is "), _text("on it?")]},
        {"role": "assistant", "content": "A total."}, {"role": "user", "content": "Which?"}]),
    "developer turns": dict(messages=[
        {"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
        {"role": "developer", "content": [_text("Be polite.")]}]),
    "tool calls, null content and tools": dict(tools=PRICE_TOOL, messages=[
        {"role": "user", "content": "What does a pear cost?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup_price", "arguments": '{"item": "pear"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [_text("0.5"), _text("EUR")]}]),
    "an image alone": dict(messages=[{"role": "user", "content": [_picture(image_bytes(640, 480))]}]),
    "images across turns": dict(messages=[
        {"role": "system", "content": "Compare pictures."},
        {"role": "user", "content": [_text("First:"), _picture(image_bytes(800, 600)), _picture(image_bytes(300, 300))]},
        {"role": "assistant", "content": "Two pictures."},
        {"role": "user", "content": [_picture(image_bytes(1024, 200)), _text("and this one?")]}]),
    "a receipt cut into tiles": dict(messages=[{"role": "user", "content": [
        _text("Total?"), _picture(image_bytes(400, 12000))]}]),
    "low detail": dict(messages=[{"role": "user", "content": [_picture(image_bytes(1920, 1080), "low"), _text("?")]}]),
    "an image with tools offered": dict(tools=PRICE_TOOL, messages=[
        {"role": "user", "content": [_text("Price of this?"), _picture(image_bytes(1280, 720))]}]),
}


@pytest.mark.parametrize("case", LAYOUTS)
def test_every_prompt_the_gateway_lays_out_is_vllms_token_for_token(system_db, real_engine, case):
    """The gateway's count and each image's start, made before forwarding with the tier's own
    tokenizer and template, against vLLM's own tokenization of what it forwards."""
    from asgiref.sync import async_to_sync

    from controlplane.gateway.prepare import TierSpec, prepare
    from controlplane.imaging.tokens import processor_options
    from controlplane.prompts import ChatTokenizer

    tier = real_engine.tier
    model = Path(tier.model_id)
    policy = tier.image_policy()
    spec = TierSpec(id=tier.pk, name=tier.name, family=tier.family, kind=tier.kind, policy=policy,
                    processor_options=processor_options(tier.family, min_pixels=policy.min_pixels,
                                                        max_pixels=policy.max_pixels),
                    large_image_threshold=tier.large_image_threshold, max_output_tokens=100, price_plan_id=0,
                    tokenizer=ChatTokenizer((model / "tokenizer.json").read_text(),
                                            json.loads((model / "tokenizer_config.json").read_text())["chat_template"],
                                            special={"eos_token": "<|im_end|>"}))
    body = {"model": REAL_TIER, "messages": json.loads(json.dumps(LAYOUTS[case]["messages"]))}
    if "tools" in LAYOUTS[case]:
        body |= {"tools": LAYOUTS[case]["tools"], "tool_choice": "none"}
    prepared = async_to_sync(prepare)(body, spec, max_image_bytes=64 << 20)
    assert prepared.estimated is False
    forwarded = {key: body[key] for key in ("model", "messages", "tools") if key in body}
    tokenized = _engine_call(real_engine, forwarded, "/tokenize").json()
    assert prepared.text_tokens + prepared.image_tokens == tokenized["count"]
    start = _token_id(real_engine, "<|vision_start|>")
    assert [image.position for image in prepared.images] == \
        [n for n, token in enumerate(tokenized["tokens"]) if token == start]


def test_a_photo_the_gateway_downscales_costs_what_vllm_would_charge_for_the_original(client, real_engine):
    photo = image_bytes(2000, 1500)
    through_gateway, _ = _ask(client, _content(photo))
    # The original straight to the engine, which downscales it itself (same pixel bounds).
    direct = _engine_call(real_engine, {"model": REAL_TIER, "messages": _content(photo), "max_tokens": 1}).json()
    assert through_gateway.usage.prompt_tokens_details.multimodal_tokens == \
        direct["usage"]["prompt_tokens_details"]["multimodal_tokens"] == {"image": 1230}


@pytest.mark.parametrize("failing, code", [
    (lambda photo: photo[:-20_000], "corrupt_image"),  # cut short past its header
    (lambda photo: photo + b"<script>fetch('/steal')</script>", "polyglot_image"),  # searched for with the check
], ids=["cut short", "polyglot"])
def test_an_image_sent_before_its_check_and_failing_it_is_refused_and_the_engine_serves_on(
        client, system_db, failing, code):
    """A JPEG within the policy goes to vLLM while the gateway checks it; one that fails the
    check is answered with the gateway's 400 all the same, metered at no cost, and vLLM,
    whose exchange was abandoned, serves the next request."""
    import io

    from PIL import Image

    photo = io.BytesIO()
    Image.effect_noise((800, 600), 80).convert("RGB").save(photo, "JPEG", quality=90)
    with pytest.raises(openai.BadRequestError) as refused:
        _ask(client, _content(failing(photo.getvalue())))
    assert refused.value.status_code == 400 and refused.value.code == code
    event = metered(system_db, refused.value.response.headers["x-request-id"])
    assert (event.status, event.http_status, event.cost) == ("error", 400, 0)
    completion, _ = _ask(client, _content(photo.getvalue()))
    assert completion.usage.prompt_tokens_details.image_tokens == 611  # 812 x 588 on the processor's grid, +2


def test_a_request_the_quota_refuses_while_the_real_engine_has_it_is_a_429_and_the_engine_serves_on(
        system, client, system_db):
    """A tenant's first request runs its admission beside its trip to vLLM; refused (no room
    left), vLLM's exchange is abandoned, the client gets the 429 at no cost, and vLLM serves the
    next request."""
    import secrets

    from controlplane.tenants.models import ApiKey, Quota, Tenant
    from controlplane.tenants.services import KEY_PREFIX, key_hash

    tenant = Tenant.objects.using(system_db).create(name=f"no-room-{secrets.token_hex(4)}")
    Quota.objects.using(system_db).create(tenant=tenant, period="day", total_tokens=1)
    prefix = secrets.token_hex(4)
    secret = f"{KEY_PREFIX}{prefix}-{secrets.token_urlsafe(32)}"
    ApiKey.objects.using(system_db).create(tenant=tenant, prefix=prefix, key_hash=key_hash(secret))
    refused_client = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key=secret, max_retries=0)
    with pytest.raises(openai.RateLimitError) as refused:
        _ask(refused_client, _content(image_bytes(640, 480)))
    assert refused.value.code == "insufficient_quota"
    event = metered(system_db, refused.value.response.headers["x-request-id"])
    assert (event.status, event.http_status, event.cost) == ("error", 429, 0)
    completion, _ = _ask(client, _content(image_bytes(640, 480)))
    assert completion.usage.completion_tokens > 0


def test_low_detail_costs_the_real_engine_fewer_tokens(client):
    photo = image_bytes(1920, 1080)
    high, _ = _ask(client, _content(photo, detail="high"))
    low, _ = _ask(client, _content(photo, detail="low"))
    assert low.usage.prompt_tokens_details.multimodal_tokens["image"] < high.usage.prompt_tokens_details.multimodal_tokens["image"]


def test_a_stream_from_the_real_engine_ends_with_its_usage(client, system_db):
    raw = client.chat.completions.with_raw_response.create(
        model=REAL_TIER, messages=_content(image_bytes(1280, 720)), max_tokens=16, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})  # random weights may stop early
    chunks = list(raw.parse())
    usage = chunks[-1].usage
    assert usage.completion_tokens == 16 and not chunks[-1].choices
    # 1280x720 within the policy: 46 x 26 merged patches, plus the two markers.
    assert usage.prompt_tokens_details.image_tokens == 1198
    assert usage.prompt_tokens_details.multimodal_tokens == {"image": 1196}
    event = metered(system_db, raw.headers["x-request-id"])
    assert (event.stream, event.status, event.output_tokens) == (True, "ok", 16)
    assert (event.engine_image_tokens, event.image_tokens_disagree) == (1196, False)


def _token_id(engine, token):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(engine.tier.model_id) / "tokenizer.json")).token_to_id(token)


def test_a_repeated_image_is_served_from_the_real_engines_prefix_cache(client, system_db, real_engine):
    messages = _content(image_bytes(1024, 768, color=(10, 200, 90)), text="Describe the colours.")
    first, _ = _ask(client, messages)
    second, request_id = _ask(client, messages)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # vLLM's CPU build caches whole blocks of 128 tokens, and never the prompt's last token.
    assert cached == (second.usage.prompt_tokens - 1) // 128 * 128 > 0
    event = metered(system_db, request_id)
    assert event.cached_tokens == cached
    # The image's share of that prefix, from where vLLM's own tokens place it.
    tokens = _engine_call(real_engine, {"model": REAL_TIER, "messages": messages}, "/tokenize").json()["tokens"]
    start = tokens.index(_token_id(real_engine, "<|vision_start|>"))
    image = event.images.get()
    assert image.cached_tokens == event.cached_image_tokens == min(image.tokens, cached - start) > 0
    assert event.cache_savings > 0


def test_a_downscaled_photo_sent_again_reaches_the_real_engine_as_the_same_image(client, system_db):
    """The second time the gateway takes what the photo became the first time (gateway/repeats.py):
    the real engine counts the same image tokens, finds the prompt in its prefix cache (the
    same bytes), and the two requests are metered alike."""
    messages = _content(image_bytes(2000, 1500, color=(200, 120, 30)), text="And this one?")
    (first, first_id), (second, second_id) = _ask(client, messages), _ask(client, messages)
    assert first.usage.prompt_tokens_details.multimodal_tokens == \
        second.usage.prompt_tokens_details.multimodal_tokens == {"image": 1230}
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    lines = [metered(system_db, request_id).images.get() for request_id in (first_id, second_id)]
    seen = ("source_width", "source_height", "width", "height", "tokens", "fingerprint")
    assert [getattr(lines[1], name) for name in seen] == [getattr(lines[0], name) for name in seen]


def test_the_real_engines_metrics_are_scraped_into_samples(client, system_db, real_engine):
    _ask(client, _content(image_bytes(640, 480)))

    def sampled():
        sample = EngineMetricSample.objects.using(system_db).filter(instance_id=real_engine.pk).first()
        return sample if sample and sample.mm_cache_queries > 0 and sample.prefix_cache_queries > 0 else None

    sample = wait_for(sampled, timeout=30, interval=0.5, what="a scrape that saw image requests")
    assert sample.prompt_tokens > 0 and sample.generation_tokens > 0
    assert 0 <= sample.kv_cache_usage <= 1 and sample.running >= 0 and sample.waiting >= 0
    assert sample.ttft is not None and sample.ttft["count"] > 0


def test_an_external_vllm_serving_its_own_model_name_answers_for_a_tier_of_another_name(client, system_db,
                                                                                        real_engine):
    """An engine started elsewhere serves its model under its own name: registered with that
    name, the gateway sends it that name and the client sees the tier it asked for."""
    from controlplane.catalog.models import ModelTier

    real = ModelTier.objects.using(system_db).get(name=REAL_TIER)
    tier = ModelTier.objects.using(system_db).create(
        name="tiny-elsewhere", family=real.family, kind=real.kind, engine_kind="external", model_id=real.model_id,
        resolution_policy=real.resolution_policy, price_plan=real.price_plan,
        large_image_threshold=real.large_image_threshold, replicas=0)
    instance = EngineInstance.objects.using(system_db).create(
        tier=tier, external_url=real_engine.base_url, api_key=real_engine.api_key, served_model_name=REAL_TIER)
    try:
        def healthy():
            row = EngineInstance.objects.using(system_db).get(pk=instance.pk)
            assert row.actual_state == "running" and row.healthy, f"{row.actual_state}: {row.state_reason}"
            return row

        wait_for(healthy, timeout=60, what="the external engine to pass its health check under its own name")

        def answered():
            try:
                return client.chat.completions.create(model="tiny-elsewhere", messages=_content(image_bytes(320, 240)),
                                                      max_tokens=3)
            except (openai.NotFoundError, openai.InternalServerError):  # the gateway's caches catching up
                return None

        completion = wait_for(answered, timeout=30, interval=0.5, what="an answer from the tier of another name")
        assert completion.model == "tiny-elsewhere" and completion.usage.prompt_tokens > 0
        wait_for(lambda: UsageEvent.objects.using(system_db).filter(tier=tier, instance=instance, status="ok").exists(),
                 timeout=20, what="its usage, metered to the tier and the external engine")
    finally:
        ModelTier.objects.using(system_db).filter(pk=tier.pk).update(enabled=False)
        EngineInstance.objects.using(system_db).filter(pk=instance.pk).update(desired_state="stopped")


def _shape(value):
    """A JSON value's keys all the way down (what a client's parser depends on), not its numbers."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    return type(value).__name__ if value is not None else None


def _engine_call(instance, body, path="/v1/chat/completions"):
    return httpx.post(f"{instance.base_url}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {instance.api_key}"})


SAME_REQUESTS = {
    "image": {"max_tokens": 3, "messages": "image"},
    "stream_options without stream": {"max_tokens": 3, "stream_options": {"include_usage": True}},
    "top_logprobs without logprobs": {"max_tokens": 3, "top_logprobs": 2},
    "logprobs": {"max_tokens": 3, "logprobs": True, "messages": "image"},  # what a cascade judges
    "tools without a parser": {"max_tokens": 3, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]},
    "priority on a first-come engine": {"max_tokens": 3, "priority": 5},
    "no messages": {"max_tokens": 3, "messages": []},
}


def test_the_simulator_answers_as_the_real_engine_does(system_db, real_engine):
    simulator = EngineInstance.objects.using(system_db).select_related("tier", "node").get(tier__name="vlm-lite")
    image = _content(image_bytes(1280, 720))
    text = [{"role": "user", "content": "hello there"}]
    answers = {}
    for name, request in SAME_REQUESTS.items():
        body = {**request, "messages": image if request.get("messages") == "image" else request.get("messages", text)}
        answers[name] = [_engine_call(engine, {**body, "model": engine.tier.name}) for engine in (real_engine, simulator)]
    assert {name: [a.status_code for a in pair] for name, pair in answers.items()} == {
        name: [pair[0].status_code] * 2 for name, pair in answers.items()}
    assert answers["image"][0].status_code == 200 and answers["stream_options without stream"][0].status_code == 400
    real, simulated = (a.json()["usage"] for a in answers["image"])
    assert _shape(simulated) == _shape(real)
    assert simulated["prompt_tokens_details"]["multimodal_tokens"] == real["prompt_tokens_details"]["multimodal_tokens"]
    real, simulated = (a.json()["choices"][0]["logprobs"]["content"] for a in answers["logprobs"])
    assert _shape(simulated[0]) == _shape(real[0]) and len(real) >= 1
    assert all(math.isfinite(token["logprob"]) and token["logprob"] <= 0 for token in real + simulated)
    for name in ("stream_options without stream", "top_logprobs without logprobs"):
        real_error, simulated_error = (a.json()["error"] for a in answers[name])
        assert (simulated_error["message"], simulated_error["param"]) == (real_error["message"], real_error["param"])


def test_the_simulators_stream_usage_and_metrics_are_named_as_the_real_engines(system_db, real_engine):
    simulator = EngineInstance.objects.using(system_db).select_related("tier", "node").get(tier__name="vlm-lite")
    usages = []
    for engine in (real_engine, simulator):
        body = {"model": engine.tier.name, "messages": _content(image_bytes(640, 480)), "max_tokens": 3,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{engine.base_url}/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {engine.api_key}"}) as response:
            chunks = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        usages.append(json.loads(chunks[-2])["usage"])
    assert _shape(usages[1]) == _shape(usages[0])

    def names(engine):
        text = httpx.get(f"{engine.base_url}/metrics", timeout=10).text
        return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("vllm:")}

    assert names(simulator) <= names(real_engine)


def test_the_real_engine_and_its_workers_run_below_the_node_agent(system_db, real_engine):
    leader = _instance(system_db, real_engine.pk).pid
    group = [leader, *_engine_workers(leader)]
    assert len(group) > 1  # vLLM's API server, engine core and worker
    assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in group} == {10}
    assert os.getpriority(os.PRIO_PROCESS, 0) == 0  # the tests (and the agent) at normal priority


def _instance(system_db, pk):
    return EngineInstance.objects.using(system_db).get(pk=pk)


def test_a_stopped_real_engine_leaves_rotation_within_30_seconds(system, system_db, real_engine):
    pid = _instance(system_db, real_engine.pk).pid
    os.kill(pid, signal.SIGSTOP)
    try:
        event = wait_for(lambda: EngineEvent.objects.using(system_db).filter(
            instance_id=real_engine.pk, to_state="unhealthy").first(), timeout=30, what="the hang to be noticed")
        assert "out of rotation" in event.reason
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: _instance(system_db, real_engine.pk).actual_state == "running", timeout=30,
             what="the engine back in rotation")


def test_the_node_agent_brings_back_a_real_engine_killed_with_sigkill(system, system_db, real_engine):
    old_pid = _instance(system_db, real_engine.pk).pid
    os.kill(old_pid, signal.SIGKILL)
    wait_for(lambda: EngineEvent.objects.using(system_db).filter(
        instance_id=real_engine.pk, to_state__in=["crashed", "crash_loop"]).first(), timeout=15,
        what="the crash to be noticed")

    def back():
        current = _instance(system_db, real_engine.pk)
        return current.pid not in (None, old_pid) and current.actual_state == "running" and current.healthy

    wait_for(back, timeout=300, interval=1, what="vLLM restarted and serving")
    system.wait_for_engines(tiers=(REAL_TIER,), timeout=30)


def _engine_workers(leader: int) -> list[int]:
    """vLLM's engine core and workers: the API server's descendants, and anything else in its
    process group."""
    processes = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            processes[int(entry)] = (int(fields[1]), int(fields[2]))  # parent, process group
    found = {pid for pid, (_, group) in processes.items() if group == leader and pid != leader}
    parents = [leader]
    while parents:
        parent = parents.pop()
        for pid, (ppid, _) in processes.items():
            if ppid == parent and pid not in found:
                found.add(pid)
                parents.append(pid)
    return sorted(found)


def _throttle(pids: list[int], stop: threading.Event, *, running: float = 0.02, stopped: float = 0.18) -> None:
    """Let `pids` run `running` seconds in each `running + stopped`, until `stop`; they are
    left stopped."""
    while True:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        time.sleep(running)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        if stop.wait(stopped):
            return


def _held(pid: int) -> str:
    """A process's title and scheduler state (T: stopped)."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:60]
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return f"{pid} gone"
    return f"{pid} {state} {title}"


def _until_in_flight(started: threading.Semaphore, instance: EngineInstance, count: int, *,
                     timeout: float = 120) -> None:
    """Until `count` streams are in flight: each has shown its first line (released `started`),
    or the engine's own counters show them running."""
    deadline, shown = time.monotonic() + timeout, 0
    while shown < count:
        assert time.monotonic() < deadline, "a stream never started"
        if started.acquire(timeout=0.2):
            shown += 1
            continue
        counters = scrape(instance)
        if counters is not None and counters.running >= count:
            return


def test_draining_a_real_engine_lets_its_running_requests_finish(system, system_db, real_engine):
    from controlplane.catalog.models import ModelTier

    results, waited = [], []

    def long_stream(started):
        sent = time.monotonic()
        with httpx.stream("POST", f"{system.base_url}/v1/chat/completions", timeout=180,
                          headers={"Authorization": f"Bearer {system.api_key}"},
                          json={"model": REAL_TIER, "max_tokens": LONG, "stream": True, "ignore_eos": True,
                                "messages": [{"role": "user", "content": "Count to a thousand."}]}) as response:
            lines = response.iter_lines()
            first = next(lines)
            waited.append(time.monotonic() - sent)
            started.release()
            rest = [line for line in lines if line.startswith("data:")]
            results.append((response.status_code, [first, *rest]))

    # Hold the engine mid-answer (its API server still reports the requests running), so the
    # drain surely finds them in flight however slow this machine's supervision pass is. On a
    # loaded machine the client's first line can come after the engine generated the whole
    # answer (seen in CI): vLLM's API server, at the engine's niceness, is starved while its
    # core generates (straight to vLLM with two busy processes beside it, the first line came
    # 11.0 s into an 11.1 s answer). So until every stream has shown its first line the engine
    # runs a tenth of the time (its core and worker stopped and continued in turn), and its
    # answers take minutes rather than seconds; then it is held. Or as soon as the engine's own
    # counters show the streams running, whichever comes first (a stream whose first line came
    # only at the end of its answer was seen in the full suite with the engine running a tenth
    # of the time: 11.6 s for 6,900 tokens).
    instance = _instance(system_db, real_engine.pk)
    workers = _engine_workers(instance.pid)
    assert any("EngineCore" in _held(pid) for pid in workers), \
        f"no engine core under {_held(instance.pid)}: {[_held(pid) for pid in workers]}"
    events = EngineEvent.objects.using(system_db).filter(instance_id=real_engine.pk)
    missed = []  # streams that had finished by the time the engine was held, and why not
    try:
        # A stream finished before its engine was held is let go and another tried (seen once
        # in the full suite: the first line 0.2 s after sending, the whole answer done when held).
        for _attempt in range(3):
            results.clear()
            throttle_stop = threading.Event()
            throttled = threading.Thread(target=_throttle, args=(workers, throttle_stop))
            throttled.start()
            started = threading.Semaphore(0)
            streams = [threading.Thread(target=long_stream, args=(started,)) for _ in range(STREAMS)]
            try:
                for stream in streams:
                    stream.start()
                _until_in_flight(started, instance, STREAMS)
            finally:
                throttle_stop.set()
                throttled.join()
            for pid in workers:
                os.kill(pid, signal.SIGSTOP)
            held = [_held(pid) for pid in workers]
            counters = wait_for(lambda: scrape(instance), timeout=60, what="the held engine's counters")
            if counters.running >= STREAMS:
                break
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
            for stream in streams:
                stream.join(timeout=180)
            # The next try is sent only to an engine back in rotation: supervision's probes may
            # have found the throttled engine too slow and taken it out meanwhile.
            system.wait_for_engines(tiers=(REAL_TIER,), timeout=90)
            served = list(UsageEvent.objects.using(system_db).filter(tier__name=REAL_TIER, output_tokens=LONG)
                          .order_by("-created_at").values_list("instance_id", "status")[:STREAMS])
            missed.append(f"held {held} with {counters.running:g} running, the first line {waited[-STREAMS:]} s "
                          f"after sending; answered {[(status, len(lines)) for status, lines in results]} by "
                          f"{served} (the held engine: {real_engine.pk})")
        else:
            pytest.fail("never held mid-answer: " + "; ".join(missed))
        # What the Fleet page's Drain does (instance_action: the tier's count lowered, the
        # instance drained), without a second process's start-up. Not before the engine is held:
        # with the count at 0 the fleet's own sync drains the engine at its next pass, and a
        # stream tried again after a miss would find no engine to serve it (seen in the full suite).
        ModelTier.objects.using(system_db).filter(name=REAL_TIER).update(replicas=0)
        EngineInstance.objects.using(system_db).filter(pk=real_engine.pk).update(drain=True, desired_state="stopped")
        wait_for(lambda: events.filter(to_state="draining").exists(), timeout=60, what="the drain to begin")
        # The drain waits: three passes on (past its grace) the engine still runs, its
        # requests unfinished, whether or not its counters could be read meanwhile.
        deadline = time.monotonic() + 3 * float(system.env["FLEET_RECONCILE_SECONDS"]) + 3
        while time.monotonic() < deadline:
            assert not events.filter(to_state="stopped").exists(), "stopped under its running requests"
            time.sleep(0.5)
        assert not results, (
            f"finished while held ({held}; now {[_held(p) for p in workers]}); the engine as supervision "
            f"last saw it: {_instance(system_db, real_engine.pk).num_running:g} running; events: "
            f"{[(e.created_at.time(), e.to_state, e.reason) for e in events.order_by('created_at')]}")
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    for stream in streams:
        stream.join(timeout=180)
    assert [(status, lines[-1]) for status, lines in results] == [(200, "data: [DONE]")] * STREAMS, [
        (e.created_at.time(), e.to_state, e.reason) for e in events.order_by("created_at")]
    stopped = wait_for(lambda: events.filter(to_state="stopped").first(), timeout=60, what="the drained engine to stop")
    assert stopped.reason.startswith("drained after")
    finished = UsageEvent.objects.using(system_db).filter(tier__name=REAL_TIER, output_tokens=LONG)
    every = STREAMS * (len(missed) + 1)
    try:
        # Metered by the system's own ingest, which on a loaded machine can lag by many seconds.
        wait_for(lambda: finished.filter(status="ok").count() == every, timeout=60, what="every stream metered")
    except TimeoutError:
        metered = list(UsageEvent.objects.using(system_db).filter(tier__name=REAL_TIER).order_by("created_at")
                       .values_list("status", "http_status", "output_tokens", "instance_id"))
        pytest.fail(f"{every} streams of {LONG} tokens expected metered ok; the tier's usage: {metered}; "
                    f"tries missed: {missed}")


# One stream: two long streams sent at once on this 2-core machine were seen, under the full
# suite's load, to reach vLLM one after the other (cause not yet isolated).
STREAMS, LONG = 1, 6900  # long enough to be mid-answer when the engine is held
