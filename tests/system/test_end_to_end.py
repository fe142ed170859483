"""The product as a tenant meets it: the official openai client against a started system."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import pytest
from django.utils import timezone

from controlplane.fleet.models import EngineEvent, EngineInstance, EngineMetricSample
from controlplane.imaging.tokens import count_image_tokens
from controlplane.metering.models import DailyUsage, UsageEvent
from controlplane.tenants.models import ApiKey
from tests.images import data_url, image_bytes, serve_files
from tests.system.harness import wait_for

# One started system serves every test of the group, on one xdist worker.
pytestmark = [pytest.mark.system, pytest.mark.xdist_group("system")]


def metered(system_db, request_id):
    """The usage event of a request, once beat has moved it from the usage stream."""
    return wait_for(lambda: UsageEvent.objects.using(system_db).filter(request_id=request_id).first(),
                    timeout=20, what=f"the usage event of {request_id}")


@pytest.fixture
def client(system):
    return openai.OpenAI(base_url=f"{system.base_url}/v1", api_key=system.api_key, max_retries=0)


def _image_message(url, text="What is in this picture?"):
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_it_meters_an_image_request_from_the_openai_client(client, system_db):
    photo = data_url(image_bytes(1920, 1080))
    raw = client.chat.completions.with_raw_response.create(
        model="vlm-lite", messages=_image_message(photo), max_tokens=24)
    completion = raw.parse()
    request_id = raw.headers["x-request-id"]

    # The policy (1,003,520 px) brings 1920x1080 to 1316x728, the size Qwen2.5-VL's processor
    # would give the original: 47 x 26 merged patches = 1222 features, plus vision start and end.
    expected = count_image_tokens("qwen2_5_vl", 1920, 1080, max_pixels=1003520, min_pixels=3136)
    assert expected == 1224
    assert completion.usage.prompt_tokens_details.image_tokens == expected
    assert completion.choices[0].message.content

    event = metered(system_db, request_id)
    assert event.tier.name == "vlm-lite"
    assert (event.image_count, event.image_tokens) == (1, expected)
    assert event.text_tokens == completion.usage.prompt_tokens - expected
    assert event.output_tokens == completion.usage.completion_tokens
    assert event.cost > 0
    image = event.images.get()
    assert (image.source_width, image.source_height, image.width, image.height) == (1920, 1080, 1316, 728)


def test_it_fetches_an_http_image_url_for_the_openai_client(client, system_db):
    with serve_files({"/street.jpg": (image_bytes(1920, 1080), "image/jpeg")}) as base:
        raw = client.chat.completions.with_raw_response.create(
            model="vlm-lite", messages=_image_message(f"{base}/street.jpg"), max_tokens=8)
    assert raw.parse().usage.prompt_tokens_details.image_tokens == 1224
    image = metered(system_db, raw.headers["x-request-id"]).images.get()
    assert (image.source_width, image.source_height) == (1920, 1080)


def test_it_refuses_an_image_url_aimed_at_the_cloud_metadata_service(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="vlm-lite", messages=_image_message("http://169.254.169.254/latest/meta-data/"))
    assert refused.value.body["code"] == "unsafe_image_url"


def test_it_meters_a_streamed_request_with_the_tokens_produced(client, system_db):
    stream = client.chat.completions.with_raw_response.create(
        model="vlm-flagship", messages=_image_message(data_url(image_bytes(800, 600))),
        stream=True, stream_options={"include_usage": True}, max_tokens=12)
    request_id = stream.headers["x-request-id"]
    chunks = list(stream.parse())
    usage = chunks[-1].usage
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and usage.completion_tokens <= 12
    event = wait_for(lambda: UsageEvent.objects.using(system_db).filter(request_id=request_id).first(),
                     timeout=10, what="the streamed request's usage event")
    assert event.stream and event.status == "ok"
    assert event.output_tokens == usage.completion_tokens
    assert event.image_tokens == usage.prompt_tokens_details.image_tokens > 0
    # The flagship's engine speaks SGLang (the demo's): its own image count, from SGLang's usage,
    # agrees with the gateway's, and supervision reads its metrics under SGLang's names.
    assert (event.engine_image_tokens, event.image_tokens_disagree) == (event.image_tokens - 2, False)
    assert "sglang:num_running_reqs" in httpx.get(f"{event.instance.base_url}/metrics", timeout=5).text
    wait_for(lambda: EngineMetricSample.objects.using(system_db).filter(
        instance_id=event.instance_id, prompt_tokens__gt=0).exists(), timeout=30, what="a scrape of SGLang's metrics")


def test_auto_sends_text_to_the_text_tier_and_images_to_a_vision_tier(client, system_db):
    text = client.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "Say hi"}], max_tokens=4)
    image = client.chat.completions.with_raw_response.create(
        model="auto", messages=_image_message(data_url(image_bytes(64, 64))), max_tokens=4)
    assert metered(system_db, text.headers["x-request-id"]).tier.kind == "text"
    assert metered(system_db, image.headers["x-request-id"]).tier.kind == "vision"


def test_beat_rolls_usage_into_daily_totals(client, system_db):
    for _ in range(2):
        client.chat.completions.create(model="vlm-lite", max_tokens=4,
                                       messages=_image_message(data_url(image_bytes(640, 480))))
    today = timezone.now().date()

    def rolled_up():
        events = UsageEvent.objects.using(system_db).filter(
            created_at__date=today, tier__name="vlm-lite", tenant__name="demo")
        want = sum(e.image_tokens for e in events)
        row = DailyUsage.objects.using(system_db).filter(
            day=today, tier__name="vlm-lite", tenant__name="demo").first()
        return row is not None and row.image_tokens == want and row.requests == events.count()

    wait_for(rolled_up, timeout=30, interval=0.5, what="the daily rollup to match the events")


def test_a_revoked_key_stops_working_within_seconds(system, system_db):
    secret = system.manage("create_api_key", "--tenant", "demo").stdout.strip()
    tenant_client = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key=secret, max_retries=0)
    assert "vlm-lite" in [m.id for m in tenant_client.models.list().data]

    ApiKey.objects.using(system_db).filter(prefix=secret.split("-")[1]).update(revoked_at=timezone.now())

    def refused():
        try:
            tenant_client.models.list()
        except openai.AuthenticationError:
            return True
        return False

    wait_for(refused, timeout=10, what="the revoked key to be refused")


def test_bad_requests_get_openai_style_errors(client, system):
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert unknown.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{system.base_url}/v1", api_key="vlm-wrong", max_retries=0).models.list()
    malformed = httpx.post(f"{system.base_url}/v1/chat/completions", content=b"{not json",
                           headers={"Authorization": f"Bearer {system.api_key}"})
    assert malformed.status_code == 400
    assert malformed.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.BadRequestError) as hostile:
        client.chat.completions.create(model="vlm-lite", messages=_image_message(
            "data:image/png;base64," + "QUJD" * 10))
    assert "image 1" in hostile.value.body["message"]


def test_the_metering_api_shows_a_tenant_its_own_requests_only(client, system, system_db):
    raw = client.chat.completions.with_raw_response.create(
        model="text", messages=[{"role": "user", "content": "count me"}], max_tokens=3)
    request_id = raw.headers["x-request-id"]
    metered(system_db, request_id)
    mine = httpx.get(f"{system.base_url}/api/v1/usage/requests/", params={"request_id": request_id},
                     headers={"Authorization": f"Bearer {system.api_key}"}).json()
    assert [r["request_id"] for r in mine["results"]] == [request_id]

    system.manage("shell", "-c", "from controlplane.tenants.models import Tenant; "
                  "Tenant.objects.get_or_create(name='other')")
    other_key = system.manage("create_api_key", "--tenant", "other").stdout.strip()
    theirs = httpx.get(f"{system.base_url}/api/v1/usage/requests/", params={"request_id": request_id},
                       headers={"Authorization": f"Bearer {other_key}"}).json()
    assert theirs["results"] == []


def test_the_node_agent_restarts_an_engine_killed_with_sigkill(system, system_db):
    instances = EngineInstance.objects.using(system_db)
    victim = instances.get(tier__name="text")
    old_pid = victim.pid
    os.kill(old_pid, signal.SIGKILL)

    crashed = wait_for(lambda: EngineEvent.objects.using(system_db).filter(
        instance_id=victim.pk, to_state="crashed").first(), timeout=15, what="the crash to be noticed")
    assert "restart 1 in 10s" in crashed.reason

    def back():
        current = instances.get(pk=victim.pk)
        return current.pid not in (None, old_pid) and current.actual_state == "running" and current.healthy

    wait_for(back, timeout=40, interval=0.5, what="the engine to be restarted and healthy")
    assert instances.get(pk=victim.pk).restart_count == 1


def _chat(system, model="vlm-lite"):
    return httpx.post(f"{system.base_url}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {system.api_key}"},
                      json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "ping"}]})


def test_a_stopped_engine_leaves_rotation_and_returns_when_it_resumes(system, system_db):
    instance = EngineInstance.objects.using(system_db).get(tier__name="vlm-lite")
    os.kill(instance.pid, signal.SIGSTOP)  # alive but answering nothing: a hang
    try:
        event = wait_for(lambda: EngineEvent.objects.using(system_db).filter(
            instance_id=instance.pk, to_state="unhealthy").first(), timeout=30, what="the hang to be noticed")
        assert "out of rotation" in event.reason
        # Its only replica is out: the gateway says so instead of sending work into the void.
        wait_for(lambda: _chat(system).status_code == 503, timeout=10, what="the gateway to stop routing to it")
    finally:
        os.kill(instance.pid, signal.SIGCONT)
    wait_for(lambda: _chat(system).status_code == 200, timeout=30, interval=0.5, what="the engine back in rotation")


def _worker_pids(node_name: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"worker" in cmdline and f"agent@{node_name}".encode() in cmdline:
                found.append(int(entry))
    return found


def test_a_restarted_node_agent_adopts_the_engines_still_running(system, system_db, real_engine):
    # real_engine: the real vLLM serves as well, and is adopted like the simulators.
    node_name = system.env["NODE_NAME"]
    before = {i.pk: i.pid for i in EngineInstance.objects.using(system_db).all()}
    started_before = EngineEvent.objects.using(system_db).filter(to_state="starting").count()
    (agent,) = _worker_pids(node_name)
    os.kill(agent, signal.SIGKILL)
    wait_for(lambda: [p for p in _worker_pids(node_name) if p != agent], timeout=30,
             what="the local runner to restart the agent")
    # The new agent registers, reconciles, and finds every engine alive: nothing is relaunched.
    wait_for(lambda: _chat(system, "text").status_code == 200, timeout=20, what="serving after the agent restart")
    after = {i.pk: i.pid for i in EngineInstance.objects.using(system_db).all()}
    assert after == before
    assert EngineEvent.objects.using(system_db).filter(to_state="starting").count() == started_before


def test_a_tenant_over_its_quota_gets_a_rate_limit_error_with_retry_after(system, system_db):
    system.manage("shell", "-c", "from controlplane.tenants.models import Tenant, Quota; "
                  "t, _ = Tenant.objects.get_or_create(name='tight'); "
                  "Quota.objects.update_or_create(tenant=t, defaults={'period': 'day', 'requests_per_minute': 2})")
    secret = system.manage("create_api_key", "--tenant", "tight").stdout.strip()
    tight = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key=secret, max_retries=0)
    for _ in range(2):
        tight.chat.completions.create(model="text", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.RateLimitError) as refused:
        tight.chat.completions.create(model="text", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert "requests per minute" in refused.value.body["message"]
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 60
    refused_id = refused.value.response.headers["x-request-id"]
    assert metered(system_db, refused_id).http_status == 429  # refused requests are in the usage too


def _web_pid(system) -> int:
    """The web process (uvicorn) runlocal started (and restarts when it dies)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                argv = cmdline.read().split(b"\0")
        except OSError:
            continue
        if parent == system.process.pid and b"controlplane.serving" in argv:
            return int(entry)
    raise AssertionError("no web process under runlocal")


