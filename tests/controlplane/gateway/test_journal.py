"""The ledger's journal: a request whose gateway died is metered once, from what was known,
and its reservation settled once."""

from __future__ import annotations

import json
import time

import pytest
import redis
from asgiref.sync import async_to_sync
from django.conf import settings as django_settings

from controlplane.gateway import ledger
from controlplane.gateway.apps import current_process
from controlplane.gateway.ledger import Ask, RedisLedger, Refused
from controlplane.gateway.ledger.base import interrupted
from controlplane.gateway.ledger.redis_scripts import FINISH
from controlplane.gateway.models import InFlightRequest
from controlplane.metering.models import UsageEvent
from tests.conftest import skip_without_redis
from tests.controlplane.gateway.journal import (
    ASK,
    LIMITS,
    assert_room,
    forwarded,
    reap_twice,
    record_of,
    reserve,
    stored,
)

pytestmark = pytest.mark.accounting  # also run in embedded mode (SQLite, no Redis)

@pytest.mark.django_db(transaction=True)
def test_a_request_whose_gateway_died_is_recorded_once_as_interrupted(world, mode, engine):
    flight = forwarded(record_of(world, "req-orphan"), engine, LIMITS, ASK)
    flight.produced = 7
    async_to_sync(ledger.ledger().beat)([flight])  # its last heartbeat: 7 tokens streamed
    current_process().ledger_book.live.clear()  # the process is gone: nothing of it runs any more
    assert ledger.journal_reap() == 0  # its heartbeat is fresh: it may still be alive
    with pytest.raises(Refused):  # meanwhile the reservation holds the quota and the large slot
        reserve(world.alice.pk, LIMITS, Ask(0, 200, True))

    later = time.time() + django_settings.GATEWAY_JOURNAL_STALE_S + 1
    assert reap_twice(later) == 1
    assert reap_twice(later + 60) == 0

    [event] = stored(mode)
    assert (event.request_id, event.status, event.instance_id) == ("req-orphan", "interrupted", engine.pk)
    assert (event.image_tokens, event.text_tokens, event.output_tokens, event.image_count) == (110, 20, 7, 1)
    assert event.cost > 0  # an engine worked on it: the prompt and the tokens streamed are billed
    # The reservation is settled to the 137 tokens used, and the large-image slot is free again.
    assert_room(world, 863)


@pytest.mark.django_db(transaction=True)
def test_a_finished_request_leaves_nothing_for_the_reaper(world, mode, engine):
    record = record_of(world, "req-done")
    forwarded(record, engine, LIMITS, ASK)
    record.output_tokens = 50
    async_to_sync(ledger.finish)(record)
    assert reap_twice(time.time() + 3600) == 0
    [event] = stored(mode)
    assert (event.status, event.output_tokens) == ("ok", 50)
    assert not InFlightRequest.objects.exists()
    assert_room(world, 820)  # 180 used, slot released


@pytest.mark.django_db(transaction=True)
def test_a_request_finished_twice_is_handed_over_and_settled_once(world, mode, engine):
    """The ledger itself keeps a request to one finish (not a flag of its caller's): a second
    finish of the same request adds nothing to the stream, the events or the quota."""
    record = record_of(world, "req-twice")
    forwarded(record, engine, LIMITS, ASK)
    record.output_tokens = 50
    async_to_sync(ledger.finish)(record)
    again = record_of(world, "req-twice")  # a second caller, with its own copy of the record
    again.output_tokens, again.instance_id = 50, engine.pk
    async_to_sync(ledger.finish)(again)
    [event] = stored(mode)
    assert event.output_tokens == 50
    assert_room(world, 820)  # 180 used once


@pytest.mark.django_db(transaction=True)
def test_a_gateway_that_finishes_after_being_reaped_does_not_count_twice(world, mode, engine):
    record = record_of(world, "req-slow")

    forwarded(record, engine, LIMITS, ASK)
    assert reap_twice(time.time() + 3600) == 1  # taken for dead (a frozen process)
    record.output_tokens = 500
    async_to_sync(ledger.finish)(record)  # then it woke up and finished

    [event] = stored(mode)
    assert (event.status, event.output_tokens) == ("interrupted", 0)
    assert_room(world, 870)  # settled once: the 130 prompt tokens held


