"""Quota admission: reserve before forwarding, settle to the actual usage afterwards.

Checking a counter and then adding to it lets concurrent requests overshoot the quota (two
gateways both read "9 of 10 used" and both admit). So every limit is checked and reserved
in one atomic step: a Lua script in Redis, or conditional UPDATEs in one transaction in
embedded mode. A request reserves its image tokens, its total tokens (prompt plus the
max_tokens ceiling), a slot of its minute and, if its images are large, a concurrency slot;
when it ends, the reservation is corrected to what was really used and the slot released.
"""

from __future__ import annotations

import calendar
import datetime as dt
from dataclasses import dataclass

LIMITS = ("image_tokens", "total_tokens", "requests_per_minute", "concurrent_large_images")
NAMES = {"image_tokens": "image tokens", "total_tokens": "total tokens",
         "requests_per_minute": "requests per minute", "concurrent_large_images": "concurrent large-image requests"}


@dataclass(frozen=True)
class Limits:
    period: str = "month"  # day or month
    image_tokens: int | None = None
    total_tokens: int | None = None
    requests_per_minute: int | None = None
    concurrent_large_images: int | None = None

    @property
    def unlimited(self) -> bool:
        return all(getattr(self, name) is None for name in LIMITS)


@dataclass(frozen=True)
class Ask:
    image_tokens: int
    total_tokens: int
    large: bool


@dataclass(frozen=True)
class Reservation:
    tenant_id: int
    period_window: str
    ask: Ask


def reservation_to_json(reservation: Reservation) -> dict:
    return {"tenant_id": reservation.tenant_id, "period_window": reservation.period_window,
            "ask": [reservation.ask.image_tokens, reservation.ask.total_tokens, reservation.ask.large]}


def reservation_from_json(data: dict) -> Reservation:
    image_tokens, total_tokens, large = data["ask"]
    return Reservation(data["tenant_id"], data["period_window"], Ask(image_tokens, total_tokens, bool(large)))


class Refused(Exception):
    def __init__(self, limit: str, limit_value: int, retry_after: int, period: str):
        self.limit, self.retry_after = limit, max(1, retry_after)
        window = {"requests_per_minute": "this minute", "concurrent_large_images": "at once"}.get(
            limit, f"this {period}")
        super().__init__(f"quota exceeded: {NAMES[limit]} ({limit_value:,} {window}); retry after "
                         f"{self.retry_after}s")


def period_window(period: str, now: dt.datetime) -> str:
    return now.strftime("%Y%m%d") if period == "day" else now.strftime("%Y%m")


def period_start(period: str, now: dt.datetime) -> dt.datetime:
    start = now.replace(hour=0, minute=0, second=0, microsecond=0)
    return start if period == "day" else start.replace(day=1)


def seconds_to_period_end(period: str, now: dt.datetime) -> int:
    start = period_start(period, now)
    if period == "day":
        end = start + dt.timedelta(days=1)
    else:
        end = start + dt.timedelta(days=calendar.monthrange(start.year, start.month)[1])
    return int((end - now).total_seconds()) + 1


def minute_window(now: dt.datetime) -> str:
    return now.strftime("%Y%m%d%H%M")


def refusal(limit: str, limits: Limits, now: dt.datetime) -> Refused:
    retry = {"requests_per_minute": 60 - now.second, "concurrent_large_images": 2}.get(
        limit, seconds_to_period_end(limits.period, now))
    return Refused(limit, getattr(limits, limit), retry, limits.period)


# --- Redis (production): one script checks every limit and reserves them all, or nothing ----

_RESERVE = """
local function over(key, ask, limit)
  if tonumber(limit) < 0 then return false end
  return tonumber(redis.call('GET', key) or '0') + tonumber(ask) > tonumber(limit)
end
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
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
return 0
"""
# Settling is a Lua function so that the usage journal can settle in the same atomic step
# as it hands the usage over (see controlplane/gateway/journal.py). A counter that is gone
# (Redis lost it) is left to be started again from what is metered, not created from a delta.
SETTLE_FUNCTION = """
local function settle(image_key, total_key, large_key, image_delta, total_delta, large)
  if redis.call('EXISTS', image_key) == 1 then redis.call('INCRBY', image_key, image_delta) end
  if redis.call('EXISTS', total_key) == 1 then redis.call('INCRBY', total_key, total_delta) end
  if large == '1' and tonumber(redis.call('GET', large_key) or '0') > 0 then redis.call('DECR', large_key) end
end
"""
_SETTLE = SETTLE_FUNCTION + """
settle(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3])
return 0
"""
_ORDER = ("image_tokens", "total_tokens", "requests_per_minute", "concurrent_large_images")


