"""The ledger in Redis (shared by every gateway replica): the quota counters, the in-flight
journal (two hashes: entries and heartbeats) and the usage stream, all beside each other, so
that each step is one Lua script and atomic.

- admit: check and reserve every limit, and open the journal entry, in one round trip (a
  second only when a counter must first be started from what is metered).
- beat: refresh the heartbeats of a gateway process's live requests, one script for all.
- finish: remove the entry, append the usage to the stream and settle the reservation, at
  once; an entry already removed means the reaper recorded it.
- reap: record the entries of dead gateways as interrupted, with the same finish script.
- keep_safe: a Redis without persistence that restarts loses the usage stream, records
  handed over but not yet ingested among it. Each process keeps what it handed over in the
  last HANDED_KEEP_S and, when it finds Redis started afresh (its marker gone), writes those
  to the database itself (stored once by request id, whoever gets there first).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import time
import uuid
import weakref
from collections import deque

import orjson
from asgiref.sync import sync_to_async
from django.conf import settings

from controlplane.gateway.apps import current_process
from controlplane.gateway.ledger import redis_scripts as lua
from controlplane.gateway.ledger.base import (
    INTAKE,
    Ask,
    Flight,
    IntakeLimits,
    Limits,
    Refused,
    Reservation,
    entry,
    intake_windows,
    interrupted,
    refusal,
    settlement,
)
from controlplane.metering.models import UsageEvent
from controlplane.metering.outbox import stream_key
from controlplane.metering.periods import (
    minute_window,
    period_start,
    period_window,
    seconds_to_period_end,
)
from controlplane.metering.records import UsageRecord, usage_from_json, usage_to_json
from controlplane.metering.services import (
    Metered,
    metered_usage,
    pending_prices,
    usage_record,
    usage_record_many,
)
from controlplane.redis_clients import (
    async_redis,
    key_prefix,
    once_written,
    script_redis,
    sync_redis,
)

log = logging.getLogger(__name__)

_ORDER = ("image_tokens", "total_tokens", "requests_per_minute", "concurrent_large_images", "spend", "key_spend")


HANDED_KEEP_S, HANDED_MAX = 120, 200_000  # well past the ingest's interval
_PROCESS = uuid.uuid4().hex  # each process finds a restart for itself: its own marker


def _store_all(records: list[UsageRecord]) -> None:
    try:
        usage_record_many(records=records)
    except Exception:  # some stored meanwhile (by the ingest): one by one, each once
        for record in records:
            try:
                usage_record(record=record)
            except Exception:  # as the ingest would: logged loudly, the others still stored
                log.exception("could not store the usage of %s", record.request_id)


def _as_stored(record: UsageRecord) -> UsageRecord:
    """A journal entry left behind by a gateway that finished its request while Redis did not
    answer (it wrote the usage to the database instead) is settled to that usage, the truth,
    not to what the journal knew."""
    stored = UsageEvent.objects.filter(request_id=record.request_id).values(
        "status", "http_status", "instance_id", "image_tokens", "text_tokens", "output_tokens").first()
    if stored is not None:
        for name, value in stored.items():
            setattr(record, name, value)
    return record


def _metered_with(tenant_id: int, period: str, now: dt.datetime, pending: dict, currency: str) -> Metered:
    """What the tenant has used this period: metered, and `pending` (handed over, not stored)."""
    metered = metered_usage(tenant_id, period, now, currency)
    image_used, total_used, spent = metered.image_tokens, metered.total_tokens, metered.spent
    stored = set(UsageEvent.objects.filter(request_id__in=list(pending)).values_list("request_id", flat=True)) \
        if pending else set()
    waiting = [record for request_id, record in pending.items() if request_id not in stored]
    for record, cost in zip(waiting, pending_prices(waiting, currency) if waiting else [], strict=True):
        image, total, _ = settlement(record)
        image_used, total_used = image_used + image, total_used + total
        for field in ("tenant", f"k{record.api_key_id or 0}"):
            spent[field] = spent.get(field, 0) + cost
    return Metered(image_used, total_used, spent)


def _beat(flight: Flight, now: float) -> str:
    return orjson.dumps({"t": now, "produced": flight.produced, "instance": flight.record.instance_id})


class RedisLedger:
    def __init__(self, url: str | None = None, *, prefix: str | None = None):
        self.handed: deque = deque()  # (when, record) this process handed over, oldest first
        self.url, self.prefix = url or settings.REDIS_URL, prefix or key_prefix()
        self.inflight, self.beats = f"{self.prefix}:inflight", f"{self.prefix}:inflight:beat"
        self.epochs = f"{self.prefix}:inflight:epoch"
        self._marked = False  # whether this process has marked this Redis (see keep_safe)
        self._marking: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its marking
        # event loop -> (tenant, its period's counters) -> the task starting them (see _seed_once)
        self._seeding: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _client(self):
        return async_redis(self.url)

    def _scripts(self):
        """What runs the ledger's scripts, two or three a request: one connection every
        request shares (redis_clients.script_redis)."""
        return script_redis(self.url)

    def _quota_keys(self, tenant_id: int, window: str, now: dt.datetime) -> list[str]:
        base = f"{self.prefix}:quota:{tenant_id}"
        return [f"{base}:{window}:image_tokens", f"{base}:{window}:total_tokens",
                f"{base}:rpm:{minute_window(now)}", f"{base}:large", f"{base}:{window}:epoch"]

    def _spend_key(self, tenant_id: int, window: str) -> str:
        return f"{self.prefix}:quota:{tenant_id}:{window}:spend"

    # -- a key's own rate ------------------------------------------------------------------

    async def key_rate(self, key_id: int, limit: int, now: dt.datetime) -> bool:
        """Count one request of API key `key_id` this minute, unless it has had `limit`
        already (then False, counting nothing)."""
        counter = f"{self.prefix}:keyrpm:{key_id}:{minute_window(now)}"
        return bool(await lua.run(self._scripts(), lua.KEY_RATE, 1, counter, limit))

    async def key_rate_return(self, key_id: int, now: dt.datetime) -> None:
        """Give back the request `key_rate` counted (its request was refused after all)."""
        await lua.run(self._scripts(), lua.KEY_RATE_RETURN, 1, f"{self.prefix}:keyrpm:{key_id}:{minute_window(now)}")

    # -- intake ----------------------------------------------------------------------------

    def _intake_call(self, tenant_id: int, key_id: int, limits: IntakeLimits, now: dt.datetime) -> list:
        windows = intake_windows(now)
        keys = [f"{self.prefix}:quota:{tenant_id}:rpm:{windows['requests_per_minute']}",
                f"{self.prefix}:keyrpm:{key_id}:{windows['key_requests_per_minute']}",
                f"{self.prefix}:keycpu:{key_id}:{windows['intake_cpu_ms']}",
                f"{self.prefix}:keybytes:{key_id}:{windows['intake_bytes']}"]
        return [4, *keys, *(-1 if limits.in_window(name) is None else limits.in_window(name) for name in INTAKE)]

    async def intake_over(self, tenant_id: int, key_id: int, limits: IntakeLimits, now: dt.datetime, *,
                          take_bytes: int = 0) -> str | None:
        """Which of `limits` the key has reached in its windows (its next request is refused),
        or None, and then `take_bytes` counted, at once."""
        found = await lua.run(self._scripts(), lua.INTAKE_OVER, *self._intake_call(tenant_id, key_id, limits, now),
                            take_bytes)
        return INTAKE[found - 1] if found else None

    async def intake_charge(self, tenant_id: int, key_id: int, limits: IntakeLimits, now: dt.datetime, *,
                            cpu_ms: int, body_bytes: int = 0, refused: bool) -> None:
        """Count a request's intake: its CPU time and body bytes, and, `refused` at intake, the
        request itself."""
        await lua.run(self._scripts(), lua.INTAKE_CHARGE, *self._intake_call(tenant_id, key_id, limits, now),
                    cpu_ms, body_bytes, "1" if refused else "0")

    # -- admit -----------------------------------------------------------------------------

    async def admit(self, flight: Flight, limits: Limits | None, ask: Ask | None, now: dt.datetime,
                    written: asyncio.Future | None = None) -> None:
        """Reserve `ask` against `limits` (none: no quota) and open the flight's journal entry,
        in one step: both or neither. Raises Refused, leaving nothing behind. `written` is
        resolved once the step is on its way to Redis, before Redis answers."""
        record = flight.record
        if limits is not None:
            record.reservation = Reservation(record.tenant_id, period_window(limits.period, now), ask,
                                             record.request_id)
        try:
            with once_written(written, "EVALSHA", "EVAL"):
                await self._run(record.tenant_id, limits, ask, now, journal=(
                    record.request_id, orjson.dumps(entry(record)), _beat(flight, time.time())))
        except Refused:
            record.reservation = None
            raise
        except Exception:
            # Redis may have run the admission and only its reply been lost (a timeout under
            # load): the request's record settles the reservation as it was made, released if
            # Redis made it, nothing taken back if not, and removes the entry if there is one.
            flight.journaled = True
            raise
        flight.journaled = True

    async def reserve(self, tenant_id: int, limits: Limits, ask: Ask, now: dt.datetime) -> Reservation:
        """Reserve without journaling (a quota check on its own)."""
        reservation = Reservation(tenant_id, period_window(limits.period, now), ask, f"res_{uuid.uuid4().hex}")
        await self._run(tenant_id, limits, ask, now, journal=(reservation.id, "", ""))
        return reservation

    async def _run(self, tenant_id: int, limits: Limits | None, ask: Ask | None, now: dt.datetime, *,
                   journal: tuple[str, str, str] = ("", "", "")) -> None:
        window = period_window(limits.period, now) if limits else ""
        spend_key = self._spend_key(tenant_id, window)
        keys = self._quota_keys(tenant_id, window, now) + [self.inflight, self.beats, self.epochs, spend_key]
        limit = {} if limits is None else {name: -1 if getattr(limits, name) is None else getattr(limits, name)
                                           for name in _ORDER}
        quota = [0, 0, 0, -1, -1, -1, -1] if limits is None else [
            ask.image_tokens, ask.total_tokens, int(ask.large), *(limit[name] for name in _ORDER[:4])]
        spend = [0, -1, "", -1] if limits is None else [
            ask.cost, limit["spend"], f"k{ask.key_id or 0}", limit["key_spend"]]
        client, scripts = self._client(), self._scripts()
        for _attempt in range(2):
            outcome = await lua.run(scripts, lua.ADMIT, 9, *keys, *quota, *journal, "1" if limits else "0", *spend)
            if outcome == -1:  # the period's first request (or Redis lost them): start from what is metered
                await self._seed_once(client, tenant_id, limits, now, keys, spend_key)
                continue
            if outcome:
                raise refusal(_ORDER[outcome - 1], limits, now)
            return
        raise RuntimeError("quota counters could not be started")

    async def _seed_once(self, client, tenant_id: int, limits: Limits, now: dt.datetime, keys: list,
                         spend_key: str) -> None:
        """Start the period's counters from what is metered. A burst of the period's first
        requests starts them once in this process: the others wait for it, then admit."""
        loop = asyncio.get_running_loop()
        seeding = self._seeding.setdefault(loop, {})
        task = seeding.get((tenant_id, spend_key))
        if task is None or task.done():
            task = seeding[(tenant_id, spend_key)] = loop.create_task(
                self._seed(client, tenant_id, limits, now, keys, spend_key))
            task.add_done_callback(lambda done: seeding.pop((tenant_id, spend_key), None) if seeding.get(
                (tenant_id, spend_key)) is done else None)
        await asyncio.shield(task)

    async def _seed(self, client, tenant_id: int, limits: Limits, now: dt.datetime, keys: list,
                    spend_key: str) -> None:
        await self.keep_safe()  # what Redis lost is in the database first
        used = await self._used(client, tenant_id, limits, now)
        ttl = seconds_to_period_end(limits.period, now) + 2 * 86400
        fields = [item for pair in {"seeded": 1, **used.spent}.items() for item in pair]
        await lua.run(self._scripts(), lua.SEED, 4, keys[0], keys[1], keys[4], spend_key, used.image_tokens,
                      used.total_tokens, uuid.uuid4().hex, ttl, *fields)

    async def _used(self, client, tenant_id: int, limits: Limits, now: dt.datetime) -> Metered:
        """What the tenant has used this period: metered in the database, and handed over to
        the usage stream but not stored yet (each request once)."""
        since, pending = period_start(limits.period, now), {}
        for _entry_id, fields in await client.xrange(stream_key(), count=500_000):
            data = orjson.loads(fields[b"record"])
            if data["tenant_id"] == tenant_id and dt.datetime.fromisoformat(data["created_at"]) >= since:
                pending[data["request_id"]] = usage_from_json(data)
        return await sync_to_async(_metered_with)(tenant_id, limits.period, now, pending, limits.currency)

    def _settle_call(self, reservation: Reservation, image_tokens: int, total_tokens: int,
                     cost: int) -> tuple[list, list]:
        base, window = f"{self.prefix}:quota:{reservation.tenant_id}", reservation.period_window
        keys = [f"{base}:{window}:image_tokens", f"{base}:{window}:total_tokens", f"{base}:large",
                f"{base}:{window}:epoch", self.epochs, self._spend_key(reservation.tenant_id, window)]
        return keys, [reservation.id, image_tokens - reservation.ask.image_tokens,
                      total_tokens - reservation.ask.total_tokens, image_tokens, total_tokens,
                      int(reservation.ask.large), reservation.key_field, cost - reservation.ask.cost, cost]

    async def settle(self, reservation: Reservation, *, image_tokens: int, total_tokens: int, cost: int = 0) -> None:
        """Correct a reservation to what was used (release it: 0 and 0)."""
        keys, args = self._settle_call(reservation, image_tokens, total_tokens, cost)
        await lua.run(self._scripts(), lua.SETTLE, 6, *keys, *args)

    # -- beat ------------------------------------------------------------------------------

    async def beat(self, flights: list[Flight]) -> None:
        now, args = time.time(), []
        for flight in flights:
            args += [flight.record.request_id, _beat(flight, now)]
        await lua.run(self._scripts(), lua.BEAT, 2, self.inflight, self.beats, *args)

    # -- finish ----------------------------------------------------------------------------

    def _finish_call(self, record: UsageRecord, journaled: bool, stale_beat: str = "") -> tuple[list, list]:
        keys, args = [self.inflight, self.beats, stream_key(), f"{self.prefix}:reaped:{record.request_id}"], [
            record.request_id, "1" if journaled else "0", orjson.dumps(usage_to_json(record))]
        if record.reservation is not None:
            settle_keys, settle_args = self._settle_call(record.reservation, *settlement(record))
            return keys + settle_keys, args + ["1", *settle_args, stale_beat]
        return keys + [""] * 6, args + ["0", "", 0, 0, 0, 0, 0, "", 0, 0, stale_beat]

    async def finish(self, flight: Flight, written: asyncio.Future | None = None) -> None:
        """Hand the usage over and settle, in one script; `written` is resolved once the script
        is on its way to Redis, before Redis replies (what follows a failed reply is done all
        the same)."""
        record = flight.record
        keys, args = self._finish_call(record, flight.journaled)
        if not self._marked:
            await self._mark()
        try:
            with once_written(written, "EVALSHA", "EVAL"):
                await lua.run(self._scripts(), lua.FINISH, len(keys), *keys, *args)
            self._remember(record)
        except Exception:  # Redis unreachable: the database is slower, but nothing is lost
            log.exception("usage journal unavailable; writing %s to the database", record.request_id)
            try:
                await sync_to_async(usage_record)(record=record)
            except Exception:  # the database neither: on disk until it answers
                log.exception("could not record the usage of %s", record.request_id)
                await sync_to_async(current_process().ledger_book.spool.write)(
                    record, journaled=flight.journaled, ledger="usage")
            # The reservation is settled by whoever removes the entry: here, or by the reaper
            # if it is still there (the usage it hands over again is stored once).
            held = None
            try:
                client = self._client()
                held = await client.hdel(self.inflight, record.request_id)
                await client.hdel(self.beats, record.request_id)
            except Exception:
                log.warning("could not remove %s from the usage journal", record.request_id)
            if (held or not flight.journaled) and record.reservation is not None:
                image_tokens, total_tokens, cost = settlement(record)
                try:
                    await self.settle(record.reservation, image_tokens=image_tokens, total_tokens=total_tokens,
                                      cost=cost)
                except Exception:
                    log.exception("could not settle the quota reservation of %s", record.request_id)

    async def _mark(self) -> None:
        """Before this process's first hand-over, Redis is marked (keep_safe), so that a marker
        missing later means Redis started afresh, not that this process had not looked yet.
        The first hand-overs all wait for the one marking (tried once: unmarked, the next look
        writes what was handed over to the database, which is safe)."""
        loop = asyncio.get_running_loop()
        marking = self._marking.get(loop)
        if marking is None:
            marking = self._marking[loop] = loop.create_task(self._mark_once())
        await asyncio.shield(marking)

    async def _mark_once(self) -> None:
        try:
            await self.keep_safe()
        except Exception as exc:
            log.warning("could not mark Redis for this process: %s", exc)
        self._marked = True

    # -- keep_safe -------------------------------------------------------------------------

    def _remember(self, record: UsageRecord) -> None:
        now = time.monotonic()
        self.handed.append((now, record))
        while self.handed and (self.handed[0][0] < now - HANDED_KEEP_S or len(self.handed) > HANDED_MAX):
            self.handed.popleft()

    @staticmethod
    def finish_spooled(record: UsageRecord, journaled: bool) -> bool:
        """A finish that waited on disk goes straight into the database: the usage stream is
        how Redis gets it there, and Redis could not be reached when it was spooled. (Its
        reservation settles by expiring with its period.)"""
        usage_record(record=record)
        return True

    async def keep_safe(self) -> int:
        """If Redis started afresh since this process last looked, store what it handed over
        lately in the database. Returns how many records it wrote."""
        client = self._client()
        marker = f"{self.prefix}:alive:{_PROCESS}"
        if await client.expire(marker, 3600):  # there still (and kept an hour more)
            return 0
        records = [record for _, record in list(self.handed)]
        if records:
            log.warning("Redis started afresh: writing the %s usage records handed over in the last %ss "
                        "to the database", len(records), HANDED_KEEP_S)
            await sync_to_async(_store_all)(records)
        await client.set(marker, "1", ex=3600)
        self._marked = True
        return len(records)

    # -- reap ------------------------------------------------------------------------------

    def reap(self, *, stale_before: float, now: float) -> int:
        """Two looks: an entry is reaped only if its beat is stale and still the same beat a
        second reaper run later, at least two heartbeats after the first. A live gateway has
        beaten by then, whatever its clock says and however long Redis was unreachable."""
        client = sync_redis(self.url)
        suspects_key = f"{self.beats}:suspect"
        all_beats, suspects = client.hgetall(self.beats), client.hgetall(suspects_key)
        if gone := set(suspects) - set(all_beats):
            client.hdel(suspects_key, *gone)
        reaped = 0
        for request_id, raw in all_beats.items():
            try:
                beat = json.loads(raw)
                if beat["t"] >= stale_before:
                    if request_id in suspects:
                        client.hdel(suspects_key, request_id)
                    continue
                seen = json.loads(suspects[request_id]) if request_id in suspects else None
                if seen is None or seen["beat"] != raw.decode():  # the first look
                    client.hset(suspects_key, request_id, json.dumps({"beat": raw.decode(), "at": now}))
                    continue
                if now - seen["at"] < 2 * settings.GATEWAY_HEARTBEAT_S:
                    continue  # its gateway may not have had its chance to beat yet
                client.hdel(suspects_key, request_id)
                data = client.hget(self.inflight, request_id)
                if data is None:  # finished between the two reads
                    client.hdel(self.beats, request_id)
                    continue
                record = _as_stored(interrupted(json.loads(data), beat))
                keys, args = self._finish_call(record, True, stale_beat=raw.decode())
                reaped += client.eval(lua.FINISH, len(keys), *keys, *args)
            except Exception:  # one bad entry must not stop the others (nor the ingest after them)
                log.exception("could not record the interrupted request %s", request_id)
        return reaped
