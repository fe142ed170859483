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

from django.db.models import Count, Sum

from controlplane.metering.models import UsageEvent
from controlplane.metering.periods import month_bounds
from controlplane.metering.services import billed

COUNTS = ("requests", "images", "image_tokens", "cached_image_tokens", "text_tokens", "output_tokens")
AMOUNTS = ("cost", "cache_savings")
LINE_FIELDS = (*COUNTS, *AMOUNTS)


def statement(*, tenant, year: int, month: int) -> dict:
    start, end = month_bounds(year, month)
    month_events = UsageEvent.objects.filter(tenant=tenant, created_at__gte=start, created_at__lt=end)
    lines = list(
        month_events.filter(billed())
        .values("tier__name", "tier__price_plan__currency").order_by("tier__name")
        .annotate(requests=Count("id"), images=Sum("image_count"), image_tokens=Sum("image_tokens"),
                  cached_image_tokens=Sum("cached_image_tokens"), text_tokens=Sum("text_tokens"),
                  output_tokens=Sum("output_tokens"), cost=Sum("cost"), cache_savings=Sum("cache_savings"))
    )
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
        "unbilled_requests": month_events.exclude(billed()).count(),
        "unrated_requests": month_events.filter(rated=False).count(),
    }


def month_statements(*, tenants, year: int, month: int) -> dict:
    """Every one of `tenants`' statement totals for a month, in two queries: a row per tenant
    and currency (each equal to that tenant's statement), the totals per currency of the client
    tenants, and the service's own (internal) tenants apart, in no total."""
    start, end = month_bounds(year, month)
    events = UsageEvent.objects.filter(tenant__in=tenants, created_at__gte=start, created_at__lt=end)
    rows = [
        {"tenant": row["tenant__name"], "internal": row["tenant__internal"], "currency": row["tier__price_plan__currency"],
         **{f: row[f] or 0 for f in COUNTS}, **{f: Decimal(row[f] or 0) for f in AMOUNTS}}
        for row in events.filter(billed()).values("tenant__name", "tenant__internal", "tier__price_plan__currency")
        .order_by("tenant__name", "tier__price_plan__currency")
        .annotate(requests=Count("id"), images=Sum("image_count"), image_tokens=Sum("image_tokens"),
                  cached_image_tokens=Sum("cached_image_tokens"), text_tokens=Sum("text_tokens"),
                  output_tokens=Sum("output_tokens"), cost=Sum("cost"), cache_savings=Sum("cache_savings"))
    ]
    unbilled = dict(events.exclude(billed()).values("tenant__name").order_by().annotate(n=Count("id"))
                    .values_list("tenant__name", "n"))
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
