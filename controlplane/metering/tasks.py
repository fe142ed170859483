"""Metering tasks. Thin: a service call each; limits declared here."""

from __future__ import annotations

from celery import shared_task

from controlplane.metering.rollups import rollup_daily


@shared_task(name="metering.rollup_daily", soft_time_limit=300, time_limit=360)
def metering_rollup_daily() -> int:
    return rollup_daily()  # the hours first, then the days from them
