"""Alert reads for the pages and the sweep."""

from __future__ import annotations

import datetime as dt

from django.db.models import Count, Max, OuterRef, Prefetch, Q, Subquery
from django.utils import timezone

from controlplane.alerts.models import Alert, AlertDelivery, Webhook


def alerts_firing():
    """Firing alerts, the newest first, each with its deliveries."""
    return (Alert.objects.filter(state=Alert.State.FIRING).select_related("rule")
            .prefetch_related(Prefetch("deliveries", queryset=AlertDelivery.objects.select_related("webhook")
                                       .order_by("webhook__name", "event")))
            .order_by("-fired_at", "-id"))


def alerts_firing_count() -> int:
    return Alert.objects.filter(state=Alert.State.FIRING).count()


def alerts_resolved_recently(*, since: dt.datetime, limit: int = 50):
    return (Alert.objects.filter(state=Alert.State.RESOLVED, resolved_at__gte=since).select_related("rule")
            .order_by("-resolved_at", "-id")[:limit])


def webhooks_with_delivery_status(*, since: dt.datetime) -> list[Webhook]:
    """Every webhook with its deliveries since `since` counted by state, when it last took one,
    and its latest failure (given up, or an attempt still to be retried)."""
    failures = AlertDelivery.objects.filter(webhook=OuterRef("pk")).exclude(last_error="").exclude(
        state=AlertDelivery.State.DELIVERED).order_by("-created_at", "-id")
    recent = Q(deliveries__created_at__gte=since)
    return list(Webhook.objects.annotate(
        delivered=Count("deliveries", filter=recent & Q(deliveries__state=AlertDelivery.State.DELIVERED)),
        pending=Count("deliveries", filter=Q(deliveries__state=AlertDelivery.State.PENDING)),
        failed=Count("deliveries", filter=recent & Q(deliveries__state=AlertDelivery.State.FAILED)),
        last_delivered_at=Max("deliveries__delivered_at"),
        last_error=Subquery(failures.values("last_error")[:1]),
        last_error_at=Subquery(failures.values("created_at")[:1]),
    ).order_by("name"))


def deliveries_failed_recently(*, since: dt.datetime, limit: int = 20):
    return (AlertDelivery.objects.filter(state=AlertDelivery.State.FAILED, created_at__gte=since)
            .select_related("alert__rule", "webhook").order_by("-created_at", "-id")[:limit])


def deliveries_due(*, now: dt.datetime | None = None, limit: int = 500) -> list[int]:
    """Pending deliveries whose next attempt is due: never sent (the broker was away), or to
    be tried again, or claimed by a worker that died."""
    now = now or timezone.now()
    return list(AlertDelivery.objects.filter(state=AlertDelivery.State.PENDING, next_attempt_at__lte=now)
                .order_by("next_attempt_at").values_list("pk", flat=True)[:limit])
