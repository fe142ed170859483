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
import functools
import hashlib
import json
import logging
import time
import uuid
import weakref
from collections import deque

import orjson
import redis.exceptions
from asgiref.sync import sync_to_async
from django.conf import settings

from controlplane.gateway.apps import current_process
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
from controlplane.metering.services import metered_so_far, usage_record, usage_record_many
from controlplane.redis_clients import (
    async_redis,
    key_prefix,
    once_written,
    script_redis,
    sync_redis,
)

log = logging.getLogger(__name__)

# Quota counters: KEYS[1..4] = image tokens, total tokens (of the period), requests (of the
# minute), large images (at once), KEYS[5] = the period counters' epoch (set when they were
# started from what is metered); ARGV[1..3] = the ask (image, total, large), ARGV[4..7] the
# limits (-1: none). The journal: KEYS[6..8] = entries, heartbeats, and the epoch each
# reservation was made in; ARGV[8..10] = request id, entry, beat ('' when the request is not
# journaled here). ARGV[11] = '1' when reserving.
_ADMIT = """
local function over(key, ask, limit)
  if tonumber(limit) < 0 then return false end
  return tonumber(redis.call('GET', key) or '0') + tonumber(ask) > tonumber(limit)
end
if ARGV[11] == '1' then
  local epoch = redis.call('GET', KEYS[5])
  if not epoch then return -1 end
  if over(KEYS[1], ARGV[1], ARGV[4]) then return 1 end
  if over(KEYS[2], ARGV[2], ARGV[5]) then return 2 end
  if over(KEYS[3], 1, ARGV[6]) then return 3 end
  if ARGV[3] == '1' and over(KEYS[4], 1, ARGV[7]) then return 4 end
  redis.call('INCRBY', KEYS[1], ARGV[1])
  redis.call('INCRBY', KEYS[2], ARGV[2])
  redis.call('INCR', KEYS[3])
  redis.call('EXPIRE', KEYS[3], 120)
  if ARGV[3] == '1' then
    redis.call('INCR', KEYS[4])
    redis.call('EXPIRE', KEYS[4], 3600)
  end
  redis.call('HSET', KEYS[8], ARGV[8], epoch)
end
if ARGV[9] ~= '' then
  redis.call('HSET', KEYS[6], ARGV[8], ARGV[9])
  redis.call('HSET', KEYS[7], ARGV[8], ARGV[10])
end
return 0
"""
# Starting a period's counters from what is metered, once: KEYS = image, total, epoch.
_SEED = """
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[4])
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[4])
redis.call('SET', KEYS[3], ARGV[3], 'EX', ARGV[4])
return 1
"""
# Settling a reservation to what was used. Made in the counters' epoch: the difference is
# applied. Made before they were started again (Redis lost them meanwhile, and the new ones,
# counted from what was metered, do not hold it): what was used is added. No counters: left
# to be started from what is metered, with this request in it.
_SETTLE_FUNCTION = """
local function settle(image_key, total_key, large_key, epoch_key, epochs, id, image_delta, total_delta,
                      image_used, total_used, large)
  local reserved = redis.call('HGET', epochs, id)
  redis.call('HDEL', epochs, id)
  local current = redis.call('GET', epoch_key)
  if current then
    if reserved == current then
      redis.call('INCRBY', image_key, image_delta)
      redis.call('INCRBY', total_key, total_delta)
    else
      redis.call('INCRBY', image_key, image_used)
      redis.call('INCRBY', total_key, total_used)
    end
  end
  if large == '1' and reserved and tonumber(redis.call('GET', large_key) or '0') > 0 then
    redis.call('DECR', large_key)
  end
end
"""
_SETTLE = _SETTLE_FUNCTION + """
settle(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
return 0
"""
# KEYS = entries, heartbeats, the usage stream, the request's reaped mark, then the five keys
# to settle (or ''); ARGV = request id, '1' if journaled, the usage, '1' to settle, its six
# arguments, and the beat the reaper judged stale ('' from the gateway: a beat refreshed
# since means its gateway lives). An entry already gone was recorded by the reaper (its mark
# says so) or went with Redis (a restart): then the usage is handed over still.
_FINISH = _SETTLE_FUNCTION + """
local reaping = ARGV[11] ~= ''
if reaping and redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[11] then return 0 end
local held = redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if held == 0 and ARGV[2] == '1' and (reaping or redis.call('EXISTS', KEYS[4]) == 1) then return 0 end
redis.call('XADD', KEYS[3], '*', 'record', ARGV[3])
if reaping then redis.call('SET', KEYS[4], '1', 'EX', 86400) end
if ARGV[4] == '1' then settle(KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], ARGV[5], ARGV[6], ARGV[7], ARGV[8],
                              ARGV[9], ARGV[10]) end
return 1
"""
_BEAT = """
for i = 1, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
end
return 0
"""
_ORDER = ("image_tokens", "total_tokens", "requests_per_minute", "concurrent_large_images")


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


