"""The usage stream: handed over before the response, stored once, never dropped."""

from __future__ import annotations

import json
import uuid

import pytest
import redis
from asgiref.sync import async_to_sync
from django.conf import settings as django_settings

from controlplane.gateway import ledger
from controlplane.gateway.apps import current_process
from controlplane.metering import outbox as outbox_module
from controlplane.metering.models import UsageEvent
from controlplane.metering.outbox import GROUP, stream_key, usage_ingest
from controlplane.metering.records import UsageRecord
from tests.images import image_bytes

# Committed: a batch is written on the writer thread's own connection, which would not see the
# test's uncommitted world (every batch would fail, and each entry be stored on its own).
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def stream(settings):
    settings.USAGE_OUTBOX = "redis"
    settings.CACHES = {"default": {**django_settings.CACHES["default"], "KEY_PREFIX": f"outbox-{uuid.uuid4().hex}"}}
    client = redis.Redis.from_url(settings.REDIS_URL)
    yield client
    client.delete(stream_key())


def _record(world, request_id, **fields):
    from controlplane.imaging.policy import Policy, normalise

    image = normalise(image_bytes(320, 240), Policy())
    return UsageRecord(request_id=request_id, tenant_id=world.alice.pk, api_key_id=None, tier_id=world.vision.pk,
                       images=[(image, 110, True)], image_tokens=110, text_tokens=20, output_tokens=7,
                       cached_tokens=130, cached_image_tokens=110, **fields)


def test_usage_goes_through_the_stream_into_the_database_once(world, stream):
    put = async_to_sync(ledger.finish)  # what the gateway calls as a request ends
    put(_record(world, "req-a"))
    current_process().ledger_book.finished.clear()  # the same request's usage delivered again (by another process's copy)
    put(_record(world, "req-a"))
    put(_record(world, "req-b"))
    assert stream.xlen(stream_key()) == 3
    assert UsageEvent.objects.count() == 0  # nothing was written on the request path

    assert usage_ingest() == 3
    assert sorted(UsageEvent.objects.values_list("request_id", flat=True)) == ["req-a", "req-b"]
    event = UsageEvent.objects.get(request_id="req-a")
    line = event.images.get()
    assert (line.source_width, line.width, line.tokens, line.cached) == (320, 320, 110, True)
    assert stream.xlen(stream_key()) == 0


def test_entries_a_crashed_consumer_took_are_reclaimed_and_stored_once(world, stream, monkeypatch):
    put = async_to_sync(ledger.finish)  # what the gateway calls as a request ends
    put(_record(world, "req-crash"))
    usage_ingest(max_batches=0)  # creates the group, takes nothing
    stream.xreadgroup(GROUP, "consumer-that-died", {stream_key(): ">"}, count=10)  # taken, never acknowledged
    assert usage_ingest() == 0  # not idle long enough yet: left to its consumer
    monkeypatch.setattr(outbox_module, "RECLAIM_IDLE_MS", 0)
    assert usage_ingest() == 1
    assert UsageEvent.objects.filter(request_id="req-crash").count() == 1


def test_entries_acknowledged_but_left_in_the_stream_are_cleared_and_unread_ones_kept(world, stream):
    """Redis paused between acknowledging a batch and deleting it (the client timed out, Redis
    then ran the acknowledgement): such entries are never read again, and must not stay."""
    put = async_to_sync(ledger.finish)
    put(_record(world, "req-stored"))
    usage_ingest(max_batches=0)  # creates the group, takes nothing
    (_, taken), = stream.xreadgroup(GROUP, "consumer-cut-short", {stream_key(): ">"}, count=10)
    stream.xack(stream_key(), GROUP, *[entry_id for entry_id, _ in taken])  # acknowledged, not deleted
    put(_record(world, "req-later"))  # arrives after: not read by anyone yet
    assert usage_ingest() == 1
    assert UsageEvent.objects.filter(request_id="req-later").count() == 1
    assert stream.xlen(stream_key()) == 0


