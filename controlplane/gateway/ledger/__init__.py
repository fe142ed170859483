"""The ledger: every forwarded request billed once and its quota settled once, whatever dies.

A request is admitted against its tenant's quota before it is forwarded: every limit is
checked and reserved in one atomic step (image tokens, total tokens with the max_tokens
ceiling, a slot of its minute and, for large images, a concurrency slot), so concurrent
requests on any number of gateways never overshoot. In the same step the request is
journaled: what was counted (image and text tokens, the image lines, the reservation), then
which engine took it and, for a stream, how many tokens it has produced, refreshed by one
heartbeat per gateway process for all its live requests.

Finishing a request removes its entry, hands its usage over and settles its reservation to
what was used, in one atomic step. Entries whose heartbeat stopped belong to a dead gateway:
`journal_reap`, run by the ingest task, records them as interrupted, billed for what the
journal knew (the prompt, and a stream's output as of its last heartbeat), and settles their
reservations. The same conditional removal serves both, so a request is finished by its
gateway or by the reaper, never by both: nothing lost, nothing counted twice.

One store holds it all, so each step is atomic: Redis (redis_store.py: counters, journal
and the usage stream, one Lua script per step) when USAGE_OUTBOX is redis, the database
otherwise (database_store.py: one transaction per step).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass, field

from asgiref.sync import sync_to_async
from django.conf import settings
from django.utils import timezone

from controlplane.gateway.apps import current_process
from controlplane.gateway.ledger import spool
from controlplane.gateway.ledger.base import (
    MICROS,
    SPEND,
    Ask,
    Flight,
    IntakeLimits,
    Ledger,
    Limits,
    Refused,
    Reservation,
    settlement,
)
from controlplane.gateway.ledger.database_store import DatabaseLedger
from controlplane.gateway.ledger.redis_store import RedisLedger
from controlplane.gateway.ledger.spool import Spool
from controlplane.metering.records import UsageRecord

__all__ = ("MICROS", "SPEND", "Ask", "DatabaseLedger", "Flight", "IntakeLimits", "LedgerBook", "Limits", "RedisLedger", "Refused", "Reservation", "admit",
           "engine_chosen", "finish", "intake_charge", "intake_over", "journal_reap", "ledger", "settlement")
log = logging.getLogger(__name__)

SPOOL_RETRY_S = 2.0
@dataclass(eq=False)
class LedgerBook:
    """What one process keeps of its requests in the ledger (its GatewayProcess holds it)."""

    live: dict[str, Flight] = field(default_factory=dict)  # admitted, not yet finished
    # Admissions refused with a 503 because the store's reply was lost: the store may have made
    # the reservation and the journal entry all the same. The request's record (its 503) settles
    # them as they were made. Bounded like `finished`.
    unsure: dict[str, Flight] = field(default_factory=dict)
    # Requests this process finished lately: a request is finished once (a second finish, from
    # whatever caller, hands over and settles nothing). Across processes the journal's
    # conditional removal does the same between a gateway and the reaper.
    finished: dict[str, None] = field(default_factory=dict)
    heartbeats: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)  # loop -> task
    stores: dict[tuple, Ledger] = field(default_factory=dict)  # one object per store
    spool: Spool = field(default_factory=Spool)  # its finishes no store could take


FINISHED_KEEP = 100_000


def _book() -> LedgerBook:
    return current_process().ledger_book


def ledger() -> Ledger:
    """The ledger of the store the settings name (one object per store, made once)."""
    store = settings.USAGE_OUTBOX
    key = (store, settings.REDIS_URL, settings.CACHES["default"].get("KEY_PREFIX")) if store == "redis" else (store,)
    stores = _book().stores
    found = stores.get(key)
    if found is None:
        found = stores[key] = RedisLedger() if store == "redis" else DatabaseLedger()
    return found


async def admit(record: UsageRecord, limits: Limits | None = None, ask: Ask | None = None,
                written: asyncio.Future | None = None) -> Flight:
    """Reserve the request against its quota (when it has one) and journal it, in one step.
    Raises Refused when a limit would be passed. `written`, if given, is resolved as soon as
    the step is on its way to Redis (see redis_clients.once_written), before Redis answers.

    Without a quota, a journal that cannot be written does not stop the request: its usage
    is still recorded when it ends. With one, the reservation cannot be made: it raises."""
    flight = Flight(record=record)
    try:
        await ledger().admit(flight, limits, ask, timezone.now(), written)
    except Refused:
        raise
    except Exception:
        if limits is not None:
            if flight.journaled:  # made or not, its store cannot say: settled as it was, when it ends
                _keep(_book().unsure, record.request_id, flight)
            raise
        flight.answered = False
        log.exception("could not journal %s; it is metered when it ends", record.request_id)
    _book().live[record.request_id] = flight
    _ensure_heartbeat()
    return flight


async def intake_over(tenant_id: int, key_id: int, limits: IntakeLimits, now, *, take_bytes: int = 0) -> str | None:
    """Which of `limits` a key's requests have reached in their windows (its next is refused
    before its intake), or None, and then `take_bytes` of body counted against it."""
    return await ledger().intake_over(tenant_id, key_id, limits, now, take_bytes=take_bytes)


async def intake_charge(tenant_id: int, key_id: int, limits: IntakeLimits, now, *, cpu_ms: int,
                        body_bytes: int = 0, refused: bool) -> None:
    """Count what a request's intake cost its key: CPU time, body bytes and, `refused` at intake
    (never admitted, so never counted), the request itself."""
    await ledger().intake_charge(tenant_id, key_id, limits, now, cpu_ms=cpu_ms, body_bytes=body_bytes,
                                 refused=refused)


async def key_rate(key_id: int, limit: int, now) -> bool:
    """One more request of an API key with a limit of its own in `now`'s minute (False:
    refused)."""
    return await ledger().key_rate(key_id, limit, now)


async def key_rate_return(key_id: int, now) -> None:
    """The request `key_rate` counted at `now` was refused by its tenant's quota after all: it
    does not count against the key either."""
    try:
        await ledger().key_rate_return(key_id, now)
    except Exception:
        log.warning("could not give back the minute's request of key %s", key_id)


async def engine_chosen(flight: Flight, instance_id: int) -> None:
    """Say which engine does the work (the reaper bills only work an engine did): nothing to
    say when it is the engine the request was journaled with at admission."""
    if flight.record.instance_id == instance_id:
        return
    flight.record.instance_id = instance_id
    if flight.journaled:
        try:
            await ledger().beat([flight])
        except Exception:
            log.warning("could not journal the engine of %s", flight.record.request_id)


async def finish(record: UsageRecord, written: asyncio.Future | None = None) -> None:
    """Hand the usage over and settle the reservation: once, by the gateway or the reaper.
    `written`, if given, is resolved as soon as the usage is on its way to Redis (see
    redis_clients.once_written), before Redis acknowledges it."""
    book = _book()
    if record.request_id in book.finished:
        log.warning("%s was finished already: not handed over or settled again", record.request_id)
        return
    flight = book.live.pop(record.request_id, None)
    if flight is None:
        unsure = book.unsure.pop(record.request_id, None)
        if unsure is not None:  # its admission's reply was lost: settled as the store made it
            record.reservation = unsure.record.reservation
        flight = Flight(record=record, journaled=unsure is not None)
    await ledger().finish(flight, written)
    _keep(book.finished, record.request_id, None)


def _keep(memory: dict, request_id: str, value) -> None:
    """Remember `value` for `request_id`, forgetting the oldest beyond FINISHED_KEEP."""
    memory[request_id] = value
    while len(memory) > FINISHED_KEEP:
        del memory[next(iter(memory))]


def _apply_spooled(record: UsageRecord, journaled: bool, kind: str) -> None:
    """A finish that waited on disk, recorded by the kind of ledger that spooled it."""
    store = DatabaseLedger() if kind == "database" else RedisLedger
    store.finish_spooled(record, journaled)


def drain_spool() -> int:
    """Move finished requests' usage that waited on disk into the ledger (see spool.py)."""
    return _book().spool.drain(_apply_spooled)


