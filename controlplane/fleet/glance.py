"""Each tier at work, as the operator's home page and the tier's own page show it: its engines
by state, how many serve now, and its last hour of traffic. A few queries for any number of
tiers."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass, field

from django.db.models import Count

from controlplane.catalog.models import ModelTier
from controlplane.fleet.models import EngineInstance
from controlplane.fleet.selectors import routable_counts
from controlplane.metering.traffic import traffic_by_tier

HOUR = dt.timedelta(hours=1)


@dataclass
class TierHealth:
    tier: ModelTier
    engines: Counter = field(default_factory=Counter)  # actual state -> count (candidates left out)
    serving: int = 0  # routable now
    requests: int = 0  # in the last hour
    errors: int = 0  # 5xx
    ttft_p50: float | None = None  # ms, streamed requests
    ttft_p95: float | None = None
    latency_p95: float | None = None

    @property
    def error_rate(self) -> float | None:
        return 100 * self.errors / self.requests if self.requests else None

    @property
    def unserved(self) -> bool:
        return self.tier.enabled and not self.serving

    @property
    def states(self) -> list[tuple[str, int]]:
        return sorted(self.engines.items())


def tiers_health(tiers: list[ModelTier], *, now: dt.datetime) -> list[TierHealth]:
    """TierHealth of each of `tiers`, in their order."""
    found = {tier.pk: TierHealth(tier=tier) for tier in tiers}
    for row in (EngineInstance.objects.filter(tier_id__in=found).exclude(pool="candidate")
                .values("tier_id", "actual_state").order_by().annotate(n=Count("id"))):
        found[row["tier_id"]].engines[row["actual_state"]] += row["n"]
    for tier_id, serving in routable_counts(now=now).items():
        if tier_id in found:
            found[tier_id].serving = serving
    for tier_id, points in traffic_by_tier(since=now - HOUR, until=now, bucket=HOUR, tier_ids=list(found)).items():
        if tier_id in found and points:
            point, health = points[0], found[tier_id]
            health.requests, health.errors = point.requests, point.errors
            health.ttft_p50, health.ttft_p95, health.latency_p95 = point.ttft_p50, point.ttft_p95, point.latency_p95
    return list(found.values())
