"""Reads of metered usage that are not rollups."""

from __future__ import annotations

import datetime as dt

from django.db.models import Count, Max

from controlplane.metering.models import UsageEvent


def image_count_disagreements(*, since: dt.datetime) -> list[dict]:
    """Per tier since `since`: answers whose engine counted other image tokens than the
    gateway, and the latest of them (a partial index keeps this cheap at any volume)."""
    return list(
        UsageEvent.objects.filter(image_tokens_disagree=True, created_at__gte=since)
        .values("tier__name").annotate(count=Count("id"), latest=Max("created_at")).order_by("tier__name")
    )
