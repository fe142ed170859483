"""Monthly statements. Each request's cost was fixed (and rounded) when it was recorded, at
the price then in effect, so a statement is a sum of recorded costs: it equals its lines
exactly, and a later price change never rewrites a closed month."""

from __future__ import annotations

from decimal import Decimal

from django.db.models import Count, Sum

from controlplane.metering.models import UsageEvent
from controlplane.metering.periods import month_bounds

LINE_FIELDS = ("requests", "images", "image_tokens", "cached_tokens", "text_tokens", "output_tokens", "cost")


def statement(*, tenant, year: int, month: int) -> dict:
    start, end = month_bounds(year, month)
    lines = list(
        UsageEvent.objects.filter(tenant=tenant, created_at__gte=start, created_at__lt=end)
        .exclude(status=UsageEvent.Status.ERROR)
        .values("tier__name").order_by("tier__name")
        .annotate(requests=Count("id"), images=Sum("image_count"), image_tokens=Sum("image_tokens"),
                  cached_tokens=Sum("cached_tokens"), text_tokens=Sum("text_tokens"),
                  output_tokens=Sum("output_tokens"), cost=Sum("cost"))
    )
    rows = [{"tier": line["tier__name"], **{f: line[f] or (Decimal(0) if f == "cost" else 0) for f in LINE_FIELDS}}
            for line in lines]
    return {
        "tenant": tenant.name, "period": f"{year:04d}-{month:02d}", "from": start, "to": end, "currency": "USD",
        "lines": rows,
        "total": sum((row["cost"] for row in rows), Decimal(0)),
        "unrated_requests": UsageEvent.objects.filter(tenant=tenant, created_at__gte=start, created_at__lt=end,
                                                      rated=False).count(),
    }
