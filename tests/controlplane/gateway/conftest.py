"""The gateway's ledger in either store, for tests of what the gateway meters and admits."""

from __future__ import annotations

import uuid

import pytest
from django.conf import settings

from tests.conftest import skip_without_redis


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


