"""The gateway's Redis client packs its commands with hiredis: whatever it sends reaches Redis
as it was given, and what it cannot send is refused before anything is sent, as redis-py's
own packing does; a URL's scheme still chooses how it connects."""

from __future__ import annotations

import asyncio

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


# -- the scripts' shared connection ---------------------------------------------------------


def _on_the_shared_connection(url: str, body):
    """Run `body(client)` (a coroutine function) on a fresh event loop's script client."""
    from controlplane.redis_clients import script_redis

    @async_to_sync
    async def run():
        return await body(script_redis(url))

    return run()


def test_commands_sent_together_each_get_their_own_reply():
    """Hundreds of scripts in one turn of the loop go out together on one connection; each
    caller gets its own reply, errors included, and a cancelled caller's reply goes to no one."""
    skip_without_redis()

    async def body(client):
        from controlplane.redis_clients import _Multiplexed

        assert isinstance(client, _Multiplexed)
        calls = [client.eval(_ECHO, 0, f"call-{n}") for n in range(300)]
        failing = client.eval("return redis.error_reply('ERR refused on purpose')", 0)
        missing = client.evalsha("0" * 40, 0)
        dropped = asyncio.ensure_future(client.eval(_ECHO, 0, "dropped"))
        await asyncio.sleep(0)
        dropped.cancel()
        replies = await asyncio.gather(*calls, failing, missing, return_exceptions=True)
        after = await client.eval(_ECHO, 0, "after")
        return replies, after, client._connection

    replies, after, connection = _on_the_shared_connection(settings.REDIS_URL, body)
    assert replies[:300] == [[f"call-{n}".encode()] for n in range(300)]
    assert isinstance(replies[300], redis.exceptions.ResponseError) and "refused on purpose" in str(replies[300])
    assert isinstance(replies[301], redis.exceptions.NoScriptError)
    assert after == [b"after"] and connection.failed is None


def test_arguments_reach_redis_as_given_on_the_shared_connection_and_bad_ones_are_refused_first():
    skip_without_redis()
    large = "é" * 5000 + "x"
    sent = ["req_1", "ünïcode ✓", b"\xff\x00raw", 12, -1, 10**30, 1.5, large, memoryview(b"viewed"), ""]

    async def body(client):
        got = await client.eval(_ECHO, 0, *sent)
        for wrong in (None, True, {"a": 1}):
            with pytest.raises(redis.exceptions.DataError):
                await client.eval(_ECHO, 0, "fine", wrong)
        return got, await client.eval(_ECHO, 0, "next"), client._connection.failed

    got, after, failed = _on_the_shared_connection(settings.REDIS_URL, body)
    assert got == [b"req_1", "ünïcode ✓".encode(), b"\xff\x00raw", b"12", b"-1", str(10**30).encode(), b"1.5",
                   large.encode(), b"viewed", b""]
    assert after == [b"next"] and failed is None  # the same connection, not left half-written


@pytest.fixture
def own_redis():
    """A redis-server of the test's own, to pause or kill."""
    from tests.system.harness import RedisServer

    skip_without_redis()
    server = RedisServer()
    server.start()
    yield server
    server.kill()


def test_a_redis_that_stops_answering_fails_every_waiting_command_in_bounds_and_the_next_reconnects(
        own_redis, settings):
    async def body(client):
        assert await client.eval(_ECHO, 0, "before") == [b"before"]
        first = client._connection
        own_redis.pause()
        started = asyncio.get_running_loop().time()
        outcomes = await asyncio.gather(*(client.eval(_ECHO, 0, n) for n in range(5)), return_exceptions=True)
        waited = asyncio.get_running_loop().time() - started
        own_redis.resume()
        return outcomes, waited, await client.eval(_ECHO, 0, "again"), client._connection is not first

    settings.REDIS_TIMEOUT_S = 1
    outcomes, waited, again, reconnected = _on_the_shared_connection(own_redis.url, body)
    assert all(isinstance(outcome, redis.exceptions.TimeoutError) for outcome in outcomes)
    assert 1 <= waited < 3
    assert again == [b"again"] and reconnected


def test_a_redis_that_restarts_fails_what_was_waiting_and_the_next_command_reconnects(own_redis):
    async def body(client):
        assert await client.eval(_ECHO, 0, "before") == [b"before"]
        own_redis.kill()
        with pytest.raises(redis.exceptions.ConnectionError):
            await client.eval(_ECHO, 0, "while down")
        own_redis.start()
        return await client.eval(_ECHO, 0, "after")

    assert _on_the_shared_connection(own_redis.url, body) == [b"after"]


