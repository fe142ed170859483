"""Reads of metered usage that are not rollups."""

from __future__ import annotations

import datetime as dt

from django.db.models import Count, Max
from django.utils import timezone

from controlplane.metering.models import UsageEvent
from controlplane.metering.services import metered_so_far


def image_count_disagreements(*, since: dt.datetime) -> list[dict]:
    """Per tier since `since`: answers whose engine counted other image tokens than the
    gateway, and the latest of them (a partial index keeps this cheap at any volume)."""
    return list(
        UsageEvent.objects.filter(image_tokens_disagree=True, created_at__gte=since)
        .values("tier__name").annotate(count=Count("id"), latest=Max("created_at")).order_by("tier__name")
    )


def quota_use(*, tenant, quota, now: dt.datetime | None = None) -> list[dict]:
    """Each limit of `quota` beside what `tenant` has used against it, as admission counts
    (the tenant pages and the quota alerts read the same figures)."""
    if quota is None:
        return []
    now = now or timezone.now()
    image, total = metered_so_far(tenant.pk, quota.period, now)
    used = {"image_tokens": image, "total_tokens": total,
            "requests_per_minute": UsageEvent.objects.filter(
                tenant=tenant, created_at__gte=now - dt.timedelta(minutes=1)).count()}
    rows = []
    for name in quota.LIMITS:
        limit = getattr(quota, name)
        value = used.get(name)
        rows.append({"name": name, "label": name.replace("_", " ").capitalize(), "limit": limit, "used": value,
                     "share": round(100 * value / limit) if limit and value is not None else None,
                     "left": max(0, limit - value) if limit and value is not None else None})
    return rows