def test_an_entry_that_cannot_be_stored_stays_for_a_retry_and_others_pass(world, stream):
    put = async_to_sync(ledger.finish)  # what the gateway calls as a request ends
    broken = _record(world, "req-broken")
    broken.tier_id = 999_999  # no such tier: storing fails
    put(broken)
    put(_record(world, "req-fine"))
    assert usage_ingest() == 1
    assert UsageEvent.objects.filter(request_id="req-fine").exists()
    pending = stream.xpending(stream_key(), GROUP)
    assert pending["pending"] == 1  # kept, not dropped
    assert json.loads(stream.xrange(stream_key())[0][1][b"record"])["request_id"] == "req-broken"


def test_an_entry_that_keeps_failing_moves_to_the_dead_letter_stream(world, stream, monkeypatch):
    put = async_to_sync(ledger.finish)  # what the gateway calls as a request ends
    broken = _record(world, "req-poison")
    broken.tier_id = 999_999
    put(broken)
    monkeypatch.setattr(outbox_module, "RECLAIM_IDLE_MS", 0)
    for _ in range(outbox_module.MAX_DELIVERIES):
        usage_ingest()
    assert stream.xlen(stream_key()) == 0
    dead = stream.xrange(f"{stream_key()}:dead")
    assert json.loads(dead[0][1][b"record"])["request_id"] == "req-poison"  # kept, for an operator
    stream.delete(f"{stream_key()}:dead")


def test_a_batch_stores_each_request_once_priced_at_the_rate_in_effect_then(world, stream):
    import datetime as dt
    from decimal import Decimal

    from django.utils import timezone

    from controlplane.catalog.models import PriceRate
    from controlplane.metering.services import usage_record

    PriceRate.objects.create(plan=world.vision.price_plan, effective_from=timezone.now() - dt.timedelta(days=5),
                             text_input_per_mtok=Decimal("1"), image_per_mtok=Decimal("2"),
                             output_per_mtok=Decimal("3"), per_image_fee=Decimal("0.01"),
                             cached_image_discount=Decimal("0.5"))
    before_the_change = timezone.now() - dt.timedelta(days=10)
    usage_record(record=_record(world, "req-direct"))  # stored while the stream was away
    put = async_to_sync(ledger.finish)  # what the gateway calls as a request ends
    for request_id, created_at in (("req-direct", None), ("req-old", before_the_change), ("req-new", None),
                                   ("req-new", None), ("req-unpriced", dt.datetime(2000, 1, 1, tzinfo=dt.UTC))):
        current_process().ledger_book.finished.clear()  # a request delivered twice (req-new) comes from two copies
        put(_record(world, request_id, **({"created_at": created_at} if created_at else {})))

    assert usage_ingest() == 5
    events = {e.request_id: e for e in UsageEvent.objects.all()}
    assert sorted(events) == ["req-direct", "req-new", "req-old", "req-unpriced"]
    # (20*1 + (110 - 110*0.5)*2 + 7*3) / 1e6 + 0.01 = 0.010151, saving 110*0.5*2 / 1e6
    assert (events["req-new"].cost, events["req-new"].cache_savings) == (Decimal("0.010151"), Decimal("0.000110"))
    assert (events["req-new"].cost, events["req-new"].cache_savings) == (
        events["req-direct"].cost, events["req-direct"].cache_savings)
    # old card, part by part: the image 55*0.30 / 1e6 + 0.001 = 0.0010165 -> 0.001016, the text
    # 20*0.20 / 1e6 = 0.000004, the output 7*0.60 / 1e6 = 0.0000042 -> 0.000004
    assert events["req-old"].cost == Decimal("0.001024")
    assert (events["req-unpriced"].rated, events["req-unpriced"].cost) == (False, Decimal("0"))
    assert [(i.position, i.tokens, i.cached) for i in events["req-new"].images.all()] == [(0, 110, True)]


@pytest.mark.django_db(transaction=True)
def test_the_ingest_takes_nothing_from_the_stream_while_the_database_is_down(world, stream, monkeypatch):
    """Taken and not stored, entries would wait a minute to be taken again: they are left."""
    from django.db import OperationalError, connection

    async_to_sync(ledger.finish)(_record(world, "req-waits"))
    real = dict(connection.settings_dict)
    connection.close()
    monkeypatch.setitem(connection.settings_dict, "PORT", "1")
    with pytest.raises(OperationalError):
        usage_ingest()
    connection.settings_dict.update(real)
    connection.close()
    assert stream.xlen(stream_key()) == 1
    assert usage_ingest() == 1  # the database back: stored at once, not a minute later
    assert UsageEvent.objects.filter(request_id="req-waits").exists()


