"""The gateway's ledger in either store, for tests of what the gateway meters and admits."""

from __future__ import annotations

import uuid

import pytest
import redis
from django.conf import settings
from django.conf import settings as django_settings
from django.utils import timezone

from controlplane.fleet.models import EngineInstance, Node
from tests.conftest import skip_without_redis
from tests.controlplane.gateway.journal import MODES
from tests.engines import simulator


@pytest.fixture(params=["redis", "database"])
def ledger_mode(request, settings):
    """The gateway's ledger in Redis (production's with REDIS_URL) or in the database."""
    if request.param == "redis":
        skip_without_redis()
    prefix = f"admission-{uuid.uuid4().hex}"
    settings.USAGE_OUTBOX = request.param
    settings.CACHES = {"default": {**settings.CACHES["default"], "KEY_PREFIX": prefix}}
    yield request.param
    if request.param == "redis":
        import redis

        client = redis.Redis.from_url(settings.REDIS_URL)
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)


def ingested():
    """Usage handed over to the Redis stream, stored (nothing to do with the database ledger)."""
    from controlplane.metering.outbox import usage_ingest

    if settings.USAGE_OUTBOX == "redis":
        while usage_ingest():
            pass


# Engines behind the gateway (simulators) and instances routed to them.

@pytest.fixture(scope="module")
def engines():
    with simulator(name="vlm-lite") as vision_port, simulator(family="qwen2", name="text",
                                                              images=None) as text_port:
        yield {"vlm-lite": vision_port, "text": text_port}


@pytest.fixture
def routed(world, engines):
    node = Node.objects.create(name="local", address="127.0.0.1", queue="node.local",
                               last_seen_at=timezone.now())
    for tier in (world.vision, world.text):
        EngineInstance.objects.create(
            tier=tier, node=node, port=engines[tier.name], actual_state="running", healthy=True,
            last_health_at=timezone.now(),
        )
    return world


# The ledger's journal in either store.


@pytest.fixture
def engine(world):
    from controlplane.fleet.models import EngineInstance

    return EngineInstance.objects.create(tier=world.vision)


@pytest.fixture(params=list(MODES))
def mode(request, settings):
    if MODES[request.param] == "redis":
        skip_without_redis()
    prefix = f"journal-{uuid.uuid4().hex}"
    settings.USAGE_OUTBOX = MODES[request.param]
    settings.CACHES = {"default": {**django_settings.CACHES["default"], "KEY_PREFIX": prefix}}
    yield request.param
    if settings.REDIS_URL:
        client = redis.Redis.from_url(settings.REDIS_URL)
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)


@pytest.fixture
def own_keys(settings):
    """Journal keys of this test's own in Redis, removed afterwards."""
    prefix = f"j-{uuid.uuid4().hex}"
    settings.CACHES = {"default": {**django_settings.CACHES["default"], "KEY_PREFIX": prefix}}
    yield
    if settings.REDIS_URL:
        client = redis.Redis.from_url(settings.REDIS_URL)
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
