"""Quota admission: atomic under concurrency, in Redis and in the database alike."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import threading
import uuid

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.db import connection

from controlplane.gateway.ledger import Ask, DatabaseLedger, Limits, RedisLedger, Refused
from controlplane.metering.records import UsageRecord
from controlplane.metering.services import usage_record
from controlplane.tenants.models import Quota
from tests.conftest import skip_without_redis
from tests.controlplane.gateway.conftest import ingested

pytestmark = pytest.mark.accounting  # also run in embedded mode (SQLite, no Redis)

NOW = dt.datetime(2026, 11, 30, 12, 0, 30, tzinfo=dt.UTC)


def redis_backend():
    skip_without_redis()
    return RedisLedger(settings.REDIS_URL, prefix=f"test-{uuid.uuid4().hex}")


def database_backend():
    return DatabaseLedger()


def reserve_all_at_once(backend, tenant_id, limits, asks) -> list:
    """Fire every reservation at the same moment; the outcomes, in order."""
    if isinstance(backend, RedisLedger):
        @async_to_sync
        async def burst():
            return await asyncio.gather(*(backend.reserve(tenant_id, limits, a, NOW) for a in asks),
                                        return_exceptions=True)
        return burst()
    results = [None] * len(asks)
    start = threading.Barrier(len(asks))

    def one(index):
        start.wait()
        try:
            results[index] = backend.reserve_sync(tenant_id, limits, asks[index], NOW)
        except Exception as exc:  # noqa: BLE001 - a refusal is a result here
            results[index] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(asks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("make_backend", [redis_backend, database_backend], ids=["redis", "database"])
def test_parallel_requests_never_admit_more_than_the_quota(world, make_backend):
    limits = Limits(image_tokens=1000)
    outcomes = reserve_all_at_once(make_backend(), world.alice.pk, limits,
                                   [Ask(image_tokens=100, total_tokens=150, large=False)] * 30)
    admitted = [o for o in outcomes if not isinstance(o, Exception)]
    refused = [o for o in outcomes if isinstance(o, Refused)]
    assert len(admitted) == 10 and len(refused) == 20
    assert all(r.limit == "image_tokens" for r in refused)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("make_backend", [redis_backend, database_backend], ids=["redis", "database"])
def test_concurrent_large_image_requests_are_capped_until_one_ends(world, make_backend):
    backend = make_backend()
    limits = Limits(concurrent_large_images=2)
    large = Ask(image_tokens=9000, total_tokens=9100, large=True)
    outcomes = reserve_all_at_once(backend, world.bob.pk, limits, [large] * 8)
    admitted = [o for o in outcomes if not isinstance(o, Exception)]
    assert len(admitted) == 2
    settle = async_to_sync(backend.settle) if isinstance(backend, RedisLedger) else backend.settle_sync
    settle(admitted[0], image_tokens=9000, total_tokens=9100)
    reserve = async_to_sync(backend.reserve) if isinstance(backend, RedisLedger) else backend.reserve_sync
    assert reserve(world.bob.pk, limits, large, NOW)  # a slot came free
    with pytest.raises(Refused, match="concurrent large-image requests"):
        reserve(world.bob.pk, limits, large, NOW)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("make_backend", [redis_backend, database_backend], ids=["redis", "database"])
def test_settling_returns_what_was_reserved_but_not_used(world, make_backend):
    backend = make_backend()
    reserve = async_to_sync(backend.reserve) if isinstance(backend, RedisLedger) else backend.reserve_sync
    settle = async_to_sync(backend.settle) if isinstance(backend, RedisLedger) else backend.settle_sync
    limits = Limits(total_tokens=1000)
    first = reserve(world.alice.pk, limits, Ask(0, 800, False), NOW)  # 800 reserved (max_tokens ceiling)
    with pytest.raises(Refused):
        reserve(world.alice.pk, limits, Ask(0, 300, False), NOW)
    settle(first, image_tokens=0, total_tokens=200)  # it used 200
    assert reserve(world.alice.pk, limits, Ask(0, 800, False), NOW)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("make_backend", [redis_backend, database_backend], ids=["redis", "database"])
def test_requests_per_minute_refuse_until_the_next_minute(world, make_backend):
    backend = make_backend()
    reserve = async_to_sync(backend.reserve) if isinstance(backend, RedisLedger) else backend.reserve_sync
    limits = Limits(requests_per_minute=3)
    for _ in range(3):
        reserve(world.charlie.pk, limits, Ask(0, 10, False), NOW)
    with pytest.raises(Refused) as refused:
        reserve(world.charlie.pk, limits, Ask(0, 10, False), NOW)
    assert refused.value.retry_after == 30  # NOW is 30 s into its minute
    assert reserve(world.charlie.pk, limits, Ask(0, 10, False), NOW + dt.timedelta(minutes=1))


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("make_backend", [redis_backend, database_backend], ids=["redis", "database"])
def test_a_period_starts_from_what_is_already_metered(world, make_backend):
    usage_record(record=UsageRecord(request_id="earlier", tenant_id=world.alice.pk, api_key_id=None,
                                    tier_id=world.vision.pk, image_tokens=900, created_at=NOW - dt.timedelta(days=1)))
    backend = make_backend()
    reserve = async_to_sync(backend.reserve) if isinstance(backend, RedisLedger) else backend.reserve_sync
    with pytest.raises(Refused) as refused:
        reserve(world.alice.pk, Limits(image_tokens=1000), Ask(200, 200, False), NOW)
    assert "image tokens (1,000 this month)" in str(refused.value)
    assert refused.value.retry_after == int((dt.datetime(2026, 12, 1, tzinfo=dt.UTC) - NOW).total_seconds()) + 1


@pytest.mark.django_db(transaction=True)
def test_the_gateway_refuses_past_the_quota_with_a_429_naming_the_limit(client, world, ledger_mode):
    from tests.controlplane.gateway.calls import image_message, post
    from tests.images import data_url, image_bytes

    Quota.objects.create(tenant=world.alice, period="day", requests_per_minute=1)
    body = {"model": "vlm-lite", "messages": image_message(data_url(image_bytes(64, 64)))}
    first = post(client, world.alice_key, body)
    assert first.status_code == 503  # admitted (no engine in this test), and the slot is used
    second = post(client, world.alice_key, body)
    assert second.status_code == 429
    assert 1 <= int(second["Retry-After"]) <= 60
    error = json.loads(second.content)["error"]
    assert error["code"] == "rate_limit_exceeded" and "requests per minute" in error["message"]
    assert post(client, world.bob_key, body).status_code == 503  # other tenants are unaffected


@pytest.mark.django_db(transaction=True)
def test_a_refused_request_is_in_the_tenants_usage_at_no_cost(client, world, ledger_mode):
    from controlplane.metering.models import UsageEvent
    from tests.controlplane.gateway.calls import image_message, post
    from tests.images import data_url

    Quota.objects.create(tenant=world.alice, period="day", image_tokens=10)
    too_much = post(client, world.alice_key, {"model": "vlm-lite",
                                              "messages": image_message(data_url(image_bytes_for_test()))})
    hostile = post(client, world.alice_key, {"model": "vlm-lite",
                                             "messages": image_message("data:image/png;base64,QUJD")})
    ingested()
    events = {e.request_id: e for e in UsageEvent.objects.filter(tenant=world.alice)}
    assert events[too_much["x-request-id"]].http_status == 429
    assert events[hostile["x-request-id"]].http_status == 400
    assert all(e.status == "error" and e.cost == 0 and e.image_tokens == 0 for e in events.values())
    # and why, as its client was told
    refused, broken = events[too_much["x-request-id"]], events[hostile["x-request-id"]]
    assert (refused.error_stage, refused.error_code) == ("admission", json.loads(too_much.content)["error"]["code"])
    assert refused.error_message == json.loads(too_much.content)["error"]["message"]
    assert (broken.error_stage, broken.error_code) == ("intake", json.loads(hostile.content)["error"]["code"])
    assert broken.error_message.startswith("image 1: ")


def image_bytes_for_test():
    from tests.images import image_bytes

    return image_bytes(640, 480)
