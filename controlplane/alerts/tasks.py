"""Alert tasks. Thin: ids in, a service call out; retries and limits declared here."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings
from django.db import DatabaseError

from controlplane.alerts.delivery import delivery_attempt
from controlplane.alerts.selectors import deliveries_due
from controlplane.alerts.services import alerts_evaluate as evaluate


@shared_task(name="alerts.evaluate", soft_time_limit=60, time_limit=90)
def alerts_evaluate() -> int:
    result = evaluate()
    return result.fired + result.resolved


# The webhook's own failures are retried by the delivery row (backoff, then given up, visible on
# the page); these retries cover the database going away under the task.
@shared_task(name="alerts.deliver", autoretry_for=(DatabaseError,), retry_backoff=2, retry_jitter=True,
             max_retries=3, soft_time_limit=45, time_limit=60)
def alert_deliver(delivery_id: int) -> str | None:
    return delivery_attempt(delivery_id=delivery_id)


@shared_task(name="alerts.deliver_due", soft_time_limit=30, time_limit=60)
def alert_deliveries_due() -> int:
    """Send again what is due: retries whose time has come, and anything never sent."""
    due = deliveries_due()
    for delivery_id in due:
        alert_deliver.apply_async(args=[delivery_id], expires=settings.ALERTS_DELIVER_SECONDS * 3)
    return len(due)
