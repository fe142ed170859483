from __future__ import annotations

import datetime as dt

from django.db.models import Sum

from controlplane.metering.models import DailyUsage


def image_tokens_per_day(*, tenants, since: dt.date) -> dict[str, list[tuple[dt.date, int]]]:
    """Image tokens per day and tier for `tenants`, read from the daily rollups."""
    rows = (
        DailyUsage.objects.filter(tenant__in=tenants, day__gte=since)
        .values("day", "tier__name")
        .annotate(tokens=Sum("image_tokens"))
        .filter(tokens__gt=0)  # text-only tiers would only draw empty bars
        .order_by("day", "tier__name")
    )
    series: dict[str, list[tuple[dt.date, int]]] = {}
    for row in rows:
        series.setdefault(row["tier__name"], []).append((row["day"], row["tokens"]))
    return series


def usage_totals(*, tenants, since: dt.date) -> dict:
    totals = DailyUsage.objects.filter(tenant__in=tenants, day__gte=since).aggregate(
        requests=Sum("requests"), images=Sum("images"), image_tokens=Sum("image_tokens"),
        text_tokens=Sum("text_tokens"), output_tokens=Sum("output_tokens"), cost=Sum("cost"),
    )
    return {k: v or 0 for k, v in totals.items()}


def cost_per_day(*, tenants, since: dt.date) -> dict[str, list[tuple[dt.date, float]]]:
    """Cost per day and tier for `tenants`, read from the daily rollups."""
    rows = (
        DailyUsage.objects.filter(tenant__in=tenants, day__gte=since)
        .values("day", "tier__name")
        .annotate(cost=Sum("cost"))
        .filter(cost__gt=0)
        .order_by("day", "tier__name")
    )
    series: dict[str, list[tuple[dt.date, float]]] = {}
    for row in rows:
        series.setdefault(row["tier__name"], []).append((row["day"], float(row["cost"])))
    return series
