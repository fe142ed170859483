"""Redis clients: async ones for the gateway, one per event loop (a server has one loop;
tests may run several), and sync ones for workers; all bounded the same way.

A process with more requests in flight than connections waits for a free connection (up to
REDIS_POOL_WAIT_S) instead of failing at once, and a Redis that hangs (paused, overloaded)
fails a command after REDIS_TIMEOUT_S instead of holding the request: the caller answers a
503 or falls back, within a bounded time.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import socket
import weakref

import hiredis
import redis
import redis.asyncio
import redis.asyncio.connection
from django.conf import settings
from redis._parsers.base import BaseParser
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


def script_redis(url: str):
    """The client the gateway's ledger runs its scripts with, on this event loop: one
    connection multiplexed by every request (_Multiplexed), for a URL over TCP or a Unix socket;
    redis-py's pooled client for one over TLS. Either answers evalsha() and eval() alike."""
    per_loop = _clients.setdefault(asyncio.get_running_loop(), {})
    client = per_loop.get(("scripts", url))
    if client is None:
        options = redis.asyncio.connection.parse_url(url)
        over_tls = issubclass(options.get("connection_class", redis.asyncio.Connection), redis.asyncio.SSLConnection)
        client = per_loop[("scripts", url)] = async_redis(url) if over_tls else _Multiplexed(options)
    return client


class _Multiplexed:
    """Redis reached over one connection that every request's commands share: the commands of
    a turn of the event loop go out in one write, and the replies, which Redis sends in the
    order it was sent the commands, are matched to them in turn. redis-py's asyncio client
    spent 83-133 µs of CPU on each of the ledger's scripts (a connection taken from its pool,
    its stream written and drained, its reply read under a timeout, the connection put back);
    this takes 12-16 at 32 in flight.

    Bounded as the pooled clients are: a command not answered within REDIS_TIMEOUT_S fails with
    TimeoutError, and since the replies after it can no longer be matched, so does every other
    command then waiting on the connection, which is closed; the next command opens another
    (as does the next after Redis closed it). A command that cannot be packed is refused
    before anything is sent. A cancelled caller's reply is read and dropped."""

    def __init__(self, options: dict):
        self.options, self.timeout = options, settings.REDIS_TIMEOUT_S
        self._connection: _Connection | None = None
        self._connecting: asyncio.Task | None = None

    async def evalsha(self, sha: str, numkeys: int, *args):
        return await self._execute("EVALSHA", sha, numkeys, *args)

    async def eval(self, script: str, numkeys: int, *args):
        return await self._execute("EVAL", script, numkeys, *args)

    async def _execute(self, *args):
        connection = self._connection
        if connection is None or connection.failed is not None:
            connection = await self._connected()
        waiting = _on_written.get()
        written = waiting[0] if waiting is not None and args[0] in waiting[1] and not waiting[0].done() else None
        return await connection.send(args, written)

    async def _connected(self) -> _Connection:
        if self._connecting is None:
            self._connecting = asyncio.get_running_loop().create_task(self._connect())
            self._connecting.add_done_callback(self._connect_ended)
        return await asyncio.shield(self._connecting)

    def _connect_ended(self, task: asyncio.Task) -> None:
        self._connecting = None
        if not task.cancelled() and task.exception() is None:
            self._connection = task.result()

    async def _connect(self) -> _Connection:
        loop, options = asyncio.get_running_loop(), self.options
        try:
            async with asyncio.timeout(self.timeout):
                if "path" in options:
                    _, connection = await loop.create_unix_connection(
                        lambda: _Connection(loop, self.timeout), options["path"])
                else:
                    _, connection = await loop.create_connection(
                        lambda: _Connection(loop, self.timeout), options.get("host", "localhost"),
                        options.get("port", 6379))
        except (OSError, TimeoutError) as exc:
            raise redis.exceptions.ConnectionError(f"Error connecting to Redis: {exc}") from None
        try:
            if options.get("password"):
                await connection.send(("AUTH", *filter(None, (options.get("username"), options["password"]))), None)
            if options.get("db"):
                await connection.send(("SELECT", options["db"]), None)
        except BaseException as exc:
            connection._fail(exc if isinstance(exc, redis.exceptions.RedisError)
                             else redis.exceptions.ConnectionError("Redis connection abandoned"))
            raise
        return connection


_pack = HiredisRespSerializer().pack


