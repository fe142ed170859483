"""What both ledgers share: a quota's limits, what a request asks of them, its reservation,
a journaled request (a flight), what a request holds against its quota once it ends, and
what a ledger does (Ledger)."""

from __future__ import annotations

import asyncio
import datetime as dt
from dataclasses import dataclass
from decimal import Decimal
from typing import Protocol

from controlplane.metering.periods import minute_window, seconds_to_period_end
from controlplane.metering.rating import Rates
from controlplane.metering.records import (
    UsageRecord,
    is_billable,
    record_price,
    usage_from_json,
    usage_to_json,
)

LIMITS = ("image_tokens", "total_tokens", "requests_per_minute", "concurrent_large_images", "spend", "key_spend")
NAMES = {"image_tokens": "image tokens", "total_tokens": "total tokens",
         "requests_per_minute": "requests per minute", "concurrent_large_images": "concurrent large-image requests",
         "spend": "the tenant's budget", "key_spend": "this API key's budget"}
SPEND = ("spend", "key_spend")  # money, in micro-units of the budget's currency
MICROS = 1_000_000


@dataclass(frozen=True)
class Limits:
    period: str = "month"  # day or month
    image_tokens: int | None = None
    total_tokens: int | None = None
    requests_per_minute: int | None = None
    concurrent_large_images: int | None = None
    spend: int | None = None  # the tenant's hard budget for the period, micro-units of `currency`
    key_spend: int | None = None  # the key's own
    currency: str = "USD"  # what budgets are counted in: requests to tiers priced in another cost them nothing

    @property
    def unlimited(self) -> bool:
        return all(getattr(self, name) is None for name in LIMITS)