def _metered_with(tenant_id: int, period: str, now: dt.datetime, pending: dict) -> tuple[int, int]:
    image_used, total_used = metered_so_far(tenant_id, period, now)
    stored = set(UsageEvent.objects.filter(request_id__in=list(pending)).values_list("request_id", flat=True))
    for request_id, record in pending.items():
        if request_id not in stored:
            image, total = settlement(record)
            image_used, total_used = image_used + image, total_used + total
    return image_used, total_used


@functools.cache
def _sha(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


async def _eval(client, script: str, numkeys: int, *args):
    """Run a script by its hash (EVALSHA), sending its text only when Redis does not have it
    (first use, or a Redis that restarted): every request runs two or three of them, and
    sending each one's text every time was most of the bytes the gateway wrote to Redis."""
    try:
        return await client.evalsha(_sha(script), numkeys, *args)
    except redis.exceptions.NoScriptError:
        return await client.eval(script, numkeys, *args)  # which also caches it in Redis


def _beat(flight: Flight, now: float) -> str:
    return orjson.dumps({"t": now, "produced": flight.produced, "instance": flight.record.instance_id})


# One request of a key this minute, if it is under its limit: KEYS[1] the minute's counter,
# ARGV[1] the limit. Returns 1 when counted, 0 when refused.
_KEY_RATE = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
if used >= tonumber(ARGV[1]) then return 0 end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], 120)
return 1
"""
_KEY_RATE_RETURN = """
if tonumber(redis.call('GET', KEYS[1]) or '0') > 0 then redis.call('DECR', KEYS[1]) end
return 0
"""


# What a key's requests cost before admission. KEYS: the tenant's and the key's requests of
# the minute, the key's intake CPU (ms) and body bytes of the window; ARGV[1..4] their limits
# in those windows (-1: none). Which is reached (1..4), or 0, and then ARGV[5] bytes counted.
_INTAKE_OVER = """
for i = 1, 4 do
  local limit = tonumber(ARGV[i])
  if limit >= 0 and tonumber(redis.call('GET', KEYS[i]) or '0') >= limit then return i end
end
if tonumber(ARGV[5]) > 0 and tonumber(ARGV[4]) >= 0 then
  redis.call('INCRBY', KEYS[4], ARGV[5])
  redis.call('EXPIRE', KEYS[4], 30)
end
return 0
"""
# Counting it: ARGV[5] the CPU milliseconds, ARGV[6] the body bytes, ARGV[7] '1' when the
# request counts as one of the minute's (refused at intake: admission never counted it).
_INTAKE_CHARGE = """
for i = 3, 4 do
  if tonumber(ARGV[i + 2]) > 0 and tonumber(ARGV[i]) >= 0 then
    redis.call('INCRBY', KEYS[i], ARGV[i + 2])
    redis.call('EXPIRE', KEYS[i], 30)
  end
end
if ARGV[7] == '1' then
  for i = 1, 2 do
    if tonumber(ARGV[i]) >= 0 then
      redis.call('INCR', KEYS[i])
      redis.call('EXPIRE', KEYS[i], 120)
    end
  end