def test_a_gateway_killed_mid_stream_leaves_its_usage_recorded_once(system, system_db):
    import json

    import redis

    beats = redis.Redis.from_url(system.env["REDIS_URL"])
    body = {"model": "vlm-flagship", "stream": True, "max_tokens": 2000, "ignore_eos": True,
            "messages": _image_message(data_url(image_bytes(800, 600)))}
    received = 0
    with httpx.stream("POST", f"{system.base_url}/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {system.api_key}"}) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        journaled = json.loads(beats.hget("vlmcp:inflight", request_id))
        lines = response.iter_lines()
        last_beat = {}
        while last_beat.get("produced", 0) < 20:  # until a heartbeat has carried the progress
            line = next(lines)
            received += line.startswith("data:") and '"content"' in line
            last_beat = json.loads(beats.hget("vlmcp:inflight:beat", request_id) or "{}")
        os.kill(_web_pid(system), signal.SIGKILL)  # the engine has answered 20+ tokens; the client is mid-stream
        with pytest.raises(httpx.HTTPError):
            for _ in lines:
                pass

    event = wait_for(lambda: UsageEvent.objects.using(system_db).filter(request_id=request_id).first(),
                     timeout=30, what="the usage event of the killed gateway's request")
    assert event.status == "interrupted" and event.stream
    assert event.image_tokens == journaled["image_tokens"] > 0  # counted before it was forwarded
    assert event.text_tokens == journaled["text_tokens"] > 0
    assert last_beat["produced"] <= event.output_tokens < 2000  # as of the last heartbeat
    assert event.instance_id is not None and event.cost > 0
    assert beats.hget("vlmcp:inflight", request_id) is None  # finished, by the reaper alone
    wait_for(system._web_up, timeout=30, what="the web process, restarted by runlocal")
