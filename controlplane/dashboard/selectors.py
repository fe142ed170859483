from __future__ import annotations

import datetime as dt

from django.db.models import Sum

from controlplane.metering.models import DailyUsage


def _per_day(field: str, *, tenants, since: dt.date) -> dict[str, list[tuple[dt.date, float]]]:
    """A rollup counter per day and tier for `tenants`, leaving out tiers with none of it."""
    rows = (
        DailyUsage.objects.filter(tenant__in=tenants, day__gte=since)
        .values("day", "tier__name")
        .annotate(total=Sum(field))
        .filter(total__gt=0)  # a text-only tier would only draw empty image-token bars
        .order_by("day", "tier__name")
    )
    series: dict[str, list[tuple[dt.date, float]]] = {}
    for row in rows:
        series.setdefault(row["tier__name"], []).append((row["day"], row["total"]))
    return series


def image_tokens_per_day(*, tenants, since: dt.date) -> dict[str, list[tuple[dt.date, int]]]:
    """Image tokens per day and tier for `tenants`, read from the daily rollups."""
    return _per_day("image_tokens", tenants=tenants, since=since)


def usage_totals(*, tenants, since: dt.date) -> dict:
    totals = DailyUsage.objects.filter(tenant__in=tenants, day__gte=since).aggregate(
        requests=Sum("requests"), images=Sum("images"), image_tokens=Sum("image_tokens"),
        text_tokens=Sum("text_tokens"), output_tokens=Sum("output_tokens"), cost=Sum("cost"),
    )
    return {k: v or 0 for k, v in totals.items()}


def cost_per_day(*, tenants, since: dt.date) -> dict[str, list[tuple[dt.date, float]]]:
    """Cost per day and tier for `tenants`, read from the daily rollups."""
    return {tier: [(day, float(cost)) for day, cost in points]
            for tier, points in _per_day("cost", tenants=tenants, since=since).items()}
