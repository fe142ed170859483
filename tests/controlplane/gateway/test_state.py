"""The gateway's caches of keys, tiers and engines."""

from __future__ import annotations

import asyncio
import threading

import pytest

from controlplane.gateway.ttl_cache import TTLCache


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


@pytest.fixture
def clock(monkeypatch):
    """The caches' clock, stopped and moved on only by hand (asyncio's own, for the waits, runs
    as it does): an entry's age does not depend on how busy the machine is."""
    import time
    import types

    from controlplane.gateway import ttl_cache

    moved, start = [0.0], time.monotonic()
    monkeypatch.setattr(ttl_cache, "time", types.SimpleNamespace(monotonic=lambda: start + moved[0]))
    return moved


def test_an_entry_near_the_end_of_its_life_is_reloaded_while_requests_go_on_with_it(clock):
    """Keys, tiers and engines are reloaded in the background near the end of their life: with
    a request every second (one long image request at a time), none waits on the database for
    them (one in two waited for the engines' two-second entry, several milliseconds each), and
    none is served an entry older than its life (a revoked key still stops in time)."""
    cache, loads = TTLCache(seconds=1.0), []
    release = threading.Event()

    def load():
        loads.append(1)
        if len(loads) > 1:
            release.wait(5)  # the reload is slow: nobody may wait for it
        return f"load {len(loads)}"

    async def requests():
        first = await cache.fetch("key", load)
        clock[0] += 0.8  # less than a quarter of its life left, still fresh
        second = await asyncio.wait_for(cache.fetch("key", load), timeout=0.1)
        await asyncio.sleep(2 * TTLCache.RELOAD_AFTER_S)  # the reload begun, after the request went on
        third = await asyncio.wait_for(cache.fetch("key", load), timeout=0.05)  # the reload under way: not another
        release.set()
        for _ in range(100):
            if cache.get("key") == "load 2":
                break
            await asyncio.sleep(0.01)
        return first, second, third

    assert asyncio.run(requests()) == ("load 1", "load 1", "load 1")
    assert (len(loads), cache.get("key")) == (2, "load 2")


def test_an_entry_past_its_life_is_waited_for_as_before():
    cache, loads = TTLCache(seconds=0.1), []

    def load():
        loads.append(1)
        return f"load {len(loads)}"

    async def requests():
        first = await cache.fetch("key", load)
        await asyncio.sleep(0.15)  # expired: no request goes on with it
        return first, await cache.fetch("key", load)

    assert asyncio.run(requests()) == ("load 1", "load 2")


def test_an_expired_entry_the_database_does_not_reload_in_time_is_served_as_known(settings):
    """A database cut off by the network answers nothing (no refusal to fail on): a request
    that finds its key expired goes on with what was known after GATEWAY_DATABASE_WAIT_MS, and
    the read, still under way, is shared rather than begun again."""
    settings.GATEWAY_DATABASE_WAIT_MS = 100
    cache, loads, release = TTLCache(seconds=0.05), [], threading.Event()

    def load():
        loads.append(1)
        if len(loads) > 1:
            release.wait(10)  # no answer
        return f"load {len(loads)}"

    async def requests():
        first = await cache.fetch("key", load)
        await asyncio.sleep(0.1)  # expired
        started = asyncio.get_running_loop().time()
        second = await asyncio.wait_for(cache.fetch("key", load), timeout=2)
        waited = asyncio.get_running_loop().time() - started
        await asyncio.sleep(TTLCache.RETRY_S)
        third = await asyncio.wait_for(cache.fetch("key", load), timeout=2)
        release.set()
        return first, second, third, waited

    first, second, third, waited = asyncio.run(requests())
    assert (first, second, third) == ("load 1", "load 1", "load 1")
    assert 0.1 <= waited < 0.5
    assert len(loads) == 2


def test_a_reload_ahead_that_fails_leaves_the_entry_and_is_not_tried_on_every_request(clock):
    cache, loads = TTLCache(seconds=1.0), []

    def load():
        loads.append(1)
        if len(loads) > 1:
            raise ConnectionError("the database does not answer")
        return "load 1"

    async def requests():
        await cache.fetch("key", load)
        clock[0] += 0.8
        seen = []
        for _ in range(10):
            seen.append(await cache.fetch("key", load))
            await asyncio.sleep(0.015)
        return seen

    assert asyncio.run(requests()) == ["load 1"] * 10
    assert len(loads) == 2  # one reload tried, then not again for TTLCache.RETRY_S


def test_an_entry_whose_reload_ahead_failed_is_not_served_past_its_life_once_the_database_answers(clock):
    """A key revoked while the database blinked: its reload ahead failed, and the database is
    back before the entry's life ends. The next request after that end loads it again (and
    finds it gone); it is not served what was known before for the reload's retry delay."""
    cache, answers = TTLCache(seconds=1.0), ["valid", ConnectionError("the database does not answer"), "revoked"]

    def load():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def requests():
        first = await cache.fetch("key", load)
        clock[0] += 0.8  # near its end: reloaded ahead, and that reload fails
        second = await cache.fetch("key", load)
        for _ in range(100):
            if len(answers) == 1:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)  # its failure noted
        clock[0] += 0.25  # past its life, well within TTLCache.RETRY_S of the failure
        return first, second, await cache.fetch("key", load)

    assert asyncio.run(requests()) == ("valid", "valid", "revoked")


def test_a_reload_that_ends_after_the_cache_was_cleared_is_dropped(clock):
    cache, release = TTLCache(seconds=1.0), threading.Event()
    loads = []

    def load():
        loads.append(1)
        if len(loads) > 1:
            release.wait(5)
        return f"load {len(loads)}"

    async def requests():
        await cache.fetch("key", load)
        clock[0] += 0.8
        await cache.fetch("key", load)
        await asyncio.sleep(2 * TTLCache.RELOAD_AFTER_S)  # the reload begun
        cache.clear()
        release.set()
        await asyncio.sleep(0.1)

    asyncio.run(requests())
    assert cache.get("key") is None
