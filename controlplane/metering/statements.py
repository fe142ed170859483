"""Monthly statements. Each request's cost was fixed (and rounded) when it was recorded, at
the rate then in effect (which the event names), so a statement is a sum of recorded costs: it
equals its lines exactly, and a later price change never rewrites a closed month.

A statement lists billed requests only (metering.services.billed: completed, or cut short
after an engine worked on them); requests refused or failed before an engine worked on them
cost nothing and are counted apart. Amounts in different currencies are never added: there is
a total per currency, and `total` and `currency` are that total and currency when there is
just one (no lines: a total of 0 and no currency).
"""

from __future__ import annotations

from decimal import Decimal

from django.db.models import Count, F, Sum

from controlplane.metering.models import DailyUsage, RetiredMonth, UsageEvent
from controlplane.metering.periods import month_bounds
from controlplane.metering.services import billed

COUNTS = ("requests", "images", "image_tokens", "cached_image_tokens", "text_tokens", "output_tokens")
AMOUNTS = ("cost", "cache_savings")
LINE_FIELDS = (*COUNTS, *AMOUNTS)


# A month's sums, per what `values()` groups by: from its events, or from its days' rollups (equal
# to them: a month is retired only once they were found so, metering/partitions.py).
_FROM_EVENTS = {"requests": Count("id"), "images": Sum("image_count"), "image_tokens": Sum("image_tokens"),
                "cached_image_tokens": Sum("cached_image_tokens"), "text_tokens": Sum("text_tokens"),
                "output_tokens": Sum("output_tokens"), "cost": Sum("cost"), "cache_savings": Sum("cache_savings")}
_FROM_ROLLUPS = {**{f: Sum(f) for f in _FROM_EVENTS}, "requests": Sum(F("requests") - F("unbilled_requests"))}


def retired(year: int, month: int) -> bool:
    """Whether the month's events were dropped: its statements are read from the rollups."""
    return RetiredMonth.objects.filter(month=month_bounds(year, month)[0].date()).exists()


def month_sums(*, start, end, by: tuple[str, ...], from_rollups: bool, **where):
    """Billed usage of [start, end) summed per `by`, and the requests not billed per `by`."""
    if from_rollups:
        days = DailyUsage.objects.filter(day__gte=start.date(), day__lt=end.date(), **where)
        sums = days.values(*by).order_by(*by).annotate(**_FROM_ROLLUPS)
        unbilled = days.values(*by).order_by(*by).annotate(n=Sum("unbilled_requests"))
        return [row for row in sums if row["requests"]], {tuple(row[f] for f in by): row["n"] or 0 for row in unbilled}
    events = UsageEvent.objects.filter(created_at__gte=start, created_at__lt=end, **where)
    sums = events.filter(billed()).values(*by).order_by(*by).annotate(**_FROM_EVENTS)
    unbilled = events.exclude(billed()).values(*by).order_by(*by).annotate(n=Count("id"))
    return list(sums), {tuple(row[f] for f in by): row["n"] for row in unbilled}


def statement(*, tenant, year: int, month: int) -> dict:
    start, end = month_bounds(year, month)
    from_rollups = retired(year, month)
    by = ("tier__name", "tier__price_plan__currency")
    lines, unbilled = month_sums(start=start, end=end, by=by, from_rollups=from_rollups, tenant=tenant)
    rows = [{"tier": line["tier__name"], "currency": line["tier__price_plan__currency"],
             **{f: line[f] or 0 for f in COUNTS}, **{f: Decimal(line[f] or 0) for f in AMOUNTS}}
            for line in lines]
    totals = {}
    for row in rows:
        total = totals.setdefault(row["currency"], {"currency": row["currency"], "total": Decimal(0),
                                                    "cache_savings": Decimal(0)})
        total["total"] += row["cost"]
        total["cache_savings"] += row["cache_savings"]
    totals = [totals[currency] for currency in sorted(totals)]
    one = totals[0] if len(totals) == 1 else None
    return {
        "tenant": tenant.name, "period": f"{year:04d}-{month:02d}", "from": start, "to": end,
        "currency": one["currency"] if one else None,
        "lines": rows,
        "totals": totals,
        "total": one["total"] if one else (Decimal(0) if not totals else None),
        "cache_savings": one["cache_savings"] if one else (Decimal(0) if not totals else None),
        "unbilled_requests": sum(unbilled.values()),
        # A month is retired only once every event of it was priced.
        "unrated_requests": 0 if from_rollups else UsageEvent.objects.filter(
            tenant=tenant, created_at__gte=start, created_at__lt=end, rated=False).count(),
        "from_rollups": from_rollups,
    }


def month_statements(*, tenants, year: int, month: int) -> dict:
    """Every one of `tenants`' statement totals for a month, in two queries: a row per tenant
    and currency (each equal to that tenant's statement), the totals per currency of the client
    tenants, and the service's own (internal) tenants apart, in no total."""
    start, end = month_bounds(year, month)
    sums, by_key = month_sums(start=start, end=end, by=("tenant__name", "tenant__internal",
                                                         "tier__price_plan__currency"),
                              from_rollups=retired(year, month), tenant__in=tenants)
    rows = [
        {"tenant": row["tenant__name"], "internal": row["tenant__internal"], "currency": row["tier__price_plan__currency"],
         **{f: row[f] or 0 for f in COUNTS}, **{f: Decimal(row[f] or 0) for f in AMOUNTS}}
        for row in sums
    ]
    unbilled = {}
    for (name, _, _), n in by_key.items():
        unbilled[name] = unbilled.get(name, 0) + n
    totals = {}
    for row in rows:
        row["unbilled_requests"] = unbilled.get(row["tenant"], 0)
        if row["internal"]:
            continue
        total = totals.setdefault(row["currency"], {"currency": row["currency"], "tenants": 0,
                                                    **{f: 0 for f in COUNTS}, **{f: Decimal(0) for f in AMOUNTS}})
        total["tenants"] += 1
        for f in LINE_FIELDS:
            total[f] += row[f]
    return {"period": f"{year:04d}-{month:02d}", "from": start, "to": end,
            "rows": [row for row in rows if not row["internal"]], "internal": [row for row in rows if row["internal"]],
            "totals": [totals[currency] for currency in sorted(totals)],
            "unbilled_requests": sum(n for name, n in unbilled.items()),
            "idle": sorted({t.name for t in tenants if not t.internal} - {row["tenant"] for row in rows})}
