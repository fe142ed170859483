"""The gateway's caches of keys, tiers and engines."""

from __future__ import annotations

import asyncio
import threading

import pytest

from controlplane.gateway.state import TTLCache


def test_requests_that_find_an_entry_expired_together_share_one_load():
    cache, loads = TTLCache(seconds=60), []
    release = threading.Event()

    def load():
        loads.append(1)
        release.wait(5)  # a query that takes a while: every request arrives meanwhile
        return "fresh"

    async def many():
        waiting = [asyncio.ensure_future(cache.fetch("key", load)) for _ in range(32)]
        await asyncio.sleep(0.05)
        release.set()
        return await asyncio.gather(*waiting)

    assert asyncio.run(many()) == ["fresh"] * 32
    assert len(loads) == 1
    assert cache.get("key") == "fresh"


def test_a_failed_load_fails_every_request_waiting_on_it_and_the_next_one_tries_again():
    cache, loads = TTLCache(seconds=60), []

    def load():
        loads.append(1)
        raise ConnectionError("the database does not answer")

    async def twice():
        first = await asyncio.gather(*(cache.fetch("key", load) for _ in range(4)), return_exceptions=True)
        second = await asyncio.gather(cache.fetch("key", load), return_exceptions=True)
        return first + second

    outcomes = asyncio.run(twice())
    assert all(isinstance(o, ConnectionError) for o in outcomes)
    assert len(loads) == 2


@pytest.fixture(autouse=True)
def _fresh_gateway_caches():  # these tests need no database
    yield
