"""Metering tasks. Thin: a service call each; limits declared here."""

from __future__ import annotations

from celery import shared_task

from controlplane.metering.captures import captures_prune
from controlplane.metering.partitions import partitions_ensure, partitions_retire
from controlplane.metering.rollups import rollup_daily


@shared_task(name="metering.rollup_daily", soft_time_limit=300, time_limit=360)
def metering_rollup_daily() -> int:
    return rollup_daily()  # the hours first, then the days from them


@shared_task(name="metering.captures_prune", soft_time_limit=120, time_limit=180)
def metering_captures_prune() -> int:
    return captures_prune()


@shared_task(name="metering.partitions_ensure", soft_time_limit=600, time_limit=660)
def metering_partitions_ensure() -> list[str]:
    return partitions_ensure()


@shared_task(name="metering.partitions_retire", soft_time_limit=3600, time_limit=3700)
def metering_partitions_retire() -> list[str]:
    return partitions_retire()