class RedisAdmission:
    def __init__(self, url: str, *, prefix: str, seed):
        self.url, self.prefix, self.seed = url, prefix, seed

    def _client(self):
        from controlplane.redis_clients import async_redis

        return async_redis(self.url)

    def _keys(self, tenant_id: int, window: str, now: dt.datetime) -> list[str]:
        base = f"{self.prefix}:quota:{tenant_id}"
        return [f"{base}:{window}:image_tokens", f"{base}:{window}:total_tokens",
                f"{base}:rpm:{minute_window(now)}", f"{base}:large"]

    async def reserve(self, tenant_id: int, limits: Limits, ask: Ask, now: dt.datetime) -> Reservation:
        window = period_window(limits.period, now)
        keys = self._keys(tenant_id, window, now)
        argv = [ask.image_tokens, ask.total_tokens, int(ask.large)] + [
            -1 if getattr(limits, name) is None else getattr(limits, name) for name in _ORDER]
        client = self._client()
        for _attempt in range(2):
            outcome = await client.eval(_RESERVE, 4, *keys, *argv)
            if outcome == -1:  # first request of the period: start from what is already metered
                image_used, total_used = await self.seed(tenant_id, limits.period, now)
                ttl = seconds_to_period_end(limits.period, now) + 2 * 86400
                await client.set(keys[0], image_used, nx=True, ex=ttl)
                await client.set(keys[1], total_used, nx=True, ex=ttl)
                continue
            if outcome:
                raise refusal(_ORDER[outcome - 1], limits, now)
            return Reservation(tenant_id, window, ask)
        raise RuntimeError("quota counters could not be seeded")

    def settle_plan(self, reservation: Reservation, *, image_tokens: int, total_tokens: int) -> tuple[list, list]:
        """The keys and arguments of SETTLE_FUNCTION's settle() for this correction."""
        base = f"{self.prefix}:quota:{reservation.tenant_id}"
        keys = [f"{base}:{reservation.period_window}:image_tokens", f"{base}:{reservation.period_window}:total_tokens",
                f"{base}:large"]
        return keys, [image_tokens - reservation.ask.image_tokens, total_tokens - reservation.ask.total_tokens,
                      int(reservation.ask.large)]

    async def settle(self, reservation: Reservation, *, image_tokens: int, total_tokens: int) -> None:
        keys, args = self.settle_plan(reservation, image_tokens=image_tokens, total_tokens=total_tokens)
        await self._client().eval(_SETTLE, 3, *keys, *args)


# --- The database (embedded mode): row-locked counters in one transaction ---------------------

class DatabaseAdmission:
    def __init__(self, *, seed_sync):
        self.seed_sync = seed_sync

    def reserve_sync(self, tenant_id: int, limits: Limits, ask: Ask, now: dt.datetime) -> Reservation:
        from django.db import IntegrityError, transaction

        from controlplane.tenants.models import QuotaCounter

        window = period_window(limits.period, now)
        plan = [("image_tokens", ask.image_tokens, window), ("total_tokens", ask.total_tokens, window),
                ("requests_per_minute", 1, minute_window(now))]
        if ask.large:
            plan.append(("concurrent_large_images", 1, ""))
        for _attempt in range(3):
            try:
                with transaction.atomic():
                    for name, amount, counter_window in plan:
                        limit = getattr(limits, name)
                        if limit is None:
                            continue
                        row = QuotaCounter.objects.select_for_update().filter(tenant_id=tenant_id, key=name).first()
                        if row is None:
                            row = QuotaCounter.objects.create(tenant_id=tenant_id, key=name, window="", used=0)
                        if row.window != counter_window:  # a new period or minute starts from what is metered
                            row.window = counter_window
                            row.used = self._start(name, tenant_id, limits.period, now)
                        if row.used + amount > limit:
                            raise refusal(name, limits, now)
                        row.used += amount
                        row.save(update_fields=["window", "used"])
                return Reservation(tenant_id, window, ask)
            except IntegrityError:  # two first requests created the same counter: go again
                continue
        raise RuntimeError("quota counters could not be created")

    def _start(self, name: str, tenant_id: int, period: str, now: dt.datetime) -> int:
        if name in ("image_tokens", "total_tokens"):
            image_used, total_used = self.seed_sync(tenant_id, period, now)
            return image_used if name == "image_tokens" else total_used
        return 0

    def settle_sync(self, reservation: Reservation, *, image_tokens: int, total_tokens: int) -> None:
        from django.db import transaction
        from django.db.models import F
        from django.db.models.functions import Greatest

        from controlplane.tenants.models import QuotaCounter

        counters = QuotaCounter.objects.filter(tenant_id=reservation.tenant_id)
        with transaction.atomic():
            counters.filter(key="image_tokens", window=reservation.period_window).update(
                used=F("used") + (image_tokens - reservation.ask.image_tokens))
            counters.filter(key="total_tokens", window=reservation.period_window).update(
                used=F("used") + (total_tokens - reservation.ask.total_tokens))
            if reservation.ask.large:
                counters.filter(key="concurrent_large_images").update(used=Greatest(F("used") - 1, 0))

    async def reserve(self, tenant_id: int, limits: Limits, ask: Ask, now: dt.datetime) -> Reservation:
        from asgiref.sync import sync_to_async

        return await sync_to_async(self.reserve_sync)(tenant_id, limits, ask, now)

    async def settle(self, reservation: Reservation, *, image_tokens: int, total_tokens: int) -> None:
        from asgiref.sync import sync_to_async

        await sync_to_async(self.settle_sync)(reservation, image_tokens=image_tokens, total_tokens=total_tokens)


def metered_so_far(tenant_id: int, period: str, now: dt.datetime) -> tuple[int, int]:
    """Image and total tokens the tenant has used this period (starts a counter right)."""
    from django.db.models import F, Sum

    from controlplane.metering.models import UsageEvent
    from controlplane.metering.services import billed

    # As settled: only billed requests count against the quota.
    totals = UsageEvent.objects.filter(billed(), tenant_id=tenant_id, created_at__gte=period_start(period, now)).aggregate(
        image=Sum("image_tokens"), total=Sum(F("image_tokens") + F("text_tokens") + F("output_tokens")))
    return int(totals["image"] or 0), int(totals["total"] or 0)


_backend = None


def backend():
    """Redis when there is one (shared by every gateway replica), else the database."""
    global _backend
    if _backend is None:
        from asgiref.sync import sync_to_async
        from django.conf import settings

        if settings.REDIS_URL:
            from controlplane.redis_clients import key_prefix

            _backend = RedisAdmission(settings.REDIS_URL, prefix=key_prefix(),
                                      seed=sync_to_async(metered_so_far))
        else:
            _backend = DatabaseAdmission(seed_sync=metered_so_far)
    return _backend
