"""The ledger in the database (embedded mode, or USAGE_OUTBOX=database): quota counters as
row-locked rows, the in-flight journal as a table, usage written straight to its events.
Each step is one transaction.

- admit: check and reserve every limit (conditional updates of locked rows) and open the
  journal entry, in one transaction: both or neither.
- beat: refresh the live requests' rows.
- finish: remove the entry, store the usage and settle the reservation, at once; an entry
  already removed means the reaper recorded it.
- reap: record the entries of dead gateways as interrupted, with the same finish.
"""

from __future__ import annotations

import datetime as dt
import logging

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.db.models.functions import Greatest
from django.utils import timezone

from controlplane.gateway.apps import current_process
from controlplane.gateway.ledger.base import (
    INTAKE,
    Ask,
    Flight,
    IntakeLimits,
    Limits,
    Reservation,
    entry,
    intake_windows,
    interrupted,
    refusal,
    settlement,
)
from controlplane.gateway.models import InFlightRequest
from controlplane.metering.periods import minute_window, period_window
from controlplane.metering.records import UsageRecord
from controlplane.metering.services import metered_so_far, metered_spend, usage_record
from controlplane.tenants.models import ApiKey, QuotaCounter

log = logging.getLogger(__name__)


def _key_spend(reservation: Reservation) -> str:
    """The counter of what the reservation's key has spent."""
    return f"key{reservation.ask.key_id or 0}:spend"