@pytest.mark.django_db(transaction=True)
def test_a_request_that_never_reached_an_engine_is_recorded_at_no_cost(world, mode, engine):
    async_to_sync(ledger.admit)(record_of(world, "req-queued"), LIMITS, ASK)  # died waiting for a slot
    current_process().ledger_book.live.clear()
    assert reap_twice(time.time() + 3600) == 1
    [event] = stored(mode)
    assert (event.status, event.cost) == ("interrupted", 0)
    assert_room(world, 1000)  # nothing held against the quota


def test_the_heartbeat_setting_must_leave_room_for_a_missed_beat(monkeypatch):
    import subprocess
    import sys

    env = {"GATEWAY_HEARTBEAT_S": "10", "GATEWAY_JOURNAL_STALE_S": "15", "SECRET_KEY": "x" * 50,
           "DJANGO_SETTINGS_MODULE": "controlplane.settings", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", "import django; django.setup()"], env=env,
                          capture_output=True, text=True, cwd=django_settings.BASE_DIR)
    assert done.returncode != 0
    assert "GATEWAY_JOURNAL_STALE_S=15 must be at least twice GATEWAY_HEARTBEAT_S=10" in done.stderr


@pytest.mark.django_db(transaction=True)
def test_the_reaper_leaves_an_entry_whose_heartbeat_came_back_meanwhile(world, engine, settings, own_keys):
    """A gateway frozen past the limit that beats again just as the reaper looks is alive."""
    skip_without_redis()
    settings.USAGE_OUTBOX = "redis"
    flight = forwarded(record_of(world, "req-back"), engine)
    client = redis.Redis.from_url(settings.REDIS_URL)
    store = RedisLedger()
    inflight, beats = store.inflight, store.beats
    judged_stale = client.hget(beats, "req-back").decode()
    flight.produced = 3
    async_to_sync(ledger.ledger().beat)([flight])  # it beats again
    keys, args = store._finish_call(interrupted(json.loads(client.hget(inflight, "req-back")), {}), True,
                                      stale_beat=judged_stale)
    assert client.eval(FINISH, len(keys), *keys, *args) == 0
    assert client.hexists(inflight, "req-back")  # left to its gateway
    current_process().ledger_book.live.clear()


@pytest.mark.django_db(transaction=True)
def test_an_entry_that_cannot_be_recorded_does_not_stop_the_reaper(world, engine, settings):
    settings.USAGE_OUTBOX = "database"

    for request_id in ("req-broken", "req-fine"):  # two dead gateways' requests
        forwarded(record_of(world, request_id), engine)
    current_process().ledger_book.live.clear()
    broken = InFlightRequest.objects.get(request_id="req-broken")
    broken.record = {**broken.record, "tier_id": 999_999}  # its tier is gone: it cannot be stored
    broken.save()
    assert reap_twice(time.time() + 3600) == 1
    assert list(UsageEvent.objects.values_list("request_id", flat=True)) == ["req-fine"]
    assert InFlightRequest.objects.filter(request_id="req-broken").exists()  # kept, for a later run


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("usage", ["redis", "database"])
def test_a_live_gateway_whose_beats_look_stale_is_not_reaped(world, engine, settings, own_keys, usage):
    """After an outage of the journal longer than the limit (or with a gateway clock far
    behind), every beat looks stale; a gateway that is alive beats again before the reaper's
    second look."""
    if usage == "redis":
        skip_without_redis()
    settings.USAGE_OUTBOX = usage
    record = record_of(world, "req-alive")
    flight = forwarded(record, engine)
    first_look = time.time() + 3600  # its beat is an hour old by then
    assert ledger.journal_reap(now=first_look) == 0
    async_to_sync(ledger.ledger().beat)([flight])  # Redis is back: the gateway beats (its clock an hour behind)
    second_look = first_look + 2 * django_settings.GATEWAY_HEARTBEAT_S + 1
    assert ledger.journal_reap(now=second_look) == 0
    flight.produced = 9
    async_to_sync(ledger.ledger().beat)([flight])  # and again, as it does every few seconds
    assert ledger.journal_reap(now=second_look + 2 * django_settings.GATEWAY_HEARTBEAT_S + 1) == 0

    record.output_tokens = 40
    async_to_sync(ledger.finish)(record)  # and it finishes its request itself
    [event] = stored("redis" if usage == "redis" else "embedded")
    assert (event.status, event.output_tokens) == ("ok", 40)
