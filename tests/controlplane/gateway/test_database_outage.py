"""With the database down, the gateway serves from what it already knew (keys, models and
engines it had read), and answers a clear 503 for what it never saw; never a 500."""

from __future__ import annotations

import json

import pytest
from django.db import connection

from controlplane.gateway.apps import current_process
from tests.controlplane.gateway.calls import image_message, post
from tests.images import data_url, image_bytes

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def database_down(monkeypatch, settings, tmp_path):
    """Call it to make the database stop answering (its port closed), as a stopped server does.
    What the gateway spools to disk meanwhile stays with the test (its own VAR_DIR): left in the
    shared one, a later test's heartbeat would move it into that test's database."""
    settings.VAR_DIR = tmp_path
    real = dict(connection.settings_dict)

    def stop():
        connection.close()
        monkeypatch.setitem(connection.settings_dict, "HOST", "127.0.0.1")
        monkeypatch.setitem(connection.settings_dict, "PORT", "1")
        monkeypatch.setitem(connection.settings_dict, "NAME", real["NAME"] if connection.vendor != "sqlite"
                            else "/nonexistent/dir/db.sqlite3")

    def start():
        connection.close()
        connection.settings_dict.update(real)

    stop.start = start
    yield stop
    start()


def test_known_keys_and_models_are_served_while_the_database_is_down(client, world, monkeypatch, database_down):
    caches = current_process().caches
    for cache in (caches.keys, caches.tiers, caches.instances):
        monkeypatch.setattr(cache, "seconds", 0)  # every entry already past its freshness
    assert client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {world.alice_key}").status_code == 200
    body = {"model": "vlm-lite", "messages": image_message(data_url(image_bytes(64, 64)))}
    assert post(client, world.alice_key, body).status_code == 503  # no engine in these tests

    database_down()
    models = client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {world.alice_key}")
    assert models.status_code == 200 and "vlm-lite" in models.content.decode()
    answered = post(client, world.alice_key, body)
    assert answered.status_code == 503
    assert json.loads(answered.content)["error"]["code"] == "engine_unavailable"  # routed as before
    never_seen = client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {world.bob_key}")
    assert never_seen.status_code == 503 and int(never_seen["Retry-After"]) > 0
    assert json.loads(never_seen.content)["error"]["code"] == "service_unavailable"


def test_what_was_known_is_not_served_past_its_limit(client, world, monkeypatch, settings, database_down):
    monkeypatch.setattr(current_process().caches.keys, "seconds", 0)
    settings.GATEWAY_STALE_MAX_S = 0
    assert client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {world.alice_key}").status_code == 200
    database_down()
    assert client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {world.alice_key}").status_code == 503


@pytest.mark.accounting
def test_usage_finished_while_the_database_is_down_waits_on_disk_and_is_not_lost(
        world, settings, tmp_path, database_down):
    """The database ledger with the database gone: the finished request's usage and its quota
    settlement are written to the spool, and moved into the ledger once it answers."""
    from asgiref.sync import async_to_sync

    from controlplane.gateway import ledger
    from controlplane.gateway.ledger import Ask, Limits
    from controlplane.metering.models import UsageEvent
    from controlplane.tenants.models import QuotaCounter
    from tests.controlplane.gateway.journal import record_of

    settings.USAGE_OUTBOX, settings.VAR_DIR = "database", tmp_path
    record = record_of(world, "req-spooled")
    async_to_sync(ledger.admit)(record, Limits(total_tokens=1000), Ask(110, 900, False))
    record.output_tokens = 50
    database_down()
    async_to_sync(ledger.finish)(record)  # no exception, nothing lost:
    assert [p.name.endswith(".jsonl") for p in (tmp_path / "spool").iterdir()] == [True]
    assert ledger.drain_spool() == 0  # still down: kept
    database_down.start()
    assert ledger.drain_spool() == 1
    event = UsageEvent.objects.get(request_id="req-spooled")
    assert (event.status, event.output_tokens) == ("ok", 50)
    assert QuotaCounter.objects.get(tenant=world.alice, key="total_tokens").used == 180  # settled once
    assert ledger.drain_spool() == 0 and not list((tmp_path / "spool").iterdir())
    current_process().ledger_book.live.clear()


@pytest.mark.accounting
def test_usage_finished_while_redis_and_the_database_are_both_down_waits_on_disk_and_is_settled_once(
        world, settings, tmp_path, database_down):
    """The Redis ledger with Redis and the database gone at once: the usage is spooled; once
    the database answers it is stored as the gateway saw it (not as the journal knew it), and
    the reservation left in Redis is settled once, to that usage, by the reaper."""
    import time
    import uuid

    import redis as redis_client
    from asgiref.sync import async_to_sync
    from django.conf import settings as django_settings

    from controlplane.gateway import ledger
    from controlplane.metering.models import UsageEvent
    from controlplane.metering.outbox import usage_ingest
    from tests.conftest import skip_without_redis
    from tests.controlplane.gateway.journal import ASK, LIMITS, assert_room, forwarded, record_of

    skip_without_redis()
    prefix = f"spool-{uuid.uuid4().hex}"
    settings.USAGE_OUTBOX, settings.VAR_DIR = "redis", tmp_path
    settings.CACHES = {"default": {**django_settings.CACHES["default"], "KEY_PREFIX": prefix}}
    from controlplane.fleet.models import EngineInstance

    record = record_of(world, "req-both-down")
    forwarded(record, EngineInstance.objects.create(tier=world.vision), LIMITS, ASK)
    record.output_tokens = 50
    redis_url = settings.REDIS_URL
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # Redis does not answer,
    database_down()  # nor the database
    try:
        async_to_sync(ledger.finish)(record)  # no exception, nothing lost:
        assert [p.suffix for p in (tmp_path / "spool").iterdir()] == [".jsonl"]
    finally:
        settings.REDIS_URL = redis_url
        database_down.start()
    assert ledger.drain_spool() == 1
    event = UsageEvent.objects.get(request_id="req-both-down")
    assert (event.status, event.output_tokens) == ("ok", 50)  # what the gateway saw, not the journal
    current_process().ledger_book.live.clear()
    assert ledger.journal_reap(now=time.time() + 3600) + ledger.journal_reap(now=time.time() + 7200) == 1
    while usage_ingest():
        pass
    assert UsageEvent.objects.get(request_id="req-both-down").status == "ok"  # stored once, as it was
    assert_room(world, 820)  # settled once, to the 180 tokens used
    client = redis_client.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)