class DatabaseLedger:
    # -- admit -----------------------------------------------------------------------------

    async def admit(self, flight: Flight, limits: Limits | None, ask: Ask | None, now: dt.datetime,
                    written=None) -> None:
        """As admit_sync (`written` is not used: a caller waiting on it waits for the commit)."""
        await sync_to_async(self.admit_sync)(flight, limits, ask, now)

    def admit_sync(self, flight: Flight, limits: Limits | None, ask: Ask | None, now: dt.datetime) -> None:
        """Reserve `ask` against `limits` (none: no quota) and open the flight's journal entry,
        in one transaction. Raises Refused, leaving nothing behind."""
        record = flight.record
        for _attempt in range(3):
            try:
                with transaction.atomic():
                    if limits is not None:
                        record.reservation = self._reserve(record.tenant_id, limits, ask, now)
                    InFlightRequest.objects.create(request_id=record.request_id, record=entry(record),
                                                   beat_at=timezone.now())
                flight.journaled = True
                return
            except IntegrityError:  # two first requests created the same counter: go again
                record.reservation = None
                continue
            except BaseException:
                record.reservation = None
                raise
        raise RuntimeError("quota counters could not be created")

    def reserve_sync(self, tenant_id: int, limits: Limits, ask: Ask, now: dt.datetime) -> Reservation:
        """Reserve without journaling (a quota check on its own)."""
        for _attempt in range(3):
            try:
                with transaction.atomic():
                    return self._reserve(tenant_id, limits, ask, now)
            except IntegrityError:
                continue
        raise RuntimeError("quota counters could not be created")

    async def reserve(self, tenant_id: int, limits: Limits, ask: Ask, now: dt.datetime) -> Reservation:
        return await sync_to_async(self.reserve_sync)(tenant_id, limits, ask, now)

    @staticmethod
    def _intake_counters(key_id: int) -> dict[str, str]:
        return {"requests_per_minute": "requests_per_minute", "key_requests_per_minute": f"key{key_id}:rpm",
                "intake_cpu_ms": f"key{key_id}:intake_ms", "intake_bytes": f"key{key_id}:intake_bytes"}

    async def intake_over(self, tenant_id: int, key_id: int, limits: IntakeLimits, now: dt.datetime, *,
                          take_bytes: int = 0) -> str | None:
        return await sync_to_async(self.intake_over_sync)(tenant_id, key_id, limits, now, take_bytes=take_bytes)

    def intake_over_sync(self, tenant_id: int, key_id: int, limits: IntakeLimits, now: dt.datetime, *,
                         take_bytes: int = 0) -> str | None:
        """Which of `limits` the key has reached in its windows (its next request is refused),
        or None, and then `take_bytes` counted."""
        counters, windows = self._intake_counters(key_id), intake_windows(now)
        rows = QuotaCounter.objects.filter(tenant_id=tenant_id, key__in=counters.values())
        used = {key: count for key, window, count in rows.values_list("key", "window", "used")
                if window in windows.values()}
        reached = next((name for name in INTAKE if limits.in_window(name) is not None
                        and used.get(counters[name], 0) >= limits.in_window(name)), None)
        if reached is None and take_bytes:
            self.intake_charge_sync(tenant_id, key_id, limits, now, cpu_ms=0, body_bytes=take_bytes, refused=False)
        return reached

    async def intake_charge(self, tenant_id: int, key_id: int, limits: IntakeLimits, now: dt.datetime, *,
                            cpu_ms: int, body_bytes: int = 0, refused: bool) -> None:
        await sync_to_async(self.intake_charge_sync)(tenant_id, key_id, limits, now, cpu_ms=cpu_ms,
                                                     body_bytes=body_bytes, refused=refused)

    def intake_charge_sync(self, tenant_id: int, key_id: int, limits: IntakeLimits, now: dt.datetime, *,
                           cpu_ms: int, body_bytes: int = 0, refused: bool) -> None:
        """Count a request's intake: its CPU time and body bytes, and, `refused` at intake, the
        request itself."""
        counters, windows = self._intake_counters(key_id), intake_windows(now)
        amounts = {"intake_cpu_ms": cpu_ms, "intake_bytes": body_bytes}
        if refused:
            amounts.update({"requests_per_minute": 1, "key_requests_per_minute": 1})
        plan = [(counters[name], amount, windows[name]) for name, amount in amounts.items()
                if amount and limits.of(name) is not None]
        for _attempt in range(3):
            try:
                with transaction.atomic():
                    for counter, amount, window in plan:
                        row, _ = QuotaCounter.objects.select_for_update().get_or_create(
                            tenant_id=tenant_id, key=counter, defaults={"window": window, "used": 0})
                        if row.window != window:
                            row.window, row.used = window, 0
                        row.used += amount
                        row.save(update_fields=["window", "used"])
                return
            except IntegrityError:  # two first requests created the same counter: go again
                continue

    async def key_rate(self, key_id: int, limit: int, now: dt.datetime) -> bool:
        return await sync_to_async(self.key_rate_sync)(key_id, limit, now)

    def key_rate_sync(self, key_id: int, limit: int, now: dt.datetime) -> bool:
        """Count one request of API key `key_id` this minute on its locked counter row,
        unless it has had `limit` already."""
        name, window = f"key{key_id}:rpm", minute_window(now)
        with transaction.atomic():
            row = QuotaCounter.objects.select_for_update().filter(key=name).first()
            if row is None:
                tenant_id = ApiKey.objects.values_list("tenant_id", flat=True).get(pk=key_id)
                QuotaCounter.objects.get_or_create(tenant_id=tenant_id, key=name, defaults={"window": "", "used": 0})
                row = QuotaCounter.objects.select_for_update().get(key=name)
            if row.window != window:
                row.window, row.used = window, 0
            if row.used >= limit:
                return False
            row.used += 1
            row.save(update_fields=["window", "used"])
        return True

    async def key_rate_return(self, key_id: int, now: dt.datetime) -> None:
        await sync_to_async(self.key_rate_return_sync)(key_id, now)

    def key_rate_return_sync(self, key_id: int, now: dt.datetime) -> None:
        """Give back the request `key_rate` counted this minute (its request was refused)."""
        QuotaCounter.objects.filter(key=f"key{key_id}:rpm", window=minute_window(now), used__gt=0) \
            .update(used=F("used") - 1)

    def _reserve(self, tenant_id: int, limits: Limits, ask: Ask, now: dt.datetime) -> Reservation:
        """Inside a transaction: every limit checked and reserved on its locked row, or none."""
        window = period_window(limits.period, now)
        reservation = Reservation(tenant_id, window, ask)
        plan = [("image_tokens", "image_tokens", ask.image_tokens, window),
                ("total_tokens", "total_tokens", ask.total_tokens, window),
                ("requests_per_minute", "requests_per_minute", 1, minute_window(now)),
                ("spend", "spend", ask.cost, window), ("key_spend", _key_spend(reservation), ask.cost, window)]
        if ask.large:
            plan.append(("concurrent_large_images", "concurrent_large_images", 1, ""))
        with transaction.atomic():
            for name, counter, amount, counter_window in plan:
                limit = getattr(limits, name)
                if limit is None:
                    continue
                row = QuotaCounter.objects.select_for_update().filter(tenant_id=tenant_id, key=counter).first()
                if row is None:
                    row = QuotaCounter.objects.create(tenant_id=tenant_id, key=counter, window="", used=0)
                if row.window != counter_window:  # a new period or minute starts from what is metered
                    row.window = counter_window
                    row.used = self._start(name, reservation, limits, now)
                if row.used + amount > limit:
                    raise refusal(name, limits, now)
                row.used += amount
                row.save(update_fields=["window", "used"])
        return reservation

    @staticmethod
    def _start(name: str, reservation: Reservation, limits: Limits, now: dt.datetime) -> int:
        if name in ("image_tokens", "total_tokens"):
            image_used, total_used = metered_so_far(reservation.tenant_id, limits.period, now)
            return image_used if name == "image_tokens" else total_used
        if name in ("spend", "key_spend"):
            spent = metered_spend(reservation.tenant_id, limits.period, now, limits.currency)
            return spent.get("tenant" if name == "spend" else reservation.key_field, 0)
        return 0

    def settle_sync(self, reservation: Reservation, *, image_tokens: int, total_tokens: int, cost: int = 0) -> None:
        """Correct a reservation to what was used (release it: 0 and 0)."""
        counters = QuotaCounter.objects.filter(tenant_id=reservation.tenant_id, window=reservation.period_window)
        with transaction.atomic():
            counters.filter(key="image_tokens").update(used=F("used") + (image_tokens - reservation.ask.image_tokens))
            counters.filter(key="total_tokens").update(used=F("used") + (total_tokens - reservation.ask.total_tokens))
            counters.filter(key__in=["spend", _key_spend(reservation)]).update(
                used=F("used") + (cost - reservation.ask.cost))
            if reservation.ask.large:
                QuotaCounter.objects.filter(tenant_id=reservation.tenant_id, key="concurrent_large_images").update(
                    used=Greatest(F("used") - 1, 0))

    async def settle(self, reservation: Reservation, *, image_tokens: int, total_tokens: int, cost: int = 0) -> None:
        await sync_to_async(self.settle_sync)(reservation, image_tokens=image_tokens, total_tokens=total_tokens,
                                              cost=cost)

    # -- beat ------------------------------------------------------------------------------

    async def beat(self, flights: list[Flight]) -> None:
        await sync_to_async(self._beat)(flights)

    def _beat(self, flights: list[Flight]) -> None:
        now = timezone.now()
        for flight in flights:
            InFlightRequest.objects.filter(request_id=flight.record.request_id).update(
                beat_at=now, produced=flight.produced, instance_id=flight.record.instance_id)

    # -- finish ----------------------------------------------------------------------------

    async def finish(self, flight: Flight, written=None) -> None:
        """Store the usage and settle, in one transaction (`written` is not used: the database
        has it once the transaction commits, when it also says so)."""
        try:
            await sync_to_async(self.finish_spooled)(flight.record, flight.journaled)
        except Exception:  # the database does not answer: on disk until it does
            log.exception("could not record the usage of %s", flight.record.request_id)
            await sync_to_async(current_process().ledger_book.spool.write)(
                flight.record, journaled=flight.journaled, ledger="database")

    def finish_spooled(self, record: UsageRecord, journaled: bool) -> bool:
        """Store the usage and settle, removing the entry. False when the reaper had already.
        (What `finish` does, in the calling thread: a finish that waited on disk.)"""
        with transaction.atomic():
            held = InFlightRequest.objects.filter(request_id=record.request_id).delete()[0]
            if journaled and not held:
                return False  # the reaper finished it already
            usage_record(record=record)
            if record.reservation is not None:
                image_tokens, total_tokens, cost = settlement(record)
                self.settle_sync(record.reservation, image_tokens=image_tokens, total_tokens=total_tokens, cost=cost)
        return True

    async def keep_safe(self) -> int:
        """Nothing to do: the database keeps what it committed."""
        return 0

    # -- reap ------------------------------------------------------------------------------

    def reap(self, *, stale_before: float, now: float) -> int:
        """Two looks, as in Redis (see RedisLedger.reap)."""
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
                    if row.suspected_beat != row.beat_at:  # the first look
                        row.suspected_beat, row.suspected_at = row.beat_at, moment
                        row.save(update_fields=["suspected_beat", "suspected_at"])
                        continue
                    if moment - row.suspected_at < dt.timedelta(seconds=2 * settings.GATEWAY_HEARTBEAT_S):
                        continue
                    beat = {"t": row.beat_at.timestamp(), "produced": row.produced, "instance": row.instance_id}
                    reaped += self.finish_spooled(interrupted(row.record, beat), True)
            except Exception:  # one bad entry must not stop the others (nor the ingest after them)
                log.exception("could not record the interrupted request %s", request_id)
        return reaped