def test_a_redis_that_cannot_be_reached_is_a_connection_error():
    async def body(client):
        with pytest.raises(redis.exceptions.ConnectionError):
            await client.eval(_ECHO, 0, "nobody")
        return True

    assert _on_the_shared_connection("redis://127.0.0.1:1/0", body)


def test_the_shared_connection_authenticates_and_uses_the_urls_database(tmp_path):
    from tests.system.harness import RedisServer

    skip_without_redis()
    server = RedisServer(password="s3cret", unix_socket=str(tmp_path / "redis.sock"))
    server.start()
    try:
        setting = "return redis.call('SET', KEYS[1], ARGV[1])"
        for url in (f"redis://:s3cret@127.0.0.1:{server.port}/3", f"unix://:s3cret@{tmp_path / 'redis.sock'}?db=4"):
            async def body(client, url=url):
                return await client.eval(setting, 1, "where", url)

            assert _on_the_shared_connection(url, body) == b"OK"
        assert redis.Redis(port=server.port, password="s3cret", db=3).get("where").startswith(b"redis://")
        assert redis.Redis(port=server.port, password="s3cret", db=4).get("where").startswith(b"unix://")

        async def refused(client):
            with pytest.raises(redis.exceptions.AuthenticationError):
                await client.eval(_ECHO, 0, "x")
            return True

        assert _on_the_shared_connection(f"redis://:wrong@127.0.0.1:{server.port}/0", refused)
    finally:
        server.kill()


def test_a_script_is_told_written_once_it_is_on_its_way_before_redis_replies(settings):
    """What the admission beside the engine's work waits on: the script in the kernel's buffer,
    not Redis's reply (held here by a relay)."""
    from controlplane.redis_clients import once_written
    from tests.redis_relay import HeldReplies

    skip_without_redis()
    relay = HeldReplies(settings.REDIS_URL, b"marked-script")

    async def body(client):
        written = asyncio.get_running_loop().create_future()

        async def send():
            with once_written(written, "EVAL", "EVALSHA"):
                return await client.eval(_ECHO, 0, "marked-script")

        sending = asyncio.ensure_future(send())
        await asyncio.wait_for(written, 5)
        told_before_reply = not sending.done()
        relay.release()
        return told_before_reply, await sending

    try:
        assert _on_the_shared_connection(relay.url, body) == (True, [b"marked-script"])
    finally:
        relay.close()


def test_a_script_whose_write_fails_is_not_told_written():
    """The connection reset under it (RST, seen before the next poll): its bytes never reached
    the kernel, so what waits on it being on its way hears only of its failure."""
    import socket
    import struct
    import threading
    import time

    from controlplane.redis_clients import once_written

    server = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True).start()

    async def body(client):
        await client._connected()
        while not accepted:
            await asyncio.sleep(0.01)
        accepted[0].setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        accepted[0].close()
        time.sleep(0.2)  # the loop busy: the reset is there before its next poll
        written = asyncio.get_running_loop().create_future()

        async def finish():
            with once_written(written, "EVALSHA"):
                return await client.evalsha("0" * 40, 0)

        sending = asyncio.ensure_future(finish())
        await asyncio.wait({written, sending}, return_when=asyncio.FIRST_COMPLETED)
        told_written = written.done()
        with pytest.raises(redis.exceptions.ConnectionError):
            await sending
        return told_written

    try:
        assert _on_the_shared_connection(f"redis://127.0.0.1:{server.getsockname()[1]}/0", body) is False
    finally:
        server.close()


def test_an_error_reply_redis_py_cannot_classify_is_that_callers_error():
    """An error that looks like a cluster redirection but is not one fails its own caller, at
    once: it does not break the connection and leave the caller waiting past every bound."""
    skip_without_redis()

    async def body(client):
        with pytest.raises(redis.exceptions.ResponseError, match="ASK me"):
            await asyncio.wait_for(client.eval("return redis.error_reply('ASK me')", 0), 5)
        return await client.eval(_ECHO, 0, "next"), client._connection.failed

    assert _on_the_shared_connection(settings.REDIS_URL, body) == ([b"next"], None)


def test_a_script_queued_behind_a_busy_loop_has_the_whole_timeout_once_written(settings):
    """As the pooled clients count it: from when the command is written, not from when it was
    queued while the event loop was busy for longer than the timeout."""
    import time

    skip_without_redis()

    async def body(client):
        await client.eval(_ECHO, 0, "connected")
        queued = asyncio.ensure_future(client.eval(_ECHO, 0, "queued"))
        await asyncio.sleep(0)  # queued, not yet written
        time.sleep(1.3)  # the loop busy past the timeout
        return await queued

    settings.REDIS_TIMEOUT_S = 1
    assert _on_the_shared_connection(settings.REDIS_URL, body) == [b"queued"]
