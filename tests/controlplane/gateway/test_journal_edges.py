"""The ledger's journal at its edges: a client leaving while usage is handed over, and a
usage journal that Redis fails to answer."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.conf import settings as django_settings

from controlplane.gateway import admission, ledger, recording
from controlplane.gateway.apps import current_process
from controlplane.gateway.ledger import Ask, RedisLedger
from controlplane.metering.models import UsageEvent
from controlplane.metering.outbox import usage_ingest
from tests.controlplane.gateway.journal import (
    ASK,
    LIMITS,
    assert_room,
    forwarded,
    reap_twice,
    record_of,
    stored,
)

pytestmark = pytest.mark.accounting  # also run in embedded mode (SQLite, no Redis)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["embedded", "redis"], indirect=True)
def test_a_client_leaving_while_its_usage_is_handed_over_still_has_it_recorded_and_settled(world, mode, engine):  # noqa: F811
    record = record_of(world, "req-left")
    record.stream = False
    busy = threading.Event()

    @async_to_sync
    async def answered_then_client_leaves():
        flight = await ledger.admit(record, LIMITS, ASK)
        await ledger.engine_chosen(flight, engine.pk)
        record.output_tokens = 50
        # The database thread is busy with other requests' work when this one finishes...
        other = asyncio.ensure_future(sync_to_async(busy.wait)())
        handing = asyncio.ensure_future(recording.hand_over_usage(record, time.monotonic()))
        for _ in range(3):
            await asyncio.sleep(0)
        handing.cancel()  # ...and the client leaves just then
        busy.set()
        await other
        await asyncio.gather(handing, return_exceptions=True)
        while current_process().hand_overs:
            await asyncio.gather(*list(current_process().hand_overs), return_exceptions=True)

    answered_then_client_leaves()
    [event] = stored(mode)
    assert (event.request_id, event.status, event.output_tokens) == ("req-left", "ok", 50)
    assert_room(world, 820)  # settled to the 180 tokens used, the large-image slot free again


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["redis"], indirect=True)
def test_a_request_finished_while_the_journal_was_unreachable_is_settled_once(world, mode, engine, settings):  # noqa: F811
    record = record_of(world, "req-outage")

    forwarded(record, engine, LIMITS, ASK)
    record.output_tokens = 50
    reachable = settings.REDIS_URL
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # the journal's Redis does not answer the finish...
    async_to_sync(ledger.finish)(record)
    settings.REDIS_URL = reachable  # ...and is back a moment later, the entry still in it

    later = time.time() + django_settings.GATEWAY_JOURNAL_STALE_S + 1
    reap_twice(later)
    [event] = stored(mode)
    assert (event.status, event.output_tokens) == ("ok", 50)  # stored once, as the gateway knew it
    # The reservation settled once, by the reaper, to the usage the database holds (130 prompt
    # and 50 output tokens), not to the prompt alone the journal knew.
    assert_room(world, 820)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["redis"], indirect=True)
def test_quota_counters_started_afresh_count_what_was_settled(world, mode):  # noqa: F811
    import redis

    record = record_of(world, "req-gave-up")

    async def gave_up_waiting_for_a_slot():
        await ledger.admit(record, LIMITS, ASK)
        record.status, record.http_status = "aborted", 499
        await ledger.finish(record)

    async_to_sync(gave_up_waiting_for_a_slot)()
    [event] = stored(mode)
    assert (event.status, event.cost) == ("aborted", 0)
    assert_room(world, 1000)  # no engine worked on it: nothing held against the quota
    # Redis restarts without its counters: they start again from what is metered, alike.
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    for key in client.scan_iter(f"{django_settings.CACHES['default']['KEY_PREFIX']}:quota:*"):
        client.delete(key)
    assert_room(world, 1000)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["redis"], indirect=True)
def test_a_request_finishing_after_redis_lost_its_counters_does_not_open_the_quota(world, mode, engine):  # noqa: F811
    import redis

    record = record_of(world, "req-through-restart")

    async def answered():
        await ledger.engine_chosen(await ledger.admit(record, LIMITS, ASK), engine.pk)
        client = redis.Redis.from_url(django_settings.REDIS_URL)  # Redis restarts, its counters lost
        for key in client.scan_iter(f"{django_settings.CACHES['default']['KEY_PREFIX']}:quota:*"):
            client.delete(key)
        record.output_tokens = 50
        await ledger.finish(record)

    async_to_sync(answered)()
    [event] = stored(mode)
    assert event.status == "ok"
    assert_room(world, 820)  # counted from what is metered: the 180 tokens used, no more room


def _redis_restarts_empty():
    """Redis as it runs here, without persistence: a restart loses every key."""
    import redis

    client = redis.Redis.from_url(django_settings.REDIS_URL)
    for key in client.scan_iter(f"{django_settings.CACHES['default']['KEY_PREFIX']}:*"):
        client.delete(key)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["redis"], indirect=True)
def test_a_request_in_flight_across_a_redis_restart_is_still_metered(world, mode, engine):  # noqa: F811
    record = record_of(world, "req-across")

    async def answered_across_a_restart():
        await ledger.engine_chosen(await ledger.admit(record, LIMITS, ASK), engine.pk)
        _redis_restarts_empty()  # its journal entry is gone with everything else
        record.output_tokens = 50
        await ledger.finish(record)

    async_to_sync(answered_across_a_restart)()
    [event] = stored(mode)
    assert (event.request_id, event.status, event.output_tokens) == ("req-across", "ok", 50)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["redis"], indirect=True)
def test_quota_counters_rebuilt_after_a_restart_equal_metered_usage(world, mode, engine):  # noqa: F811
    before, after = record_of(world, "req-before"), record_of(world, "req-after")

    async def two_requests_across_a_restart():
        await ledger.engine_chosen(await ledger.admit(before, LIMITS, ASK), engine.pk)
        _redis_restarts_empty()
        # The counters start again from what is metered (nothing yet): the request in flight
        # is not in them, so its settling must add what it used, not take back its reservation.
        await ledger.engine_chosen(await ledger.admit(after, LIMITS, Ask(110, 700, False)), engine.pk)
        before.output_tokens = after.output_tokens = 50
        await ledger.finish(before)
        await ledger.finish(after)

    async_to_sync(two_requests_across_a_restart)()
    usage_ingest()
    assert UsageEvent.objects.count() == 2
    assert_room(world, 1000 - 2 * 180)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["redis"], indirect=True)
def test_usage_handed_over_just_before_redis_restarts_empty_is_not_lost(world, mode, engine):  # noqa: F811
    """Answered, handed over to the usage stream, and gone with it before the ingest moved it:
    the gateway that handed it over writes it to the database itself."""
    record = record_of(world, "req-just-before")

    async def answered_then_redis_restarts():
        store = ledger.ledger()
        await store.keep_safe()  # Redis as it was: marked
        await ledger.engine_chosen(await ledger.admit(record, LIMITS, ASK), engine.pk)
        record.output_tokens = 50
        await ledger.finish(record)
        _redis_restarts_empty()
        assert await store.keep_safe() == 1
        assert await store.keep_safe() == 0  # once

    async_to_sync(answered_then_redis_restarts)()
    usage_ingest()  # finds nothing: the stream went with Redis
    [event] = UsageEvent.objects.all()
    assert (event.request_id, event.status, event.output_tokens) == ("req-just-before", "ok", 50)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["redis"], indirect=True)
def test_a_gateway_started_beside_others_raises_no_false_alarm_of_a_redis_restart(world, mode, engine, caplog):  # noqa: F811
    """A gateway process started on a Redis already in use (by other replicas, or by itself
    before a restart of the process) hands usage over from its first request, and first
    looks at Redis from its heartbeat: Redis did not restart, so nothing is written to the
    database behind the ingest, and no warning says Redis started afresh."""
    record = record_of(world, "req-first-of-a-process")

    async def a_process_hands_over_then_beats():
        store = ledger.ledger()
        await ledger.engine_chosen(await ledger.admit(record), engine.pk)  # a tenant without a quota
        record.output_tokens = 50
        await ledger.finish(record)
        return await store.keep_safe()  # the heartbeat's first look

    with caplog.at_level("WARNING", logger="controlplane.gateway.ledger.redis_store"):
        assert async_to_sync(a_process_hands_over_then_beats)() == 0
    assert "started afresh" not in caplog.text
    assert not UsageEvent.objects.exists()  # the ingest's to store, from the stream
    usage_ingest()
    [event] = UsageEvent.objects.all()
    assert (event.request_id, event.status, event.output_tokens) == ("req-first-of-a-process", "ok", 50)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["redis"], indirect=True)
def test_a_process_that_starts_with_many_requests_at_once_marks_redis_once_before_any_hand_over(world, mode, engine, caplog, monkeypatch):  # noqa: F811
    """Thirty-two first requests of a process end together, while its marking of Redis is slow
    to come back (a busy Redis): none hands its usage over before Redis is marked (so no usage
    could go with a restart unseen), and there is no alarm."""
    records = [record_of(world, f"req-together-{n}") for n in range(32)]
    looking = RedisLedger.keep_safe

    async def slow_to_answer(self):
        await asyncio.sleep(0.2)
        return await looking(self)

    monkeypatch.setattr(RedisLedger, "keep_safe", slow_to_answer)

    async def all_at_once():
        store = ledger.ledger()
        flights = [await ledger.admit(record) for record in records]
        for flight in flights:
            await ledger.engine_chosen(flight, engine.pk)
        await asyncio.gather(*(ledger.finish(record) for record in records))
        return await store.keep_safe()

    with caplog.at_level("WARNING", logger="controlplane.gateway.ledger.redis_store"):
        assert async_to_sync(all_at_once)() == 0
    assert "started afresh" not in caplog.text and "could not mark" not in caplog.text
    usage_ingest()
    assert UsageEvent.objects.count() == 32


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["redis"], indirect=True)
def test_a_restart_just_after_a_process_first_hand_over_is_still_found(world, mode, engine):  # noqa: F811
    """The process marked Redis on its own before handing over (no look of its own before):
    a restart that takes the usage stream just after is found, and the usage kept."""
    record = record_of(world, "req-first-then-restart")

    async def first_hand_over_then_restart():
        store = ledger.ledger()
        await ledger.engine_chosen(await ledger.admit(record), engine.pk)
        record.output_tokens = 50
        await ledger.finish(record)
        _redis_restarts_empty()
        return await store.keep_safe()

    assert async_to_sync(first_hand_over_then_restart)() == 1
    usage_ingest()  # finds nothing: the stream went with Redis
    [event] = UsageEvent.objects.filter(request_id="req-first-then-restart")
    assert (event.status, event.output_tokens) == ("ok", 50)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["redis"], indirect=True)
def test_counters_started_again_count_usage_still_in_the_stream(world, mode, engine):  # noqa: F811
    """A request reserved before the restart and finished after it, before any counter was
    started again: its usage waits in the new stream, and the new counters include it."""
    before, after = record_of(world, "req-pending"), record_of(world, "req-next")

    async def scenario():
        await ledger.engine_chosen(await ledger.admit(before, LIMITS, ASK), engine.pk)
        _redis_restarts_empty()
        before.output_tokens = 50
        await ledger.finish(before)  # into the new stream; no counters to settle yet
        await ledger.engine_chosen(await ledger.admit(after, LIMITS, Ask(110, 700, False)), engine.pk)
        after.output_tokens = 50
        await ledger.finish(after)

    async_to_sync(scenario)()
    usage_ingest()
    assert UsageEvent.objects.count() == 2
    assert_room(world, 1000 - 2 * 180)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["redis"], indirect=True)
def test_a_client_leaving_during_an_admission_whose_reply_was_lost_leaves_no_reservation(world, mode, monkeypatch):  # noqa: F811
    """Redis ran the admission, its reply was lost, and the client had left meanwhile: nobody
    answered a 503 whose record would settle it, so the reservation stayed in the counters.
    The request is recorded as the client left it (499, at no cost) and settles it."""
    import dataclasses

    import redis

    from controlplane.gateway import state
    from controlplane.gateway.ledger import redis_scripts
    from controlplane.gateway.prepare import Prepared

    key = dataclasses.replace(async_to_sync(state.key_info)(world.alice_key), limits=LIMITS)
    tier = async_to_sync(state.tiers)()[world.vision.name]
    prepared = Prepared(body={"max_tokens": 770, "messages": []}, text_tokens=130)
    original, replying = redis_scripts.run, threading.Event()

    async def made_then_reply_lost(client, script, *args):
        result = await original(client, script, *args)
        if script == redis_scripts.ADMIT:
            while not replying.is_set():  # the reply is on its way while the client leaves
                await asyncio.sleep(0.01)
            raise redis.exceptions.TimeoutError("Timeout reading from 127.0.0.1:6379")
        return result

    monkeypatch.setattr(redis_scripts, "run", made_then_reply_lost)

    @async_to_sync
    async def client_leaves_while_admitted():
        admitting = asyncio.ensure_future(admission.admit("req-gone", key, tier, prepared, time.monotonic()))
        for _ in range(5):
            await asyncio.sleep(0)
        admitting.cancel()
        replying.set()
        await asyncio.gather(admitting, return_exceptions=True)
        deadline = time.monotonic() + 3  # the admission ends after the client left: its record follows
        while not current_process().hand_overs and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        while current_process().hand_overs:
            await asyncio.gather(*list(current_process().hand_overs), return_exceptions=True)

    client_leaves_while_admitted()
    monkeypatch.setattr(redis_scripts, "run", original)
    [event] = stored(mode)
    assert (event.request_id, event.status, event.http_status, event.cost) == ("req-gone", "aborted", 499, 0)
    assert_room(world, 1000)  # nothing held: no engine was sent it
