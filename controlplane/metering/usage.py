"""What the usage dashboard shows, read from the rollups (hourly and daily totals, the daily
cost-per-image histogram), never from the events: a page costs the same few queries however
many requests lie behind it."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from decimal import Decimal
from functools import cached_property

from django.db.models import Sum

from controlplane.metering.models import DailyUsage, HourlyUsage, ImageCostHistogram

# Summed per period for the charts over time.
SERIES_FIELDS = ("image_tokens", "cost", "cached_image_tokens", "cache_savings")
# Summed per tenant and tier for the totals.
TOTAL_FIELDS = ("requests", "unbilled_requests", "images", "image_tokens", "cached_image_tokens", "text_tokens",
                "output_tokens", "cost", "cache_savings")
OTHERS = "others"


@dataclass(frozen=True)
class Period:
    key: str
    title: str
    hourly: bool
    length: int  # hours or days, the current one included

    @property
    def unit(self) -> str:
        return "hour" if self.hourly else "day"

    def slots(self, now: dt.datetime) -> list:
        """The hours (UTC datetimes) or days (dates) of the period, oldest first."""
        now = now.astimezone(dt.UTC)
        if self.hourly:
            last = now.replace(minute=0, second=0, microsecond=0)
            return [last - dt.timedelta(hours=n) for n in reversed(range(self.length))]
        return [now.date() - dt.timedelta(days=n) for n in reversed(range(self.length))]


PERIODS = {p.key: p for p in (
    Period("24h", "last 24 hours", hourly=True, length=24),
    Period("30d", "last 30 days", hourly=False, length=30),
    Period("90d", "last 90 days", hourly=False, length=90),
)}
DEFAULT_PERIOD = "30d"


@dataclass(frozen=True)
class UsageScope:
    """Whose usage (its tenants, or one API key of theirs), of which tier (None: every tier),
    over which period."""

    tenants: object  # a Tenant queryset or list
    period: Period
    now: dt.datetime
    tier: object = None
    api_key: object = None

    @cached_property
    def slots(self) -> list:
        return self.period.slots(self.now)

    @property
    def first_day(self) -> dt.date:
        return _day_of(self.slots[0])

    @property
    def last_day(self) -> dt.date:
        return _day_of(self.slots[-1])

    def rollups(self):
        """The rollup rows of the scope, and the name of their period field."""
        model, at = (HourlyUsage, "hour") if self.period.hourly else (DailyUsage, "day")
        rows = model.objects.filter(tenant__in=self.tenants, **{f"{at}__gte": self.slots[0]})
        if self.api_key is not None:
            rows = rows.filter(api_key=self.api_key)
        return (rows if self.tier is None else rows.filter(tier=self.tier)), at


def _day_of(slot) -> dt.date:
    return slot.date() if isinstance(slot, dt.datetime) else slot


@dataclass
class TimeSeries:
    slots: list
    values: dict[str, dict[str, list]]  # tier or tenant name -> field -> one value per slot

    def of(self, name: str, *, top: int | None = None) -> dict[str, list]:
        """One field per tier or tenant, leaving out those with none of it. With `top`, the
        largest `top` by their total over the period, and the rest summed as "others"."""
        series = {key: values[name] for key, values in self.values.items() if any(values[name])}
        if top is None or len(series) <= top:
            return series
        ranked = sorted(series, key=lambda key: (-sum(series[key]), key))
        kept = {key: series[key] for key in sorted(ranked[:top])}
        kept[OTHERS] = [sum(values) for values in zip(*(series[key] for key in ranked[top:]), strict=True)]
        return kept

    def total(self, name: str):
        return sum((sum(values[name]) for values in self.values.values()), start=0)


def usage_over_time(*, scope: UsageScope, by: str) -> TimeSeries:
    """Image tokens, cost, cached image tokens and their savings per hour or day, per tier
    (`by="tier"`) or per tenant (`by="tenant"`); periods without usage count zero."""
    rows, at = scope.rollups()
    rows = rows.filter(tier__isnull=False)  # requests refused before a model was known: nothing charted
    key = f"{by}__name"
    position = {slot: n for n, slot in enumerate(scope.slots)}
    values: dict[str, dict[str, list]] = {}
    for row in rows.values(at, key).annotate(**{f: Sum(f) for f in SERIES_FIELDS}).order_by():
        n = position.get(row[at])
        if n is None:  # stamped after this page's clock
            continue
        series = values.setdefault(row[key], {f: [0] * len(scope.slots) for f in SERIES_FIELDS})
        for f in SERIES_FIELDS:
            series[f][n] = row[f] or 0
    return TimeSeries(scope.slots, dict(sorted(values.items())))


def usage_table(*, scope: UsageScope) -> list[dict]:
    """The period's totals per tenant and tier, each in its tier's currency. Requests refused
    before their model was known are a tenant's row without a tier or currency: counted, all of
    them unbilled, nothing else."""
    rows, _ = scope.rollups()
    return [
        {**row, "currency": row["tier__price_plan__currency"], **{f: row[f] or 0 for f in TOTAL_FIELDS}}
        for row in rows.values("tenant__name", "tier__name", "tier__price_plan__currency")
        .annotate(**{f: Sum(f) for f in TOTAL_FIELDS}).order_by("tenant__name", "tier__name")
    ]


MONEY_FIELDS = ("cost", "cache_savings")


def usage_totals(table: list[dict]) -> dict:
    """The totals of a `usage_table`: counts summed (and `billed_requests`, the requests less
    those not billed); money summed per currency (`money`, a list of {currency, cost,
    cache_savings}), and as `cost`, `cache_savings` and `currency` when the table is in one
    currency (None when in several: they are never added)."""
    totals = {f: sum((row[f] for row in table), start=0) for f in TOTAL_FIELDS if f not in MONEY_FIELDS}
    # The rollups count every request, and those not billed apart: the rest are what a
    # statement counts.
    totals["billed_requests"] = totals["requests"] - totals["unbilled_requests"]
    money = {}
    for row in table:
        if row["currency"] is None:  # no tier, so nothing billed
            continue
        each = money.setdefault(row["currency"], {"currency": row["currency"], "cost": Decimal(0),
                                                  "cache_savings": Decimal(0)})
        for f in MONEY_FIELDS:
            each[f] += row[f]
    totals["money"] = [money[currency] for currency in sorted(money)]
    one = totals["money"][0] if len(money) == 1 else None
    if not money:
        one = {"currency": None, "cost": Decimal(0), "cache_savings": Decimal(0)}
    for f in ("currency", *MONEY_FIELDS):
        totals[f] = one[f] if one else None
    return totals


def currency_label(totals: dict) -> str:
    """What the amounts of a page are in: its one currency, or each tier's own."""
    if totals["currency"]:
        return totals["currency"]
    if totals["money"]:
        return "each tier's currency: " + ", ".join(m["currency"] for m in totals["money"])
    return ""


