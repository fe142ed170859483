"""The gateway's tasks. Thin: a service call each; limits declared here."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from controlplane.gateway.ledger import drain_spool, journal_reap
from controlplane.metering.outbox import usage_ingest


@shared_task(name="gateway.usage_ingest", soft_time_limit=60, time_limit=90)
def usage_ingest_run() -> int:
    """Record what dead gateways left in flight, then move the usage stream into the database."""
    drain_spool()  # first: a spooled finish is the truth the reaper would otherwise guess at
    reaped = journal_reap()
    return reaped + (usage_ingest() if settings.USAGE_OUTBOX == "redis" else 0)
