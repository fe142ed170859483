"""Requests refused before a model was chosen for them: a key of ours that can no longer be
used, or a body refused at intake, is in its tenant's usage with why (the stage, the code and
the message its client got), at no cost; a request with no key of ours leaves no row."""

from __future__ import annotations

import asyncio
import datetime as dt
import json

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from controlplane.catalog.models import ModelTier, PricePlan, PriceRate
from controlplane.gateway import refusals
from controlplane.gateway.apps import current_process
from controlplane.gateway.recording import drain
from controlplane.metering.models import UsageEvent
from controlplane.redis_clients import key_prefix, sync_redis
from controlplane.tenants.models import ApiKey, Tenant
from controlplane.tenants.services import api_key_revoke
from tests.conftest import skip_without_redis
from tests.controlplane.gateway.calls import error_of, front_call, post
from tests.controlplane.gateway.conftest import ingested

HELLO = {"model": "text", "messages": [{"role": "user", "content": "hi"}]}


def _front(headers: dict, body: bytes = b"") -> tuple[int, dict, dict, int]:
    """One chat request through the ASGI front: its status, headers, error, and how many of its
    body's chunks were read."""
    answer, read = front_call(headers, [body])
    return answer["status"], {k.decode(): v.decode() for k, v in answer["headers"].items()}, answer["error"], read


def _refusal(request_id: str) -> UsageEvent:
    ingested()
    return UsageEvent.objects.get(request_id=request_id)


@pytest.mark.django_db(transaction=True)
def test_a_revoked_key_is_told_so_and_its_tenant_sees_the_refusal(client, world, ledger_mode):
    key = ApiKey.objects.get(name="alice-main")
    api_key_revoke(api_key=key)
    response = post(client, world.alice_key, HELLO)
    told = error_of(response)
    assert (response.status_code, told["code"], told["message"]) == (401, "invalid_api_key", "this API key was revoked")
    event = _refusal(response["x-request-id"])
    assert (event.tenant_id, event.api_key_id, event.tier_id) == (world.alice.pk, key.pk, None)
    assert (event.status, event.http_status, event.error_stage) == ("error", 401, "authentication")
    assert (event.error_code, event.error_message, event.cost) == ("invalid_api_key", "this API key was revoked", 0)


@pytest.mark.django_db
@pytest.mark.parametrize("unusable, message", [
    ("expired", "this API key has expired"),
    ("tenant_inactive", "this API key's organization is deactivated"),
])
def test_an_expired_key_or_a_deactivated_tenants_key_is_refused_and_recorded(client, world, unusable, message):
    key = ApiKey.objects.get(name="alice-main")
    if unusable == "expired":
        ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - dt.timedelta(minutes=1))
    else:
        Tenant.objects.filter(pk=world.alice.pk).update(active=False)
    response = post(client, world.alice_key, HELLO)
    assert (response.status_code, error_of(response)["message"]) == (401, message)
    event = UsageEvent.objects.get(request_id=response["x-request-id"])
    assert (event.api_key_id, event.error_stage, event.error_message) == (key.pk, "authentication", message)


@pytest.mark.django_db
@pytest.mark.parametrize("authorization", [None, "Bearer vlm-0000-nope", "Bearer "])
def test_a_request_with_no_key_of_ours_leaves_no_row(client, world, authorization):
    headers = {"HTTP_AUTHORIZATION": authorization} if authorization else {}
    response = client.post("/v1/chat/completions", data=json.dumps(HELLO), content_type="application/json",
                           **headers)
    assert response.status_code == 401 and response["x-request-id"]
    assert not UsageEvent.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_the_front_records_a_revoked_keys_refusal_without_reading_its_body(world):
    api_key_revoke(api_key=ApiKey.objects.get(name="alice-main"))
    status, headers, error, read = _front({"authorization": f"Bearer {world.alice_key}",
                                           "content-length": str(64_000_000)}, b"x" * 1000)
    assert (status, error["message"], read) == (401, "this API key was revoked", 0)
    assert UsageEvent.objects.get(request_id=headers["x-request-id"]).error_stage == "authentication"


@pytest.mark.django_db
def test_a_revoked_keys_refusals_are_kept_up_to_a_bound_a_minute(client, world, monkeypatch):
    monkeypatch.setattr(refusals, "RECORDED_PER_KEY_MINUTE", 3)
    now = [600.0]
    current_process().recorded_refusals = refusals.RecordedRefusals(clock=lambda: now[0])
    api_key_revoke(api_key=ApiKey.objects.get(name="alice-main"))
    answers = [post(client, world.alice_key, HELLO) for _ in range(5)]
    assert [response.status_code for response in answers] == [401] * 5
    assert UsageEvent.objects.filter(tenant=world.alice).count() == 3
    now[0] += 60  # the next minute's are kept again
    post(client, world.alice_key, HELLO)
    assert UsageEvent.objects.filter(tenant=world.alice).count() == 4


