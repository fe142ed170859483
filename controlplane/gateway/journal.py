"""The in-flight journal: usage that survives a gateway dying in the middle of a request.

A request's usage is recorded when it ends. A gateway killed before that moment (after the
engine has already done the work) would lose it, so every forwarded request is journaled
first: what was counted before forwarding (image and text tokens, the image lines, the quota
reservation), then which engine took it and, for a stream, how many tokens it had produced,
refreshed by one heartbeat per gateway process for all its live requests.

Finishing a request removes its entry, hands its usage over and settles its reservation in
one atomic step: a Lua script with Redis (the entry, the usage stream and the quota counters
live there), one transaction in embedded mode. Entries whose heartbeat stopped belong to a
dead gateway: `journal_reap`, run by the ingest task, records them as interrupted, billed for
what the journal knew (the prompt, and a stream's output as of its last heartbeat), and
settles their reservations. The same conditional removal serves both, so a request is
finished by its gateway or by the reaper, never by both: nothing lost, nothing counted twice.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import time
import weakref
from dataclasses import dataclass

from asgiref.sync import async_to_sync, sync_to_async
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane.gateway import admission
from controlplane.metering.services import (
    UsageRecord,
    is_billable,
    usage_from_json,
    usage_record,
    usage_to_json,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Flight:
    """A journaled request, as its gateway process sees it."""

    record: UsageRecord
    journaled: bool = False
    produced: int = 0  # output tokens streamed so far


_live: dict[str, Flight] = {}
_heartbeats: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its heartbeat task


def settlement(record: UsageRecord) -> tuple[int, int]:
    """Image and total tokens a finished request holds against its quota: what it used if
    it is billed, nothing if it is not."""
    if not is_billable(record):
        return 0, 0
    return record.image_tokens, record.text_tokens + record.image_tokens + record.output_tokens


def _entry(record: UsageRecord) -> dict:
    data = usage_to_json(record)
    if record.reservation is not None:
        data["reservation"] = admission.reservation_to_json(record.reservation)
    return data


def _beat(flight: Flight, now: float) -> str:
    return json.dumps({"t": now, "produced": flight.produced, "instance": flight.record.instance_id})


def _interrupted(data: dict, beat: dict | None) -> UsageRecord:
    """What a dead gateway's request is recorded as: counted before forwarding (its journal
    entry), plus what its last heartbeat knew."""
    record = usage_from_json(data)
    if data.get("reservation"):
        record.reservation = admission.reservation_from_json(data["reservation"])
    beat = beat or {}
    record.status, record.http_status = "interrupted", 502
    record.instance_id = beat.get("instance") or record.instance_id
    record.output_tokens = int(beat.get("produced") or 0)
    if beat.get("t"):
        started = record.created_at.timestamp()
        record.latency_ms = max(0, int((beat["t"] - started) * 1000))
    return record


# --- Redis: two hashes beside the usage stream ------------------------------------------------

_FINISH = admission.SETTLE_FUNCTION + """
if ARGV[8] ~= '' and redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[8] then return 0 end
local held = redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if held == 0 and ARGV[2] == '1' then return 0 end
redis.call('XADD', KEYS[3], '*', 'record', ARGV[3])
if ARGV[4] == '1' then settle(KEYS[4], KEYS[5], KEYS[6], ARGV[5], ARGV[6], ARGV[7]) end
return 1
"""
_BEAT = """
for i = 1, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
end
return 0
"""


def _keys() -> tuple[str, str]:
    from controlplane.redis_clients import key_prefix

    return f"{key_prefix()}:inflight", f"{key_prefix()}:inflight:beat"


def _finish_call(record: UsageRecord, journaled: bool, stale_beat: str = "") -> tuple[list, list]:
    """Keys and arguments of _FINISH: hand the usage over and settle the reservation. The
    reaper passes the beat it judged stale: a beat refreshed since means the gateway lives."""
    from controlplane.metering.outbox import stream_key

    inflight, beats = _keys()
    keys, args = [inflight, beats, stream_key()], [record.request_id, "1" if journaled else "0",
                                                   json.dumps(usage_to_json(record))]
    backend = admission.backend()
    if record.reservation is not None and isinstance(backend, admission.RedisAdmission):
        image_tokens, total_tokens = settlement(record)
        settle_keys, settle_args = backend.settle_plan(record.reservation, image_tokens=image_tokens,
                                                       total_tokens=total_tokens)
        return keys + settle_keys, args + ["1", *settle_args, stale_beat]
    return keys + ["", "", ""], args + ["0", 0, 0, 0, stale_beat]


class RedisJournal:
    def _client(self):
        from controlplane.redis_clients import async_redis

        return async_redis(settings.REDIS_URL)

    async def open(self, flight: Flight) -> None:
        inflight, beats = _keys()
        async with self._client().pipeline(transaction=True) as pipe:
            pipe.hset(inflight, flight.record.request_id, json.dumps(_entry(flight.record)))
            pipe.hset(beats, flight.record.request_id, _beat(flight, time.time()))
            await pipe.execute()

    async def beat(self, flights: list[Flight]) -> None:
        now, args = time.time(), []
        for flight in flights:
            args += [flight.record.request_id, _beat(flight, now)]
        await self._client().eval(_BEAT, 2, *_keys(), *args)

    async def finish(self, flight: Flight) -> None:
        record = flight.record
        keys, args = _finish_call(record, flight.journaled)
        try:
            await self._client().eval(_FINISH, len(keys), *keys, *args)
        except Exception:  # Redis unreachable: the database is slower, but nothing is lost
            log.exception("usage journal unavailable; writing %s to the database", record.request_id)
            await sync_to_async(usage_record)(record=record)
            # The reservation is settled by whoever removes the entry: here, or by the reaper
            # if it is still there (the usage it hands over again is stored once).
            held = None
            try:
                inflight, beats = _keys()
                held = await self._client().hdel(inflight, record.request_id)
                await self._client().hdel(beats, record.request_id)
            except Exception:
                log.warning("could not remove %s from the usage journal", record.request_id)
            if held or not flight.journaled:
                await _settle_apart(record)

    def reap(self, *, stale_before: float, now: float) -> int:
        """Two looks: an entry is reaped only if its beat is stale and still the same beat a
        second reaper run later, at least two heartbeats after the first. A live gateway has
        beaten by then, whatever its clock says and however long Redis was unreachable."""
        import redis

        client = redis.Redis.from_url(settings.REDIS_URL)
        inflight, beats = _keys()
        suspects_key = f"{beats}:suspect"
        all_beats, suspects = client.hgetall(beats), client.hgetall(suspects_key)
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
                entry = client.hget(inflight, request_id)
                if entry is None:  # finished between the two reads
                    client.hdel(beats, request_id)
                    continue
                record = _interrupted(json.loads(entry), beat)
                keys, args = _finish_call(record, True, stale_beat=raw.decode())
                reaped += client.eval(_FINISH, len(keys), *keys, *args)
            except Exception:  # one bad entry must not stop the others (nor the ingest after them)
                log.exception("could not record the interrupted request %s", request_id)
        return reaped


# --- The database (embedded mode) -------------------------------------------------------------

class DatabaseJournal:
    async def open(self, flight: Flight) -> None:
        await sync_to_async(self._open)(flight)

    def _open(self, flight: Flight) -> None:
        from controlplane.gateway.models import InFlightRequest

        InFlightRequest.objects.create(request_id=flight.record.request_id, record=_entry(flight.record),
                                       beat_at=timezone.now())

    async def beat(self, flights: list[Flight]) -> None:
        await sync_to_async(self._beat)(flights)

    def _beat(self, flights: list[Flight]) -> None:
        from controlplane.gateway.models import InFlightRequest

        now = timezone.now()
        for flight in flights:
            InFlightRequest.objects.filter(request_id=flight.record.request_id).update(
                beat_at=now, produced=flight.produced, instance_id=flight.record.instance_id)

    async def finish(self, flight: Flight) -> None:
        settled = await sync_to_async(self._finish)(flight.record, flight.journaled)
        if not settled:
            await _settle_apart(flight.record)

    def _finish(self, record: UsageRecord, journaled: bool) -> bool:
        """Store the usage, removing the entry; True when the reservation was settled too."""
        from controlplane.gateway.models import InFlightRequest

        backend = admission.backend()
        in_database = isinstance(backend, admission.DatabaseAdmission)
        with transaction.atomic():
            held = InFlightRequest.objects.filter(request_id=record.request_id).delete()[0]
            if journaled and not held:
                return True  # the reaper finished it already
            usage_record(record=record)
            if record.reservation is not None and in_database:
                image_tokens, total_tokens = settlement(record)
                backend.settle_sync(record.reservation, image_tokens=image_tokens, total_tokens=total_tokens)
        return in_database or record.reservation is None

    def reap(self, *, stale_before: float, now: float) -> int:
        from controlplane.gateway.models import InFlightRequest

        reaped = 0
        cutoff = dt.datetime.fromtimestamp(stale_before, tz=dt.UTC)
        moment = dt.datetime.fromtimestamp(now, tz=dt.UTC)
        for request_id in InFlightRequest.objects.filter(beat_at__lt=cutoff).values_list("request_id", flat=True):
            try:
                with transaction.atomic():
                    row = InFlightRequest.objects.select_for_update(skip_locked=True).filter(
                        request_id=request_id, beat_at__lt=cutoff).first()
                    if row is None:
                        continue
                    if row.suspected_beat != row.beat_at:  # the first look (see RedisJournal.reap)
                        row.suspected_beat, row.suspected_at = row.beat_at, moment
                        row.save(update_fields=["suspected_beat", "suspected_at"])
                        continue
                    if moment - row.suspected_at < dt.timedelta(seconds=2 * settings.GATEWAY_HEARTBEAT_S):
                        continue
                    beat = {"t": row.beat_at.timestamp(), "produced": row.produced, "instance": row.instance_id}
                    record = _interrupted(row.record, beat)
                    settled = self._finish(record, True)
            except Exception:  # one bad entry must not stop the others (nor the ingest after them)
                log.exception("could not record the interrupted request %s", request_id)
                continue
            if not settled:
                async_to_sync(_settle_apart)(record)
            reaped += 1
        return reaped


async def _settle_apart(record: UsageRecord) -> None:
    if record.reservation is None:
        return
    image_tokens, total_tokens = settlement(record)
    try:
        await admission.backend().settle(record.reservation, image_tokens=image_tokens, total_tokens=total_tokens)
    except Exception:
        log.exception("could not settle the quota reservation of %s", record.request_id)


def journal() -> RedisJournal | DatabaseJournal:
    return RedisJournal() if settings.USAGE_OUTBOX == "redis" else DatabaseJournal()


# --- What the gateway calls -------------------------------------------------------------------

async def open_flight(record: UsageRecord) -> Flight:
    """Journal a request about to be forwarded. A journal that cannot be written does not
    stop the request: its usage is still recorded when it ends."""
    flight = Flight(record=record)
    try:
        await journal().open(flight)
        flight.journaled = True
    except Exception:
        log.exception("could not journal %s; it is metered when it ends", record.request_id)
    _live[record.request_id] = flight
    _ensure_heartbeat()
    return flight


async def engine_chosen(flight: Flight, instance_id: int) -> None:
    """Say which engine does the work (the reaper bills only work an engine did)."""
    flight.record.instance_id = instance_id
    if flight.journaled:
        try:
            await journal().beat([flight])
        except Exception:
            log.warning("could not journal the engine of %s", flight.record.request_id)


async def finish(record: UsageRecord) -> None:
    """Hand the usage over and settle the reservation: once, by the gateway or the reaper."""
    flight = _live.pop(record.request_id, None) or Flight(record=record)
    await journal().finish(flight)


def _ensure_heartbeat() -> None:
    loop = asyncio.get_running_loop()
    task = _heartbeats.get(loop)
    if task is None or task.done():
        _heartbeats[loop] = loop.create_task(_heartbeat())


async def _heartbeat() -> None:
    while True:
        await asyncio.sleep(settings.GATEWAY_HEARTBEAT_S)
        flights = [flight for flight in list(_live.values()) if flight.journaled]
        if not flights:
            continue
        try:
            await journal().beat(flights)
        except Exception:
            log.exception("could not refresh the in-flight journal")


def journal_reap(*, now: float | None = None) -> int:
    """Record the requests of dead gateways as interrupted. Returns how many."""
    now = time.time() if now is None else now
    return journal().reap(stale_before=now - settings.GATEWAY_JOURNAL_STALE_S, now=now)