@dataclass(frozen=True)
class IntakeLimits:
    """What a key's requests may cost before admission, each minute: its tenant's requests and
    its own (a request refused at intake counts as one), and the gateway CPU time its requests'
    intake took (milliseconds) and the body bytes it read. None: no limit."""

    tenant_requests: int | None = None
    key_requests: int | None = None
    cpu_ms: int | None = None
    body_bytes: int | None = None

    def of(self, name: str) -> int | None:
        return {"requests_per_minute": self.tenant_requests, "key_requests_per_minute": self.key_requests,
                "intake_cpu_ms": self.cpu_ms, "intake_bytes": self.body_bytes}[name]

    @property
    def none(self) -> bool:
        return all(self.of(name) is None for name in INTAKE)

    def in_window(self, name: str) -> int | None:
        """The limit on `name` in its window (`intake_windows`): a minute's requests, a sixth of
        a minute's CPU time or bytes."""
        limit = self.of(name)
        return limit if limit is None or name not in BUDGETS else -(-limit * BUDGET_WINDOW_S // 60)


INTAKE = ("requests_per_minute", "key_requests_per_minute", "intake_cpu_ms", "intake_bytes")
# CPU time and bytes are counted in windows of BUDGET_WINDOW_S, a sixth of each minute's limit
# in each: a key that spends its minute's budget at once would take a core for seconds.
BUDGETS = ("intake_cpu_ms", "intake_bytes")
BUDGET_WINDOW_S = 10


def intake_windows(now: dt.datetime) -> dict[str, str]:
    """The window each of INTAKE's counts is in at `now`."""
    minute = minute_window(now)
    budget = f"{minute}{now.second // BUDGET_WINDOW_S}"
    return {name: budget if name in BUDGETS else minute for name in INTAKE}


def intake_retry_after(name: str, now: dt.datetime) -> int:
    """Seconds until the window of `name` that `now` is in ends."""
    window = BUDGET_WINDOW_S if name in BUDGETS else 60
    return window - now.second % window


@dataclass(frozen=True)
class Ask:
    image_tokens: int
    total_tokens: int
    large: bool
    cost: int = 0  # the most it can cost (its output at max_tokens), micro-units of the budgets' currency
    key_id: int | None = None  # whose key's budget it counts against too
    # What prices it, to settle its cost to what it used (None: it costs the budgets nothing).
    rates: Rates | None = None

    def plus(self, other: Ask) -> Ask:
        """This and `other` reserved as one (a cascade's first attempt holds room for its
        second); it settles, priced at this one's rates, to what this one used."""
        return Ask(image_tokens=self.image_tokens + other.image_tokens, total_tokens=self.total_tokens + other.total_tokens,
                   large=self.large or other.large, cost=self.cost + other.cost, key_id=self.key_id, rates=self.rates)


@dataclass(frozen=True)
class Reservation:
    tenant_id: int
    period_window: str
    ask: Ask
    id: str = ""  # the request's id (Redis keeps the epoch of the counters it was made in)

    @property
    def key_field(self) -> str:
        """The key's field among the period's spend counters."""
        return f"k{self.ask.key_id or 0}"


_RATES = ("text_input_per_mtok", "image_per_mtok", "output_per_mtok", "per_image_fee", "cached_image_discount")


def reservation_to_json(reservation: Reservation) -> dict:
    ask = reservation.ask
    rates = None if ask.rates is None else [str(getattr(ask.rates, name)) for name in _RATES]
    return {"tenant_id": reservation.tenant_id, "period_window": reservation.period_window, "id": reservation.id,
            "ask": [ask.image_tokens, ask.total_tokens, ask.large, ask.cost, ask.key_id], "rates": rates}


def reservation_from_json(data: dict) -> Reservation:
    image_tokens, total_tokens, large, *spend = data["ask"]
    cost, key_id = (spend + [0, None])[:2]
    rates = data.get("rates")
    rates = None if rates is None else Rates(**{name: Decimal(value) for name, value in zip(_RATES, rates, strict=True)})
    return Reservation(data["tenant_id"], data["period_window"],
                       Ask(image_tokens, total_tokens, bool(large), cost, key_id, rates), data.get("id", ""))


def money(micros: int, currency: str) -> str:
    return f"{Decimal(micros) / MICROS:,.2f} {currency}"


class Refused(Exception):
    def __init__(self, limit: str, limit_value: int, retry_after: int, period: str, currency: str = ""):
        self.limit, self.retry_after = limit, max(1, retry_after)
        if limit in SPEND:
            super().__init__(f"budget exceeded: {NAMES[limit]} of {money(limit_value, currency)} this {period} is "
                             f"spent; it renews in {self.retry_after}s")
            return
        window = {"requests_per_minute": "this minute", "concurrent_large_images": "at once"}.get(
            limit, f"this {period}")
        super().__init__(f"quota exceeded: {NAMES[limit]} ({limit_value:,} {window}); retry after "
                         f"{self.retry_after}s")


def refusal(limit: str, limits: Limits, now: dt.datetime) -> Refused:
    retry = {"requests_per_minute": 60 - now.second, "concurrent_large_images": 2}.get(
        limit, seconds_to_period_end(limits.period, now))
    return Refused(limit, getattr(limits, limit), retry, limits.period, limits.currency)


@dataclass(eq=False)
class Flight:
    """A journaled request, as its gateway process sees it."""

    record: UsageRecord
    journaled: bool = False
    # Whether its store answered its admission (without a quota, one that did not answer does
    # not stop the request).
    answered: bool = True
    produced: int = 0  # output tokens streamed so far
    beaten: int = 0  # of which the journal knows


def settlement(record: UsageRecord) -> tuple[int, int, int]:
    """Image and total tokens, and the cost (micro-units), a finished request holds against
    its quota and budgets: what it used, priced as its bill will price it, if it is billed;
    nothing if it is not."""
    if not is_billable(record):
        return 0, 0, 0
    rates = record.reservation.ask.rates if record.reservation is not None else None
    cost = 0 if rates is None else int(record_price(record, rates) * MICROS)
    return record.image_tokens, record.text_tokens + record.image_tokens + record.output_tokens, cost


def entry(record: UsageRecord) -> dict:
    """A request's journal entry: what was counted before forwarding, and its reservation."""
    data = usage_to_json(record)
    if record.reservation is not None:
        data["reservation"] = reservation_to_json(record.reservation)
    return data


def interrupted(data: dict, beat: dict | None) -> UsageRecord:
    """What a dead gateway's request is recorded as: counted before forwarding (its journal
    entry), plus what its last heartbeat knew."""
    record = usage_from_json(data)
    if data.get("reservation"):
        record.reservation = reservation_from_json(data["reservation"])
    beat = beat or {}
    record.status, record.http_status = "interrupted", 502
    record.instance_id = beat.get("instance") or record.instance_id
    record.output_tokens = int(beat.get("produced") or 0)
    if beat.get("t"):
        started = record.created_at.timestamp()
        record.latency_ms = max(0, int((beat["t"] - started) * 1000))
    return record


class Ledger(Protocol):
    """What the gateway asks of the store that holds quotas, the in-flight journal and the
    usage handed over: Redis (redis_store.RedisLedger) or the database (database_store.
    DatabaseLedger), chosen once by USAGE_OUTBOX."""

    async def admit(self, flight: Flight, limits: Limits | None, ask: Ask | None, now: dt.datetime,
                    written: asyncio.Future | None = None) -> None: ...

    async def intake_over(self, tenant_id: int, key_id: int, limits: IntakeLimits, now: dt.datetime, *,
                          take_bytes: int = 0) -> str | None: ...

    async def intake_charge(self, tenant_id: int, key_id: int, limits: IntakeLimits, now: dt.datetime, *,
                            cpu_ms: int, body_bytes: int = 0, refused: bool) -> None: ...

    async def key_rate(self, key_id: int, limit: int, now: dt.datetime) -> bool: ...

    async def key_rate_return(self, key_id: int, now: dt.datetime) -> None: ...

    async def beat(self, flights: list[Flight]) -> None: ...

    async def finish(self, flight: Flight, written: asyncio.Future | None = None) -> None: ...

    async def keep_safe(self) -> int:
        """Make sure what was handed over survives a store that lost it (how many were saved)."""
        ...

    def finish_spooled(self, record: UsageRecord, journaled: bool) -> bool:
        """Record a finish that waited on disk (spool.py) while the store could not be reached."""
        ...

    def reap(self, *, stale_before: float, now: float) -> int: ...
