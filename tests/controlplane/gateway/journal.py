"""The ledger's journal as its tests drive it: requests admitted and forwarded, reaped,
stored; and what room a quota has left."""

from __future__ import annotations

import pytest
import redis
from asgiref.sync import async_to_sync
from django.conf import settings as django_settings
from django.utils import timezone

from controlplane.gateway import ledger
from controlplane.gateway.ledger import Ask, Limits, Refused
from controlplane.metering.models import UsageEvent
from controlplane.metering.outbox import stream_key, usage_ingest
from controlplane.metering.records import UsageRecord
from tests.images import image_bytes

MODES = {"redis": "redis", "embedded": "database"}  # where the ledger lives


def forwarded(record, engine, limits=None, ask=None) -> ledger.Flight:
    """A request admitted (against `limits`, if any) and journaled, then taken by `engine`, as
    the gateway does before sending it."""
    async def forward():
        flight = await ledger.admit(record, limits, ask)
        await ledger.engine_chosen(flight, engine.pk)
        return flight

    return async_to_sync(forward)()


def reserve(tenant_id, limits, ask):
    return async_to_sync(ledger.ledger().reserve)(tenant_id, limits, ask, timezone.now())


def record_of(world, request_id) -> UsageRecord:
    from controlplane.imaging.policy import Policy, normalise

    image = normalise(image_bytes(320, 240), Policy())
    return UsageRecord(request_id=request_id, tenant_id=world.alice.pk, api_key_id=None, tier_id=world.vision.pk,
                       stream=True, images=[(image, 110, False)], image_tokens=110, text_tokens=20)


def stored(mode):
    if mode == "redis":
        client = redis.Redis.from_url(django_settings.REDIS_URL)
        assert client.xlen(stream_key()) == 1  # handed over once, not once by each side
        usage_ingest()
    return list(UsageEvent.objects.all())


def assert_room(world, room: int) -> None:
    """Exactly `room` total tokens are left this period (and the large-image slot is free)."""
    with pytest.raises(Refused):
        reserve(world.alice.pk, LIMITS, Ask(0, room + 1, True))
    assert reserve(world.alice.pk, LIMITS, Ask(0, room, True))


def reap_twice(now: float) -> int:
    """What the reaper takes on two runs: a look, and a second look two heartbeats later (with
    Redis an entry must still be stale and unchanged on the second)."""
    return ledger.journal_reap(now=now) + ledger.journal_reap(
        now=now + 2 * django_settings.GATEWAY_HEARTBEAT_S + 1)


LIMITS = Limits(total_tokens=1000, concurrent_large_images=1)
ASK = Ask(image_tokens=110, total_tokens=900, large=True)  # prompt 130 + a max_tokens ceiling of 770
