"""A cache of what the gateway reads from the database: entries fresh for seconds, reloaded
ahead of their end while requests keep coming, and served stale for a while when the
database does not answer."""

from __future__ import annotations

import asyncio
import logging
import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection

log = logging.getLogger(__name__)


def _loaded(load):
    """`load()` on the database thread; a connection that failed is closed, so that the next
    try connects afresh (a database that restarted broke every connection open to it)."""
    try:
        return load()
    except Exception:
        if not connection.in_atomic_block:
            connection.close()
        raise


class TTLCache:
    """Entries fresh for `seconds`. One with less than a quarter of its life left is reloaded
    in the background, RELOAD_AFTER_S after the first request that finds it so, which goes on
    with it (still fresh): while requests keep coming none waits on the database, and the
    reload runs once that request has been sent on, not beside its own work (at one request a
    second, as with long image requests, one in two had waited for the engines' entry: several
    milliseconds of ORM each). A reload ahead that fails is tried again after RETRY_S, and the
    entry still ends when its life does. An expired entry stays behind: when the database
    cannot refresh it, or does not within GATEWAY_DATABASE_WAIT_MS, it is served stale (for at
    most GATEWAY_STALE_MAX_S), and the refresh is tried again after RETRY_S rather than on every
    request."""

    RETRY_S = 1.0
    RELOAD_AFTER_S = 0.05

    def __init__(self, seconds: float, max_items: int = 10_000):
        self.seconds, self.max_items = seconds, max_items
        # key -> [fresh until, value, served stale until (a load failed), reload ahead not before]
        self._items: dict = {}
        self._loading: dict = {}  # key -> the load under way, which requests arriving meanwhile await
        self._ahead: set = set()  # keys whose reload ahead of expiry is due to start
        self._generation = 0  # cleared: a reload begun before is dropped

    def get(self, key):
        item = self._items.get(key)
        if item is None or item[0] < time.monotonic():
            return None
        return item[1]

    def put(self, key, value):
        if len(self._items) >= self.max_items:
            # Drop the expired, then the oldest tenth: a flood of random keys must not flush
            # the valid ones (and send every lookup to the database).
            now = time.monotonic()
            for stale in [k for k, (expiry, *_) in self._items.items() if expiry < now]:
                del self._items[stale]
            for oldest in list(self._items)[: max(1, len(self._items) // 10)]:
                del self._items[oldest]
        self._items.pop(key, None)
        self._items[key] = [time.monotonic() + self.seconds, value, 0.0, 0.0]

    async def fetch(self, key, load):
        """The entry, loaded with `load` (a function run on the database thread) when not
        fresh; the stale entry when loading fails, while it is not too old."""
        now = time.monotonic()
        item = self._items.get(key)
        if item is not None and (item[0] >= now or item[2] > now):
            if item[0] >= now and item[0] - now < self.seconds / 4 and item[3] <= now:
                self._reload_ahead(key, load, item)
            return item[1]
        loading = self._load(key, load)
        fallback = item is not None and now - item[0] <= settings.GATEWAY_STALE_MAX_S
        try:
            # With something to go on with, wait for the database only so long: cut off by the
            # network, it answers nothing rather than refusing. The read goes on regardless.
            async with asyncio.timeout(settings.GATEWAY_DATABASE_WAIT_MS / 1000 if fallback else None):
                value = await asyncio.shield(loading)
        except Exception:
            if not fallback:
                raise
            item[2] = now + self.RETRY_S
            log.warning("the database does not answer; serving what was known %.0fs ago", now - item[0] + self.seconds)
            return item[1]
        self.put(key, value)
        return value

    def _load(self, key, load) -> asyncio.Future:
        # One load per key at a time: the requests that find an entry expired together (32 at
        # once under load) share one query instead of queueing 32 on the database thread.
        loading = self._loading.get(key)
        if loading is None or loading.get_loop() is not asyncio.get_running_loop():
            loading = self._loading[key] = asyncio.ensure_future(sync_to_async(_loaded)(load))
            loading.add_done_callback(lambda done: self._loading.pop(key, None) if self._loading.get(key) is done
                                      else None)
        return loading

    def _reload_ahead(self, key, load, item: list) -> None:
        """Reload `item` (fresh, near its end) without anyone waiting for it; a failed reload
        leaves it as it is, and is tried again after RETRY_S at the soonest."""
        if key in self._ahead or key in self._loading:
            return
        self._ahead.add(key)
        generation = self._generation

        def reloaded(done: asyncio.Future) -> None:
            if done.cancelled() or generation != self._generation:
                return
            if done.exception() is not None:
                item[3] = time.monotonic() + self.RETRY_S  # not a licence to outlive its life
                log.debug("reloading %r ahead of its expiry failed: %r", key, done.exception())
            elif self._items.get(key) is item:  # not replaced meanwhile by a load a request awaited
                self.put(key, done.result())

        def start() -> None:
            if generation != self._generation:
                return
            self._ahead.discard(key)
            self._load(key, load).add_done_callback(reloaded)

        asyncio.get_running_loop().call_later(self.RELOAD_AFTER_S, start)

    def clear(self):
        self._generation += 1
        self._items.clear()
        self._loading.clear()
        self._ahead.clear()