@dataclass
class CostBucket:
    cost_from: Decimal | None  # its lower edge; None for images with no price in effect
    label: str
    images: dict[str, int] = field(default_factory=dict)  # per tier
    cost: dict[str, Decimal] = field(default_factory=dict)


@dataclass
class CostDistribution:
    """From the cheapest bucket holding an image to the dearest, empty ones between included
    (the shape stays true), then the unpriced images if any."""

    buckets: list[CostBucket]
    images: int
    cost: Decimal
    priced_images: int = 0  # the images a rate priced (the unpriced ones cost no known amount)

    @property
    def mean(self) -> Decimal | None:
        """What a priced image cost on average (images without a price left out, not counted
        as free)."""
        return (self.cost / self.priced_images).quantize(Decimal("0.000001")) if self.priced_images else None


def image_cost_distribution(*, scope: UsageScope) -> CostDistribution:
    """How many images cost how much each, per tier, over the whole UTC days of the period."""
    rows = ImageCostHistogram.objects.filter(tenant__in=scope.tenants, day__gte=scope.first_day)
    if scope.tier is not None:
        rows = rows.filter(tier=scope.tier)
    found: dict[Decimal | None, CostBucket] = {}
    for row in (rows.values("cost_from", "tier__name").annotate(images=Sum("images"), cost=Sum("cost"))
                .order_by()):
        bucket = found.setdefault(row["cost_from"], CostBucket(row["cost_from"],
                                                               ImageCostHistogram.label(row["cost_from"])))
        bucket.images[row["tier__name"]] = row["images"]
        bucket.cost[row["tier__name"]] = row["cost"]
    priced = sorted(edge for edge in found if edge is not None)
    buckets = []
    if priced:
        edges = ImageCostHistogram.EDGES
        for edge in edges[edges.index(priced[0]):edges.index(priced[-1]) + 1]:
            buckets.append(found.get(edge) or CostBucket(edge, ImageCostHistogram.label(edge)))
    if None in found:
        buckets.append(found[None])
    return CostDistribution(
        buckets=buckets,
        images=sum(sum(b.images.values()) for b in buckets),
        priced_images=sum(sum(b.images.values()) for b in buckets if b.cost_from is not None),
        cost=sum((sum(b.cost.values(), start=Decimal(0)) for b in buckets), start=Decimal(0)),
    )

