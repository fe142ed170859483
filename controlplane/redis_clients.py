"""Redis clients: async ones for the gateway, one per event loop (a server has one loop;
tests may run several), and sync ones for workers; all bounded the same way.

A process with more requests in flight than connections waits for a free connection (up to
REDIS_POOL_WAIT_S) instead of failing at once, and a Redis that hangs (paused, overloaded)
fails a command after REDIS_TIMEOUT_S instead of holding the request: the caller answers a
503 or falls back, within a bounded time.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import weakref

import redis
import redis.asyncio
from redis.connection import HiredisRespSerializer

_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_sync_clients: dict[str, redis.Redis] = {}
_on_written: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("on_written", default=None)


class _PackedByHiredis:
    """redis-py packs the commands of its sync connections with hiredis (C) and those of its
    asyncio ones in Python: a ledger script's twenty arguments took 21 µs to pack in Python,
    7 with hiredis, twice a request. Its asyncio connections pack with hiredis too here."""

    _packer = HiredisRespSerializer()

    def pack_command(self, *args):
        return self._packer.pack(*args)

    async def send_command(self, *args, **kwargs) -> None:
        await super().send_command(*args, **kwargs)
        waiting = _on_written.get()
        # Only the command named (a new connection's own commands, sent first, are not it),
        # all of it in the kernel's buffer, none left in the event loop's: it reaches Redis
        # even if this process dies now.
        if waiting is not None and str(args[0]).upper() in waiting[1] and not waiting[0].done() \
                and not self._writer.transport.get_write_buffer_size():
            waiting[0].set_result(None)


@contextlib.contextmanager
def once_written(written: asyncio.Future | None, *commands: str):
    """Within it, `written` (None: nothing to tell) is resolved as soon as one of `commands`
    (by name) sent by this task has been written to its connection, before Redis replies: what
    waits on the command being on its way, not on Redis's acknowledgement, waits on `written`."""
    if written is None:
        yield
        return
    token = _on_written.set((written, frozenset(name.upper() for name in commands)))
    try:
        yield
    finally:
        _on_written.reset(token)


async def until_written(sending: asyncio.Task, written: asyncio.Future) -> None:
    """Wait until `sending` has written its command (resolving `written` within once_written),
    or has ended without writing it (a store that cannot be reached, or none to write to)."""
    sending.add_done_callback(lambda _: written.done() or written.set_result(None))
    await written  # cancelled with the caller, which `sending` does not look at again


@functools.cache
def _packed_by_hiredis(connection_class: type) -> type:
    return type(connection_class.__name__, (_PackedByHiredis, connection_class), {})


def _bounds() -> dict:
    from django.conf import settings

    return {"max_connections": settings.REDIS_POOL_SIZE, "timeout": settings.REDIS_POOL_WAIT_S,
            "socket_timeout": settings.REDIS_TIMEOUT_S, "socket_connect_timeout": settings.REDIS_TIMEOUT_S,
            "health_check_interval": 30}


def async_redis(url: str) -> redis.asyncio.Redis:
    per_loop = _clients.setdefault(asyncio.get_running_loop(), {})
    client = per_loop.get(url)
    if client is None:
        pool = redis.asyncio.BlockingConnectionPool.from_url(url, **_bounds())
        # The class the URL's scheme chose (TCP, TLS, a Unix socket), packing with hiredis.
        pool.connection_class = _packed_by_hiredis(pool.connection_class)
        client = per_loop[url] = redis.asyncio.Redis(connection_pool=pool)
    return client


def sync_redis(url: str) -> redis.Redis:
    client = _sync_clients.get(url)
    if client is None:
        client = _sync_clients[url] = redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(
            url, **_bounds()))
    return client


def key_prefix() -> str:
    """Where this deployment's keys live in a shared Redis (CACHE_KEY_PREFIX)."""
    from django.conf import settings

    return settings.CACHES["default"].get("KEY_PREFIX", "vlmcp")
