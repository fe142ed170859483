"""The gateway's Redis client packs its commands with hiredis: whatever it sends reaches Redis
as it was given, and what it cannot send is refused before anything is sent, as redis-py's
own packing does; a URL's scheme still chooses how it connects."""

from __future__ import annotations

import pytest
import redis.asyncio
import redis.exceptions
from asgiref.sync import async_to_sync
from django.conf import settings

from controlplane.redis_clients import _PackedByHiredis, async_redis
from tests.conftest import skip_without_redis

_ECHO = "return ARGV"


def _on_one_connection(*calls):
    """Each call's arguments echoed by Redis (or the error raised), in turn, on one event
    loop's client and so on one pooled connection, which is checked to pack with hiredis."""

    @async_to_sync
    async def run():
        client = async_redis(settings.REDIS_URL)
        results = []
        try:
            for args in calls:
                try:
                    results.append(await client.eval(_ECHO, 0, *args))
                except redis.exceptions.DataError as exc:
                    results.append(exc)
            [connection] = client.connection_pool._available_connections
            assert isinstance(connection, _PackedByHiredis)
            return results
        finally:
            await client.connection_pool.disconnect()

    return run()


def test_every_kind_of_argument_reaches_redis_as_it_was_given():
    skip_without_redis()
    large = "é" * 5000 + "x"  # past redis-py's 6,000-byte cutoff, where it would split the packet
    sent = ["req_1", "ünïcode ✓", b"\xff\x00raw", 12, -1, 10**30, 1.5, large, memoryview(b"viewed"), ""]
    [got] = _on_one_connection(sent)
    assert got == [b"req_1", "ünïcode ✓".encode(), b"\xff\x00raw", b"12", b"-1", str(10**30).encode(), b"1.5",
                   large.encode(), b"viewed", b""]


@pytest.mark.parametrize("wrong", [None, True, {"a": 1}])
def test_an_argument_redis_cannot_take_is_refused_before_anything_is_sent(wrong):
    skip_without_redis()
    refused, after = _on_one_connection(["fine", wrong], ["next"])
    assert isinstance(refused, redis.exceptions.DataError)
    assert after == [b"next"]  # the same connection, not left half-written


@pytest.mark.parametrize(("url", "base"), [
    ("redis://127.0.0.1:6379/0", redis.asyncio.Connection),
    ("rediss://127.0.0.1:6380/0", redis.asyncio.SSLConnection),
    ("unix:///run/redis.sock?db=0", redis.asyncio.UnixDomainSocketConnection),
])
def test_the_urls_scheme_still_chooses_how_the_client_connects(url, base):
    @async_to_sync
    async def connection_class():
        return async_redis(url).connection_pool.connection_class

    assert issubclass(connection_class(), base)