@pytest.mark.django_db(transaction=True)
def test_consumers_ingesting_at_once_store_each_request_once(world, stream):
    """Several consumers on one stream (processes on several hosts, threads here): each takes
    its own entries, batches are written while the next are priced, and every request is
    stored exactly once."""
    import threading

    from django.db import connection

    put = async_to_sync(ledger.finish)
    for n in range(3000):
        put(_record(world, f"req-{n}"))
    stored, failures = [], []

    def consume():
        try:
            while done := usage_ingest(batch=250, max_batches=3):
                stored.append(done)
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(exc)
        finally:
            connection.close()

    consumers = [threading.Thread(target=consume) for _ in range(3)]
    for consumer in consumers:
        consumer.start()
    for consumer in consumers:
        consumer.join()
    assert failures == []
    assert sum(stored) == 3000 and len(stored) > 3  # shared out, batch by batch
    assert UsageEvent.objects.count() == 3000 == UsageEvent.objects.values("request_id").distinct().count()
    assert stream.xlen(stream_key()) == 0


def test_consumers_left_by_processes_gone_are_forgotten_once_idle_and_holding_nothing(world, stream, monkeypatch):
    put = async_to_sync(ledger.finish)
    put(_record(world, "req-first"))
    assert usage_ingest() == 1  # the group exists, with this process's consumer
    stream.xgroup_createconsumer(stream_key(), GROUP, "gone-host-1")  # a restarted process's old name
    put(_record(world, "req-held"))
    stream.xreadgroup(GROUP, "busy-host-2", {stream_key(): ">"}, count=1)  # another process holds an entry

    def names():
        return {c["name"].decode() for c in stream.xinfo_consumers(stream_key(), GROUP)}

    usage_ingest()
    assert {"gone-host-1", "busy-host-2"} <= names()  # idle for less than an hour: kept
    monkeypatch.setattr(outbox_module, "CONSUMER_IDLE_MS", -1)  # as if an hour had passed
    usage_ingest()
    left = names()
    assert "gone-host-1" not in left
    assert "busy-host-2" in left  # what it holds would be lost with it: kept until reclaimed
    assert len(left) == 2  # and this process's own


def test_the_garbage_collector_is_held_off_while_batches_are_priced_and_runs_again_after(world, stream,
                                                                                        monkeypatch):
    import gc

    put = async_to_sync(ledger.finish)
    put(_record(world, "req-gc-1"))
    seen, rows = [], outbox_module.usage_rows

    def watched(records):
        seen.append(gc.isenabled())
        return rows(records)

    monkeypatch.setattr(outbox_module, "usage_rows", watched)
    assert usage_ingest() == 1
    assert seen == [False] and gc.isenabled()

    put(_record(world, "req-gc-2"))

    def broken(entries, writer):
        raise RuntimeError("the batch cannot be priced")

    monkeypatch.setattr(outbox_module, "_priced", broken)
    with pytest.raises(RuntimeError):
        usage_ingest()
    assert gc.isenabled()  # an ingest that failed leaves the worker collecting as before


def test_a_consumer_takes_a_whole_batch_at_a_time(world, stream):
    """Each batch costs a few queries and a commit whatever its size: the ingest task reads
    BATCH entries at a time (it had gone on reading 2,000, its default, where BATCH said 5,000)."""
    import orjson

    from controlplane.metering.outbox import BATCH
    from controlplane.metering.records import usage_to_json

    template = _record(world, "req-0")
    pipe = stream.pipeline(transaction=False)
    for n in range(BATCH + 5):
        template.request_id = f"req-{n}"
        pipe.xadd(stream_key(), {"record": orjson.dumps(usage_to_json(template))})
    pipe.execute()
    assert usage_ingest(max_batches=1) == BATCH  # one read, one write
    assert usage_ingest() == 5
    assert UsageEvent.objects.count() == BATCH + 5