end
return 0
"""


class RedisLedger:
    def __init__(self, url: str | None = None, *, prefix: str | None = None):
        self.handed: deque = deque()  # (when, record) this process handed over, oldest first
        self.url, self.prefix = url or settings.REDIS_URL, prefix or key_prefix()
        self.inflight, self.beats = f"{self.prefix}:inflight", f"{self.prefix}:inflight:beat"
        self.epochs = f"{self.prefix}:inflight:epoch"
        self._marked = False  # whether this process has marked this Redis (see keep_safe)
        self._marking: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its marking

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

    # -- a key's own rate ------------------------------------------------------------------

    async def key_rate(self, key_id: int, limit: int, now: dt.datetime) -> bool:
        """Count one request of API key `key_id` this minute, unless it has had `limit`
        already (then False, counting nothing)."""
        counter = f"{self.prefix}:keyrpm:{key_id}:{minute_window(now)}"
        return bool(await _eval(self._scripts(), _KEY_RATE, 1, counter, limit))

    async def key_rate_return(self, key_id: int, now: dt.datetime) -> None:
        """Give back the request `key_rate` counted (its request was refused after all)."""
        await _eval(self._scripts(), _KEY_RATE_RETURN, 1, f"{self.prefix}:keyrpm:{key_id}:{minute_window(now)}")

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
        found = await _eval(self._scripts(), _INTAKE_OVER, *self._intake_call(tenant_id, key_id, limits, now),
                            take_bytes)
        return INTAKE[found - 1] if found else None

    async def intake_charge(self, tenant_id: int, key_id: int, limits: IntakeLimits, now: dt.datetime, *,
                            cpu_ms: int, body_bytes: int = 0, refused: bool) -> None:
        """Count a request's intake: its CPU time and body bytes, and, `refused` at intake, the
        request itself."""
        await _eval(self._scripts(), _INTAKE_CHARGE, *self._intake_call(tenant_id, key_id, limits, now),
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
        keys = self._quota_keys(tenant_id, window, now) + [self.inflight, self.beats, self.epochs]
        quota = [0, 0, 0, -1, -1, -1, -1] if limits is None else [
            ask.image_tokens, ask.total_tokens, int(ask.large),
            *(-1 if getattr(limits, name) is None else getattr(limits, name) for name in _ORDER)]
        client, scripts = self._client(), self._scripts()
        for _attempt in range(2):
            outcome = await _eval(scripts, _ADMIT, 8, *keys, *quota, *journal, "1" if limits else "0")
            if outcome == -1:  # the period's first request (or Redis lost them): start from what is metered
                await self.keep_safe()  # what Redis lost is in the database first
                image_used, total_used = await self._used(client, tenant_id, limits.period, now)
                ttl = seconds_to_period_end(limits.period, now) + 2 * 86400
                await _eval(scripts, _SEED, 3, keys[0], keys[1], keys[4], image_used, total_used, uuid.uuid4().hex, ttl)
                continue
            if outcome:
                raise refusal(_ORDER[outcome - 1], limits, now)
            return
        raise RuntimeError("quota counters could not be started")

    async def _used(self, client, tenant_id: int, period: str, now: dt.datetime) -> tuple[int, int]:
        """What the tenant has used this period: metered in the database, and handed over to
        the usage stream but not stored yet (each request once)."""
        since, pending = period_start(period, now), {}
        for _entry_id, fields in await client.xrange(stream_key(), count=500_000):
            data = orjson.loads(fields[b"record"])
            if data["tenant_id"] == tenant_id and dt.datetime.fromisoformat(data["created_at"]) >= since:
                pending[data["request_id"]] = usage_from_json(data)
        return await sync_to_async(_metered_with)(tenant_id, period, now, pending)

    def _settle_call(self, reservation: Reservation, image_tokens: int, total_tokens: int) -> tuple[list, list]:
        base, window = f"{self.prefix}:quota:{reservation.tenant_id}", reservation.period_window
        keys = [f"{base}:{window}:image_tokens", f"{base}:{window}:total_tokens", f"{base}:large",
                f"{base}:{window}:epoch", self.epochs]
        return keys, [reservation.id, image_tokens - reservation.ask.image_tokens,
                      total_tokens - reservation.ask.total_tokens, image_tokens, total_tokens,
                      int(reservation.ask.large)]

    async def settle(self, reservation: Reservation, *, image_tokens: int, total_tokens: int) -> None:
        """Correct a reservation to what was used (release it: 0 and 0)."""
        keys, args = self._settle_call(reservation, image_tokens, total_tokens)
        await _eval(self._scripts(), _SETTLE, 5, *keys, *args)

    # -- beat ------------------------------------------------------------------------------

    async def beat(self, flights: list[Flight]) -> None:
        now, args = time.time(), []
        for flight in flights:
            args += [flight.record.request_id, _beat(flight, now)]
        await _eval(self._scripts(), _BEAT, 2, self.inflight, self.beats, *args)

    # -- finish ----------------------------------------------------------------------------

    def _finish_call(self, record: UsageRecord, journaled: bool, stale_beat: str = "") -> tuple[list, list]:
        keys, args = [self.inflight, self.beats, stream_key(), f"{self.prefix}:reaped:{record.request_id}"], [
            record.request_id, "1" if journaled else "0", orjson.dumps(usage_to_json(record))]
        if record.reservation is not None:
            image_tokens, total_tokens = settlement(record)
            settle_keys, settle_args = self._settle_call(record.reservation, image_tokens, total_tokens)
            return keys + settle_keys, args + ["1", *settle_args, stale_beat]
        return keys + [""] * 5, args + ["0", "", 0, 0, 0, 0, 0, stale_beat]

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
                await _eval(self._scripts(), _FINISH, len(keys), *keys, *args)
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
                image_tokens, total_tokens = settlement(record)
                try:
                    await self.settle(record.reservation, image_tokens=image_tokens, total_tokens=total_tokens)
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
                reaped += client.eval(_FINISH, len(keys), *keys, *args)
            except Exception:  # one bad entry must not stop the others (nor the ingest after them)
                log.exception("could not record the interrupted request %s", request_id)
        return reaped