class _Connection(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float):
        self.loop, self.timeout = loop, timeout
        self.reader = hiredis.Reader()
        # [the caller's answer, its deadline (once written)], oldest first: as Redis replies.
        self.waiting: collections.deque[list] = collections.deque()
        self.queued: list[list] = []  # the entries of this turn's write, not yet written
        self.outgoing: list[bytes] = []
        self.written: list[asyncio.Future] = []  # told once this turn's write is in the kernel's buffer
        self.transport: asyncio.Transport | None = None
        self.failed: Exception | None = None
        self.flushing = False
        self.watch: asyncio.TimerHandle | None = None

    def send(self, args: tuple, written: asyncio.Future | None) -> asyncio.Future:
        if self.failed is not None:
            raise _copy(self.failed)
        packed = _pack(*args)  # DataError for what Redis cannot take, before anything is queued
        answer = self.loop.create_future()
        entry = [answer, None]
        self.waiting.append(entry)
        self.queued.append(entry)
        self.outgoing += packed
        if written is not None:
            self.written.append(written)
        if not self.flushing:
            self.flushing = True
            self.loop.call_soon(self._flush)
        return answer

    def _flush(self) -> None:
        self.flushing = False
        if self.failed is not None:
            return
        outgoing, self.outgoing = self.outgoing, []
        written, self.written = self.written, []
        queued, self.queued = self.queued, []
        self.transport.writelines(outgoing)
        # Each command may go unanswered for the timeout from when it was written (as the
        # pooled clients count it), not from when it was queued behind a busy loop.
        deadline = self.loop.time() + self.timeout
        for entry in queued:
            entry[1] = deadline
        if self.watch is None:
            self.watch = self.loop.call_at(deadline, self._check)
        # All of it in the kernel's buffer, the connection still open (a failed send empties
        # the buffer too): it reaches Redis even if this process dies now. Otherwise each
        # caller is told when its command ends (until_written).
        if not self.transport.is_closing() and not self.transport.get_write_buffer_size():
            for future in written:
                if not future.done():
                    future.set_result(None)

    def _check(self) -> None:
        self.watch = None
        if not self.waiting:
            return
        deadline = self.waiting[0][1]  # the oldest command not yet answered (None: not yet written)
        if deadline is not None and deadline <= self.loop.time():
            self._fail(redis.exceptions.TimeoutError("Timeout reading from Redis"))
        else:
            self.watch = self.loop.call_at(deadline or self.loop.time() + self.timeout, self._check)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # A connection dropped on the way without a word (idle, behind a firewall) is
            # found out by the kernel within a minute, not by the next request's timeout.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
                if hasattr(socket, option):
                    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        try:
            while (reply := self.reader.gets()) is not False:
                answer, _ = self.waiting.popleft()
                if answer.done():  # its caller gave up
                    continue
                if isinstance(reply, hiredis.ReplyError):
                    try:
                        error = BaseParser.parse_error(str(reply))
                    except Exception:  # noqa: BLE001 - a reply redis-py cannot classify is still an error
                        error = redis.exceptions.ResponseError(str(reply))
                    answer.set_exception(error)
                else:
                    answer.set_result(reply)
        except (hiredis.ProtocolError, IndexError) as exc:  # not Redis, or a reply never asked for
            self._fail(redis.exceptions.ConnectionError(f"Redis's replies could not be read: {exc!r}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(redis.exceptions.ConnectionError(f"Connection to Redis lost: {exc or 'closed by the server'}"))

    def _fail(self, error: Exception) -> None:
        if self.failed is None:
            self.failed = error
        if self.transport is not None:
            self.transport.abort()
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None
        while self.waiting:
            answer, _ = self.waiting.popleft()
            if not answer.done():
                answer.set_exception(_copy(self.failed))  # each its own: tracebacks do not mix
        self.written, self.outgoing, self.queued = [], [], []  # their callers are told as their commands fail


def _copy(error: Exception) -> Exception:
    return type(error)(*error.args)


def sync_redis(url: str) -> redis.Redis:
    client = _sync_clients.get(url)
    if client is None:
        client = _sync_clients[url] = redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(
            url, **_bounds()))
    return client


def key_prefix() -> str:
    """Where this deployment's keys live in a shared Redis (CACHE_KEY_PREFIX)."""
    return settings.CACHES["default"].get("KEY_PREFIX", "vlmcp")