@pytest.mark.django_db(transaction=True)
def test_the_front_records_a_body_declared_too_large_for_its_key_unread(world, settings):
    settings.GATEWAY_MAX_BODY_BYTES = 1_000_000
    status, headers, error, read = _front({"authorization": f"Bearer {world.alice_key}",
                                           "content-length": "1000001"}, b"x" * 1000)
    assert (status, error["code"], read) == (413, "request_too_large", 0)
    event = UsageEvent.objects.get(request_id=headers["x-request-id"])
    assert (event.api_key.name, event.tier_id, event.error_stage, event.http_status) == ("alice-main", None, "intake", 413)

@pytest.mark.django_db
@pytest.mark.parametrize("body, status, code", [
    (b"{nope", 400, "invalid_json"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "missing_model"),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model_not_found"),
])
def test_a_body_refused_before_its_model_is_known_is_in_the_tenants_usage(client, world, body, status, code):
    response = post(client, world.alice_key, body)
    told = error_of(response)
    assert (response.status_code, told["code"]) == (status, code)
    event = UsageEvent.objects.get(request_id=response["x-request-id"])
    assert (event.tenant_id, event.tier_id, event.error_stage) == (world.alice.pk, None, "intake")
    assert (event.http_status, event.error_code, event.error_message) == (status, code, told["message"])
    assert event.cost == 0


@pytest.mark.django_db
def test_a_model_without_a_price_is_refused_and_recorded_on_its_tier(client, world):
    later = PricePlan.objects.create(name="from-next-week")
    PriceRate.objects.create(plan=later, effective_from=timezone.now() + dt.timedelta(days=7))
    ModelTier.objects.filter(pk=world.text.pk).update(price_plan=later)
    response = post(client, world.alice_key, HELLO)
    assert (response.status_code, error_of(response)["code"]) == (503, "model_not_priced")
    event = UsageEvent.objects.get(request_id=response["x-request-id"])
    assert (event.tier_id, event.error_stage, event.error_code, event.cost) == (
        world.text.pk, "intake", "model_not_priced", 0)


@pytest.mark.django_db(transaction=True)
def test_the_front_records_a_body_that_grows_past_the_limit_as_it_arrives(world, settings):
    settings.GATEWAY_MAX_BODY_BYTES = 100_000
    status, headers, error, _ = _front({"authorization": f"Bearer {world.alice_key}",
                                        "transfer-encoding": "chunked"}, b"x" * 200_000)
    assert (status, error["code"]) == (413, "request_too_large")
    assert UsageEvent.objects.get(request_id=headers["x-request-id"]).error_code == "request_too_large"

@pytest.mark.django_db
def test_every_refusal_at_authentication_is_counted_by_reason_on_metrics(client, world, settings):
    settings.DEBUG = True  # /metrics without a token
    for authorization in (None, "Bearer vlm-0000-nope", "Bearer vlm-0000-other"):
        headers = {"HTTP_AUTHORIZATION": authorization} if authorization else {}
        client.post("/v1/chat/completions", data=json.dumps(HELLO), content_type="application/json", **headers)
    api_key_revoke(api_key=ApiKey.objects.get(name="alice-main"))
    post(client, world.alice_key, HELLO)
    text = client.get("/metrics").content.decode()
    for reason, n in (("missing", 1), ("unknown", 2), ("revoked", 1)):
        assert f'vlmcp_gateway_auth_refusals_total{{reason="{reason}"}} {n}' in text


@pytest.mark.django_db
def test_a_flood_of_requests_with_no_key_costs_redis_one_write_per_flush(world, monkeypatch, own_keys, settings):
    skip_without_redis()
    monkeypatch.setattr(refusals, "TALLY_FLUSH_S", 0.05)
    tally = refusals.KeylessTally(settings.REDIS_URL, key_prefix(), clock=lambda: 600.0)
    flushes, flush = [], tally.flush

    async def counted_flush():
        flushes.append(len(tally.pending))
        await flush()

    tally.flush = counted_flush

    async def flood():
        for n in range(500):
            tally.count("unknown" if n % 5 else "missing")
        await asyncio.sleep(0.2)
        await drain()

    async_to_sync(flood)()
    assert flushes == [2]  # one write, of the minute's two counts
    written = sync_redis(settings.REDIS_URL).hgetall(refusals.tally_key(key_prefix(), 10))
    assert written == {b"unknown": b"400", b"missing": b"100"}
    assert refusals.keyless_refusals(now=630.0) == refusals.KeylessCount({"missing": 100, "unknown": 400}, 500)