def _ensure_heartbeat() -> None:
    loop = asyncio.get_running_loop()
    heartbeats = _book().heartbeats
    task = heartbeats.get(loop)
    if task is None or task.done():
        heartbeats[loop] = loop.create_task(_heartbeat())


async def _heartbeat() -> None:
    """Every GATEWAY_HEARTBEAT_S, every live request's entry is refreshed (it is alive); every
    GATEWAY_PROGRESS_S, those of streams that produced since (what a client received is what
    its stream is billed if this process dies): one call for all of them either way. Each
    time, too, that what was handed over to a Redis that restarted afresh is kept safe, and
    (every SPOOL_RETRY_S) that usage spooled to disk moves into the ledger."""
    last_full, last_drain = time.monotonic(), 0.0
    while True:
        await asyncio.sleep(min(settings.GATEWAY_PROGRESS_S, settings.GATEWAY_HEARTBEAT_S))
        now = time.monotonic()
        full = now - last_full >= settings.GATEWAY_HEARTBEAT_S
        if full:
            last_full = now
        store = ledger()
        if spool.pending() and now - last_drain >= SPOOL_RETRY_S:
            last_drain = now
            try:
                await sync_to_async(drain_spool)()
            except Exception as exc:
                log.warning("could not move spooled usage: %s", exc)
        try:
            await store.keep_safe()
        except Exception as exc:  # the store unreachable: looked at again next time
            log.warning("could not check that the usage handed over is safe: %s", exc)
        flights = [flight for flight in list(_book().live.values())
                   if flight.journaled and (full or flight.produced != flight.beaten)]
        if not flights:
            continue
        produced = [flight.produced for flight in flights]
        try:
            await store.beat(flights)
        except Exception:
            log.exception("could not refresh the in-flight journal")
            continue
        for flight, count in zip(flights, produced, strict=True):
            flight.beaten = count


def journal_reap(*, now: float | None = None) -> int:
    """Record the requests of dead gateways as interrupted. Returns how many."""
    now = time.time() if now is None else now
    return ledger().reap(stale_before=now - settings.GATEWAY_JOURNAL_STALE_S, now=now)
