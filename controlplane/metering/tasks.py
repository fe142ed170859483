"""Metering tasks. Thin: a service call each; limits declared here."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings


@shared_task(name="metering.ingest", soft_time_limit=60, time_limit=90)
def metering_ingest() -> int:
    """Record what dead gateways left in flight, then move the usage stream into the database."""
    from controlplane.gateway.ledger import drain_spool, journal_reap
    from controlplane.metering.outbox import usage_ingest

    drain_spool()  # first: a spooled finish is the truth the reaper would otherwise guess at
    reaped = journal_reap()
    return reaped + (usage_ingest() if settings.USAGE_OUTBOX == "redis" else 0)


@shared_task(name="metering.rollup_daily", soft_time_limit=300, time_limit=360)
def metering_rollup_daily() -> int:
    from controlplane.metering.services import rollup_daily

    return rollup_daily()  # the hours first, then the days from them
