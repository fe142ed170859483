"""Requests refused before a tier was chosen for them, kept where they can be seen without
letting anyone fill the database with them.

A refusal of a key of ours is kept in its tenant's usage, as any refused request is: a usable
key's refusals are bounded by its intake's throttle, like the rest of its requests. A key that
can no longer be used (revoked, expired, its tenant deactivated) has no throttle, and its
secret may be in the hands of a client left running or of whoever it leaked to: its refusals
are kept up to RECORDED_PER_KEY_MINUTE a minute by each gateway process, and only counted past
that (/metrics counts every refusal at authentication by its reason).

A request with no key of ours (none sent, or an unknown one) has no tenant, and anyone can send
it: it is only counted, on /metrics, and per minute in Redis for the operator's overview
(KeylessTally), each process adding its counts at most every TALLY_FLUSH_S. What it costs
before it is refused stays an increment in memory.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import redis
from django.conf import settings

from controlplane.gateway.recording import in_background
from controlplane.redis_clients import async_redis, key_prefix, sync_redis

log = logging.getLogger(__name__)
RECORDED_PER_KEY_MINUTE = 60
KEYLESS = ("missing", "unknown")  # the reasons of a refusal with no tenant to keep it for
TALLY_FLUSH_S = 5  # a process adds its counts to Redis at most this often
TALLY_KEEP_S = 2 * 3600  # each minute's count is kept this long: the overview reads the last hour


class RecordedRefusals:
    """How many refusals of each unusable key this process kept this minute (a key this
    minute's refusals named: no more of them than there are keys)."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.minute: int | None = None
        self.kept: Counter = Counter()  # key id -> refusals kept this minute

    def take(self, key_id: int) -> bool:
        """Whether one more refusal of `key_id` is kept."""
        minute = int(self.clock() // 60)
        if minute != self.minute:
            self.minute, self.kept = minute, Counter()
        self.kept[key_id] += 1
        return self.kept[key_id] <= RECORDED_PER_KEY_MINUTE


class KeylessTally:
    """This process's requests refused with no key of ours, per minute and reason, added to
    every replica's in Redis (a hash per minute) once TALLY_FLUSH_S after the first of them:
    one round trip however many came meanwhile. A count Redis does not take is dropped (it is
    on /metrics all the same): what waits is bounded by the minutes of one flush."""

    def __init__(self, url: str, prefix: str, clock: Callable[[], float] = time.time):
        self.url, self.prefix, self.clock = url, prefix, clock
        self.pending: Counter = Counter()  # (minute, reason) -> refusals not yet in Redis
        self.due_on: asyncio.AbstractEventLoop | None = None  # the loop a flush is due on

    @classmethod
    def from_settings(cls) -> KeylessTally | None:
        """None in embedded mode: no Redis, and /metrics is the count."""
        return cls(settings.REDIS_URL, key_prefix()) if settings.REDIS_URL else None

    def count(self, reason: str) -> None:
        self.pending[(int(self.clock() // 60), reason)] += 1
        loop = asyncio.get_running_loop()
        if self.due_on is not loop:  # none due yet (or due on a loop that has ended)
            self.due_on = loop
            loop.call_later(TALLY_FLUSH_S, self._flush_due)

    def _flush_due(self) -> None:
        self.due_on = None
        in_background(self.flush())

    async def flush(self) -> None:
        pending, self.pending = self.pending, Counter()
        if not pending:
            return
        try:
            async with async_redis(self.url).pipeline(transaction=False) as pipe:
                for (minute, reason), n in pending.items():
                    pipe.hincrby(tally_key(self.prefix, minute), reason, n)
                    pipe.expire(tally_key(self.prefix, minute), TALLY_KEEP_S)
                await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - an overview's count, not a bill: logged, dropped
            log.warning("could not count %s requests refused without a key: %s", sum(pending.values()), exc)


def tally_key(prefix: str, minute: int) -> str:
    return f"{prefix}:refused-keyless:{minute}"


@dataclass(frozen=True)
class KeylessCount:
    """Requests refused with no key of ours over the last minutes, every replica's."""

    by_reason: dict[str, int]
    busiest_minute: int

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())


def keyless_refusals(*, now: float, minutes: int = 60) -> KeylessCount | None:
    """What KeylessTally counted in the `minutes` up to `now` (seconds since the epoch), in
    one round trip; None without Redis, or when it does not answer."""
    if not settings.REDIS_URL:
        return None
    last = int(now // 60)
    try:
        pipe = sync_redis(settings.REDIS_URL).pipeline(transaction=False)
        for minute in range(last - minutes + 1, last + 1):
            pipe.hgetall(tally_key(key_prefix(), minute))
        rows = pipe.execute()
    except redis.RedisError as exc:
        log.warning("could not read the requests refused without a key: %s", exc)
        return None
    by_reason, busiest = Counter(), 0
    for row in rows:
        counts = {reason.decode(): int(n) for reason, n in row.items()}
        by_reason.update(counts)
        busiest = max(busiest, sum(counts.values()))
    return KeylessCount(by_reason={reason: by_reason[reason] for reason in KEYLESS}, busiest_minute=busiest)
